"""`--data HFDataset`: a local folder of JSONL files streamed by `datasets`, each rank its own shards, tokenized on the
fly and packed; a killed run resumes to the same weights; bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from streaming_helpers import stories, tokenizer
from test_streaming_data import pretrain, training_state
from test_training import assert_same_weights, drop_after, weights

from litgpt.data import HFDataset
from litgpt.data.tiny import TOKENIZER_DIR
from litgpt.errors import UserError
from litgpt.tokenizer import Tokenizer

pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def write_shards(folder: Path, shards: int, per_shard: int, validation: int = 4) -> list[list[str]]:
    """`train-K.jsonl` shards of stories and a `validation-0.jsonl`; returns each shard's documents."""
    pool = stories()
    folder.mkdir(parents=True, exist_ok=True)
    documents = [pool[k * per_shard:(k + 1) * per_shard] for k in range(shards)]
    for k, shard in enumerate(documents):
        (folder / f"train-{k}.jsonl").write_text("".join(json.dumps({"text": t, "n": 1}) + "\n" for t in shard))
    held = pool[-validation:]
    (folder / "validation-0.jsonl").write_text("".join(json.dumps({"text": t, "n": 1}) + "\n" for t in held))
    return documents


def hf_data(folder: Path, **options) -> HFDataset:
    return HFDataset(path=str(folder), val_split="validation", **options)


def test_a_resumed_run_ends_bit_equal_to_an_uninterrupted_one(tmp_path):
    write_shards(tmp_path / "data", shards=2, per_shard=2)  # ~700 tokens: 6 steps of 4 blocks pass the end
    long_run = dict(max_steps=6, save_interval=3)
    pretrain(tmp_path / "whole", hf_data(tmp_path / "data"), **long_run)
    pretrain(tmp_path / "stopped", hf_data(tmp_path / "data"), **long_run)
    drop_after(tmp_path / "stopped", 3)
    pretrain(tmp_path / "stopped", hf_data(tmp_path / "data"), resume="auto", **long_run)
    whole, resumed = training_state(tmp_path / "whole", 6), training_state(tmp_path / "stopped", 6)
    assert whole["data_positions"][0]["epoch"] >= 1, "the run should pass the end of the data"
    assert whole["data_positions"] == resumed["data_positions"]
    assert_same_weights(weights(tmp_path / "whole" / "final"), weights(tmp_path / "stopped" / "final"), 0)


def consumed_ids(stream, blocks: int) -> list[int]:
    ids = [block for _, block in zip(range(blocks), stream.blocks())]
    return torch.cat(ids).tolist() if ids else []


def test_each_of_two_nodes_of_two_ranks_reads_its_own_shard_and_nothing_else(tmp_path, monkeypatch):
    """4 shards over 2 nodes x 2 processes: rank r's tokens are exactly shard r's documents, in order, so no rank
    reads another's; together they are the corpus, nothing twice."""
    documents = write_shards(tmp_path / "data", shards=4, per_shard=3)
    monkeypatch.setenv("WORLD_SIZE", "4")
    everything = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        data = hf_data(tmp_path / "data")
        data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=32)
        stream = data.train_dataset()
        read = consumed_ids(stream, blocks=10_000) + stream.pending
        mine = torch.cat([tokenizer().encode(doc, eos=True) for doc in documents[rank]]).tolist()
        assert read == mine, rank
        everything += read
    all_ids = torch.cat([tokenizer().encode(doc, eos=True) for shard in documents for doc in shard]).tolist()
    assert sorted(everything) == sorted(all_ids)


@pytest.mark.parametrize("options, message", [
    (dict(text_field="body"), "have no field 'body' (their fields: text, n): name the text's field"),
    (dict(split="test"), "Cannot read split 'test' of the dataset"),
    (dict(path="/nonexistent/folder"), "Cannot read split 'train' of the dataset '/nonexistent/folder'"),
], ids=["no-text-field", "no-such-split", "unreachable-path"])
def test_bad_input_is_one_line(tmp_path, options, message):
    write_shards(tmp_path / "data", shards=1, per_shard=2)
    data = HFDataset(**{"path": str(tmp_path / "data"), **options})
    data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=32)
    with pytest.raises(UserError) as info:
        data.prepare()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_empty_split_is_one_line(tmp_path):
    write_shards(tmp_path / "data", shards=1, per_shard=2)
    (tmp_path / "data" / "validation-0.jsonl").write_text("")
    data = hf_data(tmp_path / "data")
    data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=32)
    with pytest.raises(UserError, match="validation"):
        data.prepare()

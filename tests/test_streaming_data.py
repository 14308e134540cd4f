"""Streamed pretraining data (LitData, TinyLlama, MicroLlama): folders written by litdata's own `optimize`, read by
our runs; a killed run resumes from every rank's loader position to the same weights; bad folders are one line."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from streaming_helpers import block_corpus, tinyllama_layout
from test_litgpt_recipes import HUB
from test_training import OPTIMIZER, SMALL, assert_same_weights, drop_after, weights

from litgpt.__main__ import main as cli_main
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import LitData, MicroLlama, TinyLlama
from litgpt.data.streaming import open_dataset
from litgpt.data.tiny import TOKENIZER_DIR
from litgpt.errors import UserError
from litgpt.tokenizer import Tokenizer

pytest.importorskip("litdata")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
SPLITS = ("slimpajama/train", "slimpajama/val")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return tinyllama_layout(tmp_path_factory.mktemp("optimized"))


def pretrain(out_dir: Path, data, resume=False, **train_overrides) -> None:
    from litgpt.pretrain import setup

    train = dict(global_batch_size=4, micro_batch_size=2, max_steps=6, lr_warmup_steps=2, save_interval=3,
                 log_interval=1, max_seq_length=32, min_lr=1e-4)
    train.update(train_overrides)
    setup(model_config=Config(**SMALL), out_dir=out_dir, data=data, train=TrainArgs(**train), precision="32-true",
          eval=EvalArgs(interval=3, max_iters=2), optimizer=OPTIMIZER, devices=1, tokenizer_dir=TOKENIZER_DIR,
          resume=resume, seed=7)


def training_state(out_dir: Path, step: int) -> dict:
    return torch.load(out_dir / f"step-{step:06d}" / "training_state.pth", weights_only=True)["train_state"]


@pytest.mark.parametrize("mixture", [False, True], ids=["one-folder", "tinyllama-mixture"])
def test_a_resumed_run_ends_bit_equal_to_an_uninterrupted_one(corpus, tmp_path, mixture):
    make = (lambda: TinyLlama(corpus, num_workers=0)) if mixture else (
        lambda: LitData(corpus, split_names=SPLITS, num_workers=0))
    pretrain(tmp_path / "whole", make())
    pretrain(tmp_path / "stopped", make())
    drop_after(tmp_path / "stopped", 3)
    pretrain(tmp_path / "stopped", make(), resume="auto")
    saved = training_state(tmp_path / "stopped", 3)["data_positions"]
    assert len(saved) == 1 and saved[0]["current_epoch"] == 1  # one rank's loader position, three steps in
    whole, resumed = training_state(tmp_path / "whole", 6), training_state(tmp_path / "stopped", 6)
    assert whole["data_positions"] == resumed["data_positions"]
    assert_same_weights(weights(tmp_path / "whole" / "final"), weights(tmp_path / "stopped" / "final"), 0)


def test_the_loader_yields_litdatas_own_blocks_in_litdatas_order(corpus):
    """Our batches are litdata's StreamingDataLoader's, its blocks split into inputs and next-token labels."""
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    data = LitData(corpus, split_names=SPLITS, num_workers=0)
    data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=32)
    data.prepare()
    batches = data.batches(data.train_dataset(), micro_batch_size=2, seed=0, rank=0, world_size=1)
    reference = StreamingDataLoader(
        StreamingDataset(str(corpus / SPLITS[0]), item_loader=TokensLoader(block_size=33), shuffle=True, seed=42,
                         drop_last=True), batch_size=2, num_workers=0, drop_last=True)
    assert batches.per_epoch == len(reference) > 10
    for (epoch, index, batch), block in zip(batches.iterate(), reference):
        assert torch.equal(batch["input_ids"], block[:, :-1].long())
        assert torch.equal(batch["labels"], block[:, 1:].long())
    val = data.val_dataset()
    whole = StreamingDataset(str(corpus / SPLITS[1]), item_loader=TokensLoader(block_size=33), shuffle=False)
    assert len(val) == len(whole) and torch.equal(val[len(val) - 1]["labels"], whole[len(whole) - 1][1:].long())


@pytest.mark.parametrize("recipe", ["tinyllama.yaml", "microllama.yaml"])
def test_litgpts_own_recipes_run_with_only_the_data_path_and_sizes_changed(corpus, tmp_path, recipe, capsys):
    Config(**SMALL).save(tmp_path / "model.yaml")
    out = tmp_path / "out"
    cli_main([
        "pretrain", "--config", str(HUB / "pretrain" / recipe), "--data.data_path", str(corpus),
        "--data.num_workers", "0", "--model_config", str(tmp_path / "model.yaml"), "--tokenizer_dir",
        str(TOKENIZER_DIR), "--out_dir", str(out), "--precision", "32-true", "--devices", "1", "--logger_name", "csv",
        "--train.max_tokens", "null", "--train.max_steps", "2", "--train.max_seq_length", "32",
        "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--eval.max_iters", "1",
    ])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["tokens"] == 2 * 4 * 32
    assert "data.num_workers" not in capsys.readouterr().out  # it has an effect here: no note says otherwise


def test_a_mixture_saved_by_other_ranks_says_so_in_one_line_and_goes_on_with_its_next_pass(corpus, capsys):
    """litdata re-divides a single folder's epoch among a new number of ranks, not a weighted mixture's."""
    data = TinyLlama(corpus, num_workers=0)
    data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=32)
    first = data.batches(data.train_dataset(), micro_batch_size=2, seed=0, rank=0, world_size=1)
    stream = first.iterate()
    for _ in range(3):
        next(stream)
    saved = first.state_dict()
    for child in saved["dataset"].values():
        child["world_size"] = 2  # as two ranks would have saved it
    again = data.batches(data.train_dataset(), micro_batch_size=2, seed=0, rank=0, world_size=1)
    again.load_state_dict([saved, saved])
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "saved with 2 rank(s) cannot be carried over to 1 rank(s)" in out
    fresh = data.batches(data.train_dataset(), micro_batch_size=2, seed=0, rank=0, world_size=1)
    second_pass = next(batch for epoch, _, batch in fresh.iterate() if epoch == 1)
    assert torch.equal(next(again.iterate())[2]["input_ids"], second_pass["input_ids"])


# ---- bad input: one line each, nothing lost ---------------------------------------------------------------------------
def broken_copy(corpus: Path, tmp_path: Path, damage) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(corpus, root)
    damage(root / "slimpajama" / "train")
    return root


def truncate_first_shard(folder: Path) -> None:
    shard = sorted(folder.glob("chunk-*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:100])


def empty_index(folder: Path) -> None:
    index = json.loads((folder / "index.json").read_text())
    (folder / "index.json").write_text(json.dumps({**index, "chunks": []}))


@pytest.mark.parametrize("damage, message", [
    (lambda f: sorted(f.glob("chunk-*.bin"))[0].unlink(), "chunk-0-0.bin' named in index.json is missing"),
    (truncate_first_shard, "has 100 bytes where index.json says"),
    (lambda f: (f / "index.json").unlink(), "has no index.json, so it is not a litdata optimized folder"),
    (empty_index, "holds no tokens (its index lists no chunk): the split is empty"),
    (lambda f: shutil.rmtree(f), "does not exist"),
    (lambda f: (f / "litgpt_tokenizer.json").write_text(json.dumps({"vocab_size": 32000, "bos_id": 1, "eos_id": 2})),
     "was tokenized with another tokenizer (vocab_size 32000 there, 4096 here, bos_id 1 there"),
], ids=["missing-shard", "truncated-shard", "no-index", "empty-split", "no-folder", "other-tokenizer"])
def test_a_bad_folder_is_one_line_before_training(corpus, tmp_path, damage, message, capsys):
    root = broken_copy(corpus, tmp_path, damage)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--model_config", json.dumps(SMALL), "--data", "MicroLlama", "--data.data_path",
                  str(root), "--data.num_workers", "0", "--tokenizer_dir", str(TOKENIZER_DIR), "--out_dir",
                  str(tmp_path / "out"), "--train.max_steps", "1", "--train.max_seq_length", "32", "--devices", "1"])
    err = "".join(line for line in capsys.readouterr().err.splitlines(True) if "Seed set to" not in line)
    assert info.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("litgpt pretrain: error: ") and message in err, err
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing of the data was touched
    assert not (tmp_path / "out" / "final").exists()


def test_a_path_litdata_cannot_reach_is_one_line(tmp_path):
    data = MicroLlama(f"{tmp_path}/nowhere", num_workers=0)
    data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=32)
    with pytest.raises(UserError, match="Cannot read the litdata folder .*nowhere/slimpajama/train"):
        data.train_dataset()


# ---- each rank reads its own part ------------------------------------------------------------------------------------
def torchrun(nodes: int, folder: str, out: Path, micro_batches: str, *extra, caches: list[Path]) -> None:
    """`nodes` torchrun launches of 2 processes each on this machine, each node with its own litdata cache folder."""
    from ports import free_port
    from test_fault_tolerance import child_environment

    port, launches = free_port(), []
    for node_rank in range(nodes):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", "2",
                   "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
                   str(Path(__file__).parent / "streaming_ranks.py"), folder, str(out), micro_batches, *extra]
        environment = child_environment(LITDATA_CACHE_DIR=str(caches[node_rank]))
        launches.append(subprocess.Popen(command, env=environment, text=True, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE))
    outcomes = [(process, process.communicate(timeout=300)[1]) for process in launches]
    # A rank's own error comes before the launcher's report of it, which alone can fill the tail.
    failed = [f"node {rank}:\n{first_errors(stderr)}\n...\n{stderr[-1500:]}"
              for rank, (process, stderr) in enumerate(outcomes) if process.returncode]
    assert not failed, "\n".join(failed)


def first_errors(stderr: str) -> str:
    """The lines of the ranks' own tracebacks' last frames and messages (`[rankN]: ...Error: ...`), at most 40."""
    lines = stderr.splitlines()
    marks = [i for i, line in enumerate(lines) if "Error" in line and "[rank" in line]
    return "\n".join(line for i in marks[:8] for line in lines[max(0, i - 4):i + 1])


PREPARE_ALONE = """
import sys
from litgpt.data import LitData
from litgpt.data.tiny import TOKENIZER_DIR
from litgpt.tokenizer import Tokenizer
data = LitData(sys.argv[1], num_workers=0)
data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=32)
data.prepare()
"""


def test_prepare_fetches_a_remote_index_into_the_node_cache_before_the_other_ranks_open_it(tmp_path):
    """`prepare` runs on a node's first process while the others wait; it must leave the folder's index in the node's
    cache, since litdata lets another process wait only a second for a download under way (a loaded node failed)."""
    folder, cache = tmp_path / "corpus", tmp_path / "node-cache"
    block_corpus(folder, blocks=8, block_size=33, blocks_per_chunk=4)
    from test_fault_tolerance import child_environment

    subprocess.run([sys.executable, "-c", PREPARE_ALONE, f"local:{folder}"], check=True, timeout=120,
                   env=child_environment(LITDATA_CACHE_DIR=str(cache)))
    assert [path.name for path in cache.rglob("index.json")] == ["index.json"]
    assert not list(cache.rglob("chunk-*.bin"))  # the index only: shards are fetched by the rank that reads them


def rows(blocks: torch.Tensor) -> list[tuple]:
    return sorted(tuple(row.tolist()) for row in blocks)


@pytest.mark.slow
def test_two_nodes_of_two_ranks_read_their_own_blocks_and_resume_on_another_world_size(tmp_path):
    """2 nodes x 2 processes stream a folder through node-local caches (litdata's `local:` remote) for half an epoch,
    then one node of 2 processes resumes from their positions for the other half: the blocks the six ranks consumed
    are exactly the folder's, none twice, none missing, and no node fetched every shard."""
    folder = tmp_path / "corpus"
    blocks = block_corpus(folder, blocks=128, block_size=33, blocks_per_chunk=4)
    caches = [tmp_path / "node0-cache", tmp_path / "node1-cache"]
    first, rest = tmp_path / "first", tmp_path / "rest"
    first.mkdir(), rest.mkdir()
    torchrun(2, f"local:{folder}", first, "8", caches=caches)  # 8 micro-batches of 2 on each of 4 ranks: half
    read = [torch.load(first / f"blocks-{rank}.pt") for rank in range(4)]
    assert [len(part) for part in read] == [16] * 4
    assert len(set(rows(torch.cat(read)))) == 64  # four disjoint parts
    shards = len(list(folder.glob("chunk-*.bin")))
    for cache in caches:
        fetched = len(list(cache.rglob("chunk-*.bin")))
        assert 0 < fetched < shards, (fetched, shards)
    torchrun(1, f"local:{folder}", rest, "16", str(first / "positions.pt"), caches=caches)  # the other half
    read += [torch.load(rest / f"blocks-{rank}.pt") for rank in range(2)]
    assert [len(part) for part in read[4:]] == [32, 32]
    assert rows(torch.cat(read)) == rows(blocks)


# ---- the reader and litdata's prefetch thread share one loader --------------------------------------------------------
class PausingMap:
    """Stands in for an open chunk's `mmap`: its first `close()` runs `meanwhile` on another thread and waits for it
    (a second at most), which is the thread switch that failed a two-node run in CI."""

    def __init__(self, real, meanwhile):
        self.real, self.calls = real, 0
        self.other = threading.Thread(target=meanwhile)

    def close(self):
        self.calls += 1
        if self.calls == 1:
            self.other.start()
            self.other.join(timeout=1.0)
        self.real.close()


def test_the_prefetch_threads_delete_waits_for_the_readers_close_of_the_same_chunk(tmp_path, monkeypatch):
    """The reader closes the chunk it read to the end while litdata's prefetch thread deletes it from the node cache:
    both finish, the chunk is closed once and gone from the cache, and reading goes on."""
    import litdata.utilities.dataset_utilities

    folder, cache = tmp_path / "corpus", tmp_path / "node-cache"
    blocks = block_corpus(folder, blocks=8, block_size=33, blocks_per_chunk=4)
    monkeypatch.setattr(litdata.utilities.dataset_utilities, "_LITDATA_CACHE_DIR", str(cache))
    dataset = open_dataset(f"local:{folder}", block_size=33, shuffle=False, seed=0)
    assert torch.equal(dataset[0], blocks[0])
    loader = dataset.item_loader
    cached = [path for path in cache.rglob("chunk-*.bin") if "chunk-0-0" in path.name]
    assert len(cached) == 1 and list(loader._mmaps) == [0]
    errors = []

    def prefetch_thread_deletes():
        try:
            loader.delete(0, str(cached[0]))
        except Exception as error:
            errors.append(error)

    opened = loader._mmaps[0]
    pausing = PausingMap(opened._mmap, prefetch_thread_deletes)
    monkeypatch.setattr(opened, "_mmap", pausing)
    loader.close(0)  # litdata's own loader: KeyError here, or in the other thread
    pausing.other.join(timeout=60)  # the delete, now let in
    assert not errors and pausing.calls == 1 and not loader._mmaps and not cached[0].exists()
    assert torch.equal(dataset[5], blocks[5])


def test_the_loader_crosses_to_a_spawned_worker_with_its_own_lock(tmp_path):
    folder = tmp_path / "corpus"
    blocks = block_corpus(folder, blocks=8, block_size=33, blocks_per_chunk=4)
    dataset = open_dataset(str(folder), block_size=33, shuffle=False, seed=0)
    assert torch.equal(dataset[1], blocks[1])
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy.item_loader._open_chunks_lock is not dataset.item_loader._open_chunks_lock
    assert torch.equal(copy[6], blocks[6])

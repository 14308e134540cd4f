"""Data modules: token caches and windows, text sources in their real layouts, SFT records and prompt masking."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import tarfile
import time
from pathlib import Path

import jsonargparse
import numpy as np
import pytest
import torch

import litgpt.data
from litgpt.data import (
    JSON,
    LIMA,
    Alpaca,
    Alpaca2k,
    Dolly,
    MicroBatches,
    OpenWebText,
    RedPajama,
    SFTDataset,
    TextFiles,
    Tiny,
    TinyStories,
    TokenWindows,
)
from litgpt.data import tiny as tiny_module
from litgpt.data.base import DataModule
from litgpt.data.json_data import prompt_and_response
from litgpt.data.token_cache import (
    META_FILE,
    TOKENS_FILE,
    Corpus,
    ensure_token_cache,
    in_validation,
    pick_validation,
)
from litgpt.errors import UserError
from litgpt.prompts import PromptStyle
from litgpt.tokenizer import Tokenizer
from tokenizer_helpers import make_tokenizer_folder

ALL_MODULES = ["TextFiles", "Tiny", "TinyStories", "OpenWebText", "RedPajama", "JSON", "Alpaca", "Alpaca2k", "Dolly", "LIMA"]


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch) -> Path:
    """Default token caches go to a temporary folder, and no test thinks it is a non-first rank."""
    root = tmp_path / "litgpt-cache"
    monkeypatch.setenv("LITGPT_CACHE_DIR", str(root))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return root / "tokens"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_tokenizer_folder(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def tokenizer(llama_dir) -> Tokenizer:
    return Tokenizer(llama_dir)


# A word-level tokenizer whose ids can be written down by hand: "<s>" is added in front of every text.
WORDS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "hello", "world",
         "good", "bye", "say", "hi", "again", "be", "nice", "the", "end", "a", "b", "c", "d", "e"]
ID = {word: index for index, word in enumerate(WORDS)}


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, processors

    backend = Backend(models.WordLevel(vocab=ID, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", ID["<s>"])])
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>")])
    folder = tmp_path_factory.mktemp("words")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer(folder)


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def count_builds(monkeypatch) -> list[int]:
    """Counts the caches tokenized from now on."""
    from litgpt.data import token_cache

    calls = [0]
    original = token_cache.write_token_cache

    def write(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(token_cache, "write_token_cache", write)
    return calls


def cache_tokens(folder: Path) -> np.ndarray:
    meta = json.loads((folder / META_FILE).read_text())
    return np.fromfile(folder / TOKENS_FILE, dtype=meta["dtype"])


def expected_tokens(tokenizer: Tokenizer, documents) -> np.ndarray:
    return np.concatenate([tokenizer.encode(doc, eos=True).numpy() for doc in documents])


def all_documents_tokens(module, split: str) -> np.ndarray:
    return cache_tokens(module._cache(split).folder)


# ---- TokenWindows --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_windows_are_exact_shifted_windows(tmp_path, dtype):
    path = tmp_path / "tokens.bin"
    np.arange(100, 121, dtype=dtype).tofile(path)  # 21 tokens: 100 ... 120
    windows = TokenWindows(path, max_seq_length=4, dtype=dtype)
    assert len(windows) == 5  # (21 - 1) // 4
    for i in range(5):
        sample = windows[i]
        start = 100 + 4 * i
        assert sample["input_ids"].tolist() == list(range(start, start + 4))
        assert sample["labels"].tolist() == list(range(start + 1, start + 5))
        assert sample["input_ids"].dtype == sample["labels"].dtype == torch.long
    assert windows[-1]["labels"].tolist() == [117, 118, 119, 120]  # the last window ends at the last token
    with pytest.raises(IndexError):
        windows[5]
    # One token fewer: the last window no longer fits.
    assert len(TokenWindows(path, 4, dtype=dtype, num_tokens=20)) == 4
    assert len(TokenWindows(path, 20, dtype=dtype)) == 1 and len(TokenWindows(path, 21, dtype=dtype)) == 0


def test_token_windows_map_lazily_and_pickle_without_the_tokens(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    windows = TokenWindows(path, 10)
    assert windows._tokens is None
    assert windows[3]["input_ids"].tolist() == list(range(30, 40))
    assert isinstance(windows._tokens, np.memmap)
    data = pickle.dumps(windows)
    assert len(data) < 1000  # the tokens are not in the pickle
    restored = pickle.loads(data)
    assert restored._tokens is None and len(restored) == 99  # (1000 - 1) // 10
    assert restored[98]["labels"].tolist() == list(range(981, 991))


# ---- the cache -------------------------------------------------------------------------------------------------------
def _corpus(name: str, documents: list[str], files: list[Path]) -> Corpus:
    return Corpus(name, files, lambda: iter(documents), {"test": True})


def test_cache_holds_every_document_with_eos_and_its_meta(tmp_path, tokenizer):
    source = tmp_path / "source.txt"
    source.write_text("x")
    documents = ["The quick brown fox.", "   ", "Language models read text."]
    cache = ensure_token_cache(_corpus("docs", documents, [source]), tokenizer, tmp_path / "cache")
    assert cache.folder == tmp_path / "cache" / "docs"
    tokens = cache_tokens(cache.folder)
    assert tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, expected_tokens(tokenizer, [documents[0], documents[2]]))
    assert tokens[0] == tokenizer.bos_id and tokens[-1] == tokenizer.eos_id
    meta = json.loads(cache.meta_path.read_text())
    assert meta["num_tokens"] == tokens.size and meta["documents"] == 2 and meta["dtype"] == "uint16"
    assert meta["source"]["files"] == [{"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}]
    assert len(meta["tokenizer"]) == 64
    assert not list(cache.folder.glob("*.tmp"))


@pytest.mark.parametrize("style", ["llama", "gpt2", "chatml"])
def test_batched_tokenization_equals_encode(tmp_path, style, monkeypatch):
    from litgpt.data import token_cache

    tokenizer = Tokenizer(make_tokenizer_folder(tmp_path / style, style))
    documents = [f"Document {i}: Über café <|im_end|> {'x' * (i % 7)}\n\tend." for i in range(300)]
    source = tmp_path / "s.txt"
    source.write_text("x")
    cache = ensure_token_cache(_corpus("docs", documents, [source]), tokenizer, tmp_path / "batched")
    expected = expected_tokens(tokenizer, documents)
    np.testing.assert_array_equal(cache_tokens(cache.folder), expected)
    # A batch encoder that disagrees with encode is noticed, and the documents are encoded one by one.
    monkeypatch.setattr(token_cache, "_batch_encoder", lambda tok: lambda texts: [np.array([0])] * len(texts))
    cache = ensure_token_cache(_corpus("docs", documents, [source]), tokenizer, tmp_path / "fallback")
    np.testing.assert_array_equal(cache_tokens(cache.folder), expected)


def test_cache_is_reused_without_tokenizing_again(tmp_path, tokenizer, monkeypatch, cache_root):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.txt").write_text(f"Story number {i}. " * 30)
    calls = count_builds(monkeypatch)
    first = TextFiles(folder)
    first.connect(tokenizer, 8)
    first.prepare()
    assert calls[0] == 2  # train and val
    train = first._cache("train")
    assert train.folder.parent == cache_root and train.folder.name.startswith("textfiles-train-")
    stamp = train.tokens_path.stat().st_mtime_ns, train.meta_path.stat().st_mtime_ns

    second = TextFiles(folder)  # a new run
    second.connect(tokenizer, 8)
    second.prepare()
    second.prepare()
    assert calls[0] == 2
    assert (train.tokens_path.stat().st_mtime_ns, train.meta_path.stat().st_mtime_ns) == stamp
    assert len(second.train_dataset()) == len(first.train_dataset()) > 0


def test_cache_is_rebuilt_when_the_tokenizer_or_the_source_changes(tmp_path, tokenizer, monkeypatch):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("Hello there, this is the first file.")
    (folder / "b.txt").write_text("And this one is the second file.")
    cache_dir = tmp_path / "cache"
    module = TextFiles(folder, val_data_path=folder, cache_dir=cache_dir)
    module.connect(tokenizer, 4)
    module.prepare()
    meta = json.loads((cache_dir / "textfiles-train" / META_FILE).read_text())

    gpt2 = Tokenizer(make_tokenizer_folder(tmp_path / "gpt2", "gpt2"))
    module.connect(gpt2, 4)
    module.prepare()
    rebuilt = json.loads((cache_dir / "textfiles-train" / META_FILE).read_text())
    assert rebuilt["tokenizer"] != meta["tokenizer"]
    texts = [(folder / name).read_text() for name in ("a.txt", "b.txt")]
    np.testing.assert_array_equal(cache_tokens(cache_dir / "textfiles-train"), expected_tokens(gpt2, texts))

    # A changed source file is noticed too (its size and SHA-256 are in the fingerprint).
    (folder / "b.txt").write_text("A different second file, longer than before.")
    calls = count_builds(monkeypatch)
    module.prepare()
    assert calls[0] == 2  # train and val
    texts[1] = (folder / "b.txt").read_text()
    np.testing.assert_array_equal(cache_tokens(cache_dir / "textfiles-train"), expected_tokens(gpt2, texts))


def test_default_cache_folders_are_keyed_by_the_tokenizer(tmp_path, tokenizer, cache_root):
    source = tmp_path / "s.txt"
    source.write_text("x")
    corpus = _corpus("docs", ["Hello world."], [source])
    first = ensure_token_cache(corpus, tokenizer)
    second = ensure_token_cache(corpus, Tokenizer(make_tokenizer_folder(tmp_path / "gpt2", "gpt2")))
    assert first.folder != second.folder and first.folder.parent == second.folder.parent == cache_root
    assert first.meta_path.is_file() and second.meta_path.is_file()


def test_an_interrupted_tokenization_leaves_no_cache(tmp_path, tokenizer, monkeypatch):
    source = tmp_path / "s.txt"
    source.write_text("x")
    folder = tmp_path / "cache" / "docs"

    def killed():
        yield "The first document."
        raise KeyboardInterrupt

    corpus = Corpus("docs", [source], killed)
    with pytest.raises(KeyboardInterrupt):
        ensure_token_cache(corpus, tokenizer, tmp_path / "cache")
    assert sorted(p.name for p in folder.iterdir()) == []

    # What a killed process leaves: a temporary token file, or a complete token file whose meta was never written.
    stale, live = folder / f".{TOKENS_FILE}.abc123.tmp", folder / f".{TOKENS_FILE}.def456.tmp"
    stale.write_bytes(b"\x01\x00" * 10)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    live.write_bytes(b"\x01\x00" * 10)  # another process may still be writing this one
    (folder / TOKENS_FILE).write_bytes(b"\x01\x00" * 10)
    documents = ["A real document.", "And another one."]
    expected = expected_tokens(tokenizer, documents)
    calls = count_builds(monkeypatch)
    cache = ensure_token_cache(_corpus("docs", documents, [source]), tokenizer, tmp_path / "cache")
    assert calls[0] == 1
    np.testing.assert_array_equal(cache_tokens(cache.folder), expected)
    assert not stale.exists() and live.exists()

    # A token file cut short (its size disagrees with the meta) is no cache either.
    with open(cache.tokens_path, "r+b") as file:
        file.truncate(4)
    assert not cache.is_valid(json.loads(cache.meta_path.read_text()))
    ensure_token_cache(_corpus("docs", documents, [source]), tokenizer, tmp_path / "cache")
    assert calls[0] == 2


def test_under_srun_the_first_task_of_every_node_builds_caches(tmp_path, tokenizer, monkeypatch):
    """srun sets no LOCAL_RANK: SLURM_LOCALID names each node's first task, also on the second node."""
    source = tmp_path / "s.txt"
    source.write_text("x")
    corpus = _corpus("docs", ["Hello world."], [source])
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    with pytest.raises(RuntimeError, match="first process"):
        ensure_token_cache(corpus, tokenizer, tmp_path / "cache")
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert ensure_token_cache(corpus, tokenizer, tmp_path / "cache").meta_path.is_file()


def test_the_cache_key_is_the_content_of_the_sources_not_where_or_when_they_were_written(tmp_path, tokenizer):
    """A corpus copied elsewhere with new mtimes (a node that installed it separately) finds the same cache folder;
    one changed byte, of the same file size, gets another."""
    first = tmp_path / "node0" / "corpus"
    first.mkdir(parents=True)
    (first / "a.txt").write_text("The first story, long enough to tokenize.")
    (first / "b.txt").write_text("The second story, long enough as well.")
    copy = tmp_path / "node1" / "elsewhere"
    copy.mkdir(parents=True)
    for name in ("a.txt", "b.txt"):
        (copy / name).write_bytes((first / name).read_bytes())
        os.utime(copy / name, (time.time() + 3600, time.time() + 3600))

    def cache_folder(folder: Path) -> Path:
        module = TextFiles(folder)
        module.connect(tokenizer, 4)
        module.prepare()
        return module._cache("train").folder

    original = cache_folder(first)
    assert cache_folder(copy) == original
    (copy / "b.txt").write_text("The second story, long enough as well!")  # same size, one byte differs
    assert cache_folder(copy) != original


def test_other_ranks_only_read_the_cache(tmp_path, tokenizer, monkeypatch):
    source = tmp_path / "s.txt"
    source.write_text("x")
    corpus = _corpus("docs", ["Hello world."], [source])
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="first process"):
        ensure_token_cache(corpus, tokenizer, tmp_path / "cache")
    assert not (tmp_path / "cache" / "docs").exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    built = ensure_token_cache(corpus, tokenizer, tmp_path / "cache")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ensure_token_cache(corpus, tokenizer, tmp_path / "cache") == built


def test_validation_picks_are_deterministic():
    assert pick_validation(100, 0.1, 42) == pick_validation(100, 0.1, 42)
    assert len(pick_validation(100, 0.1, 42)) == 10
    assert pick_validation(100, 0.1, 42) != pick_validation(100, 0.1, 7)
    assert len(pick_validation(3, 0.01, 0)) == 1 and len(pick_validation(2, 0.99, 0)) == 1
    with pytest.raises(UserError, match="at least 2"):
        pick_validation(1, 0.5, 0)
    with pytest.raises(UserError, match="between 0 and 1"):
        pick_validation(10, 1.5, 0)
    picked = [i for i in range(20000) if in_validation(i, 0.05, 3)]
    assert 800 < len(picked) < 1200 and picked == [i for i in range(20000) if in_validation(i, 0.05, 3)]


# ---- TextFiles ---------------------------------------------------------------------------------------------------------
def test_text_files_errors(tmp_path, tokenizer):
    def prepare(path, **kwargs):
        module = TextFiles(path, **kwargs)
        module.connect(tokenizer, 8)
        module.prepare()
        return module

    with pytest.raises(UserError, match="does not exist"):
        prepare(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("not a txt file")
    with pytest.raises(UserError, match=r"has no \.txt files"):
        prepare(tmp_path / "empty")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text("")
    with pytest.raises(UserError, match=r"All 2 \.txt file\(s\) .* are empty"):
        prepare(tmp_path / "blank")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("Just one paragraph, nothing to hold out.")
    with pytest.raises(UserError, match="at least 2"):
        prepare(tmp_path / "one")

    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "train.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    (tmp_path / "smallval").mkdir()
    (tmp_path / "smallval" / "val.txt").write_text("Hi.")
    module = prepare(tmp_path / "small", val_data_path=tmp_path / "smallval")
    assert len(module.train_dataset()) > 0
    n = module._cache("val").num_tokens
    with pytest.raises(UserError, match=f"validation set of TextFiles has {n} tokens, but one sample of "
                                        "max_seq_length=8 needs 9"):
        module.val_dataset()


def test_text_files_split_by_file_and_recursively(tmp_path, tokenizer):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    texts = {}
    for i in range(20):
        path = folder / ("sub" if i % 2 else "") / f"{i:02d}.txt"
        path.write_text(f"Document {i}: the quick brown fox jumps over the lazy dog.")
        texts[path] = path.read_text()
    module = TextFiles(folder, val_split_fraction=0.1, seed=1)
    module.connect(tokenizer, 4)
    module.prepare()
    files = sorted(texts)
    held_out = pick_validation(20, 0.1, 1)
    val_texts = [texts[files[i]] for i in sorted(held_out)]
    train_texts = [texts[files[i]] for i in range(20) if i not in held_out]
    assert len(val_texts) == 2
    np.testing.assert_array_equal(all_documents_tokens(module, "val"), expected_tokens(tokenizer, val_texts))
    np.testing.assert_array_equal(all_documents_tokens(module, "train"), expected_tokens(tokenizer, train_texts))


def test_text_files_single_file_is_cut_at_blank_lines(tmp_path, tokenizer):
    folder = tmp_path / "texts"
    folder.mkdir()
    stories = [f"Story {i} begins.\nIt ends here." for i in range(10)]
    (folder / "all.txt").write_text("\n\n".join(stories) + "\n\n\n")
    module = TextFiles(folder, val_split_fraction=0.2, seed=5)
    module.connect(tokenizer, 4)
    module.prepare()
    held_out = pick_validation(10, 0.2, 5)
    assert json.loads(module._cache("val").meta_path.read_text())["documents"] == 2
    np.testing.assert_array_equal(
        all_documents_tokens(module, "val"), expected_tokens(tokenizer, [stories[i] for i in sorted(held_out)])
    )


# ---- bundled and downloadable corpora -------------------------------------------------------------------------------
def test_tiny_reads_stories_separated_by_blank_lines(tmp_path, tokenizer, monkeypatch):
    stories = ["Once upon a time, Lily had a ball.\n\"Look!\" she said.", "Tom ran to the park.\nHe was happy."]
    monkeypatch.setattr(tiny_module, "TINY_DIR", tmp_path)
    (tmp_path / "train.txt").write_text("\n\n".join(stories * 5) + "\n")
    (tmp_path / "val.txt").write_text("\n\n".join(stories) + "\n")
    module = Tiny(cache_dir=tmp_path / "cache")
    module.connect(tokenizer, 8)
    module.prepare()
    np.testing.assert_array_equal(all_documents_tokens(module, "val"), expected_tokens(tokenizer, stories))
    assert len(module.train_dataset()) > len(module.val_dataset()) > 0
    (tmp_path / "val.txt").unlink()
    with pytest.raises(UserError, match="make_tiny_corpus"):
        Tiny().corpora()


@pytest.mark.skipif(
    not (tiny_module.TOKENIZER_DIR / "tokenizer.json").is_file() or not (tiny_module.TINY_DIR / "val.txt").is_file(),
    reason="the bundled corpus is not generated",
)
def test_tiny_bundled_corpus(tmp_path):
    tokenizer = Tokenizer(tiny_module.TOKENIZER_DIR)
    corpora = Tiny().corpora()
    stories = (tiny_module.TINY_DIR / "val.txt").read_text().strip("\n").split("\n\n")
    assert list(corpora["val"].documents()) == stories
    assert next(iter(corpora["train"].documents())) == (tiny_module.TINY_DIR / "train.txt").read_text().split("\n\n")[0]
    # Only the validation split is tokenized here (the training split takes seconds).
    cache = ensure_token_cache(corpora["val"], tokenizer)
    tokens = cache_tokens(cache.folder)
    first = tokenizer.encode(stories[0], eos=True)
    assert first[0] == tokenizer.bos_id == 0 and first[-1] == tokenizer.eos_id == 1
    np.testing.assert_array_equal(tokens[: first.numel()], first.numpy())
    assert (tokens == tokenizer.eos_id).sum() == len(stories)
    assert len(cache.windows(256)) > 10


def test_tinystories_local_files(tmp_path, tokenizer):
    stories = ["Once upon a time there was a cat.", "The cat liked milk.\n\nIt drank it all.", "The end."]
    layout = "\n<|endoftext|>\n".join(stories) + "\n<|endoftext|>\n"
    (tmp_path / "TinyStoriesV2-GPT4-train.txt").write_text(layout * 3)
    (tmp_path / "TinyStoriesV2-GPT4-valid.txt").write_text(layout)
    module = TinyStories(data_path=tmp_path)
    module.connect(tokenizer, 8)
    module.prepare()  # no network: the files are there
    np.testing.assert_array_equal(all_documents_tokens(module, "val"), expected_tokens(tokenizer, stories))
    np.testing.assert_array_equal(all_documents_tokens(module, "train"), expected_tokens(tokenizer, stories * 3))
    assert len(module.train_dataset()) == (all_documents_tokens(module, "train").size - 1) // 8


def test_delimited_documents_across_read_chunks(tmp_path, monkeypatch):
    from litgpt.data import text_files

    monkeypatch.setattr(text_files, "READ_CHUNK_CHARS", 7)
    path = tmp_path / "s.txt"
    path.write_text("alpha beta<|endoftext|>gamma<|endoftext|><|endoftext|>  delta  ")
    assert list(text_files.delimited_documents(path, "<|endoftext|>")) == ["alpha beta", "gamma", "delta"]


def _offline(*args, **kwargs):
    raise OSError("Network is unreachable")


def test_hub_sources_offline_say_what_to_download(tmp_path, tokenizer, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _offline)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _offline)
    module = TinyStories(data_path=tmp_path / "ts")
    module.connect(tokenizer, 8)
    with pytest.raises(UserError) as error:
        module.prepare()
    message = str(error.value)
    assert "Network is unreachable" in message and "roneneldan/TinyStories" in message
    assert str(tmp_path / "ts" / "TinyStoriesV2-GPT4-train.txt") in message

    module = RedPajama(data_path=tmp_path / "rp")
    module.connect(tokenizer, 8)
    with pytest.raises(UserError, match="togethercomputer/RedPajama-Data-1T-Sample"):
        module.prepare()

    for sft, name in ((Dolly(download_dir=tmp_path / "d"), "databricks-dolly-15k.jsonl"),
                      (LIMA(download_dir=tmp_path / "l"), "train.jsonl"),
                      (Alpaca2k(download_dir=tmp_path / "a2k"), "alpaca_2000.parquet")):
        sft.connect(tokenizer, 8)
        with pytest.raises(UserError, match=f"Download .*{name}") as error:
            sft.prepare()
        assert str(sft.download_dir / name) in str(error.value)


def test_gated_dataset_asks_for_a_token(tmp_path, tokenizer, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    def gated(*args, **kwargs):
        error = GatedRepoError.__new__(GatedRepoError)
        Exception.__init__(error, "401 gated")
        raise error

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gated)
    module = LIMA(download_dir=tmp_path)
    module.connect(tokenizer, 8)
    with pytest.raises(UserError, match="gated.*HF_TOKEN"):
        module.prepare()


def test_redpajama_local_jsonl_files(tmp_path, tokenizer):
    names = ["arxiv_sample.jsonl", "book_sample.jsonl", "c4_sample.jsonl", "github_sample.jsonl",
             "stackexchange_sample.jsonl", "wikipedia_sample.jsonl"]
    documents = []
    for n, name in enumerate(names):
        rows = [{"text": f"Document {n}-{i} from {name}.", "meta": {"source": name}} for i in range(10)]
        write_jsonl(tmp_path / name, rows)
        documents += [row["text"] for row in rows]
    documents_in_file_order = [json.loads(line)["text"] for name in sorted(names)
                               for line in (tmp_path / name).read_text().splitlines()]
    module = RedPajama(data_path=tmp_path, val_split_fraction=0.2, seed=3)
    module.connect(tokenizer, 8)
    module.prepare()
    val = [d for i, d in enumerate(documents_in_file_order) if in_validation(i, 0.2, 3)]
    train = [d for i, d in enumerate(documents_in_file_order) if not in_validation(i, 0.2, 3)]
    assert 0 < len(val) < len(train)
    np.testing.assert_array_equal(all_documents_tokens(module, "val"), expected_tokens(tokenizer, val))
    np.testing.assert_array_equal(all_documents_tokens(module, "train"), expected_tokens(tokenizer, train))

    (tmp_path / "zz_sample.jsonl").write_text('{"text": "ok"}\n{"meta": {}}\n')
    module = RedPajama(data_path=tmp_path, val_split_fraction=0.2, cache_dir=tmp_path / "c")
    module.connect(tokenizer, 8)
    with pytest.raises(UserError, match=r"zz_sample\.jsonl', line 2: expected an object with a string 'text'"):
        module.prepare()


def _tar_bytes(members: dict[str, bytes], compression: str = "") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=f"w:{compression}") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_openwebtext_reads_the_repo_archives(tmp_path, tokenizer):
    # subsets/urlsf_subsetNN.tar holds openwebtext/urlsf_subsetNN-M_data.xz, each an xz tar of one .txt per page.
    pages = {}
    for subset in range(2):
        inner = {}
        for part in range(2):
            texts = {f"{subset}{part}{i}-page.txt": f"Page {subset}.{part}.{i}\n\n\n\nhas text.  \n".encode()
                     for i in range(5)}
            inner[f"openwebtext/urlsf_subset{subset:02d}-{part}_data.xz"] = _tar_bytes(texts, "xz")
            pages.update(texts)
        (tmp_path / "subsets").mkdir(exist_ok=True)
        (tmp_path / "subsets" / f"urlsf_subset{subset:02d}.tar").write_bytes(_tar_bytes(inner))
    documents = [f"Page {name[0]}.{name[1]}.{name[2]}\n\nhas text." for name in pages]
    module = OpenWebText(data_path=tmp_path, val_split_fraction=0.25, seed=0)
    module.connect(tokenizer, 8)
    module.prepare()
    val = [d for i, d in enumerate(documents) if in_validation(i, 0.25, 0)]
    train = [d for i, d in enumerate(documents) if not in_validation(i, 0.25, 0)]
    assert val and train
    np.testing.assert_array_equal(all_documents_tokens(module, "val"), expected_tokens(tokenizer, val))
    np.testing.assert_array_equal(all_documents_tokens(module, "train"), expected_tokens(tokenizer, train))


def test_openwebtext_without_files_or_datasets(tmp_path, tokenizer, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    module = OpenWebText(data_path=tmp_path)
    module.connect(tokenizer, 8)
    with pytest.raises(UserError, match=r"pip install datasets.*subsets/urlsf_subset00\.tar"):
        module.prepare()


# ---- SFT: JSON ---------------------------------------------------------------------------------------------------------
def test_prompt_masking_on_a_hand_built_example(tmp_path, word_tokenizer):
    records = [{"instruction": "say hello world", "output": "good bye"}]
    dataset = SFTDataset(records, word_tokenizer, PromptStyle.from_name("default"), max_seq_length=100)
    sample = dataset[0]
    # tokens: <s> say hello world | good bye </s>
    assert sample["input_ids"].tolist() == [ID["<s>"], ID["say"], ID["hello"], ID["world"], ID["good"], ID["bye"]]
    assert sample["labels"].tolist() == [-100, -100, -100, ID["good"], ID["bye"], ID["</s>"]]

    unmasked = SFTDataset(records, word_tokenizer, PromptStyle(), max_seq_length=100, mask_prompt=False)[0]
    assert unmasked["input_ids"].tolist() == sample["input_ids"].tolist()
    assert unmasked["labels"].tolist() == [ID["say"], ID["hello"], ID["world"], ID["good"], ID["bye"], ID["</s>"]]

    other = SFTDataset(records, word_tokenizer, PromptStyle(), max_seq_length=100, ignore_index=-1)[0]
    assert other["labels"].tolist()[:3] == [-1, -1, -1]

    truncated = SFTDataset(records, word_tokenizer, PromptStyle(), max_seq_length=4)[0]
    assert truncated["input_ids"].tolist() == [ID["<s>"], ID["say"], ID["hello"], ID["world"]]
    assert truncated["labels"].tolist() == [-100, -100, -100, ID["good"]]

    # An input goes after the instruction for styles that do not place it themselves.
    with_input = SFTDataset([{"instruction": "say", "input": "hi again", "output": "bye"}], word_tokenizer,
                            PromptStyle())[0]
    assert with_input["input_ids"].tolist() == [ID["<s>"], ID["say"], ID["hi"], ID["again"], ID["bye"]]
    assert with_input["labels"].tolist() == [-100, -100, -100, ID["bye"], ID["</s>"]]


def test_alpaca_style_places_the_input(word_tokenizer):
    style = PromptStyle.from_name("alpaca")
    prompt, response = prompt_and_response({"instruction": "Add.", "input": "1 and 2", "output": "3"}, style)
    assert prompt == style.apply("Add.", input="1 and 2") and "### Input:\n1 and 2" in prompt and response == "3"


def test_chat_messages_take_the_last_assistant_message_as_the_response(tmp_path, word_tokenizer):
    messages = [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "say bye"},
        {"role": "assistant", "content": "bye"},
        {"role": "user", "content": "the end"},  # after the last reply: not used
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}] * 4)
    module = JSON(path, val_split_fraction=0.25, prompt_style="chatml")
    module.connect(word_tokenizer, 100)
    module.prepare()
    sample = module.train_dataset()[0]
    S, E = ID["<|im_start|>"], ID["<|im_end|>"]
    prompt = [ID["<s>"], S, ID["system"], ID["be"], ID["nice"], E, S, ID["user"], ID["hello"], E,
              S, ID["assistant"], ID["hi"], E, S, ID["user"], ID["say"], ID["bye"], E, S, ID["assistant"]]
    assert sample["input_ids"].tolist() == prompt + [ID["bye"]]
    assert sample["labels"].tolist() == [-100] * (len(prompt) - 1) + [ID["bye"], ID["</s>"]]
    assert len(module.train_dataset()) == 3 and len(module.val_dataset()) == 1


def test_prompt_style_comes_from_the_argument_else_the_checkpoint(tmp_path, word_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "hello", "output": "bye"}] * 3)
    module = JSON(path, val_split_fraction=0.3)
    module.connect(word_tokenizer, 50, PromptStyle.from_name("chatml"))
    assert module.style.name == "chatml" and module.prompt_style is None
    module = JSON(path, val_split_fraction=0.3, prompt_style="alpaca")
    module.connect(word_tokenizer, 50, PromptStyle.from_name("chatml"))
    assert module.style.name == "alpaca"
    module = JSON(path, val_split_fraction=0.3)
    module.connect(word_tokenizer, 50)
    assert module.style.name == "alpaca"


def test_json_list_file_and_folder(tmp_path, word_tokenizer):
    records = [{"instruction": f"say {w}", "input": "", "output": w} for w in ("a", "b", "c", "d", "e")]
    (tmp_path / "data.json").write_text(json.dumps(records))
    module = JSON(tmp_path / "data.json", val_split_fraction=0.4, seed=1)
    module.connect(word_tokenizer, 50, PromptStyle())
    module.prepare()
    train, val = module.records()
    assert len(train) == 3 and len(val) == 2
    assert sorted(r["output"] for r in train + val) == ["a", "b", "c", "d", "e"]
    again = JSON(tmp_path / "data.json", val_split_fraction=0.4, seed=1)
    assert again.load() == (train, val)

    folder = tmp_path / "folder"
    write_jsonl(folder / "train.jsonl", records[:4])
    (folder / "val.json").write_text(json.dumps(records[4:]))
    module = JSON(folder)
    module.connect(word_tokenizer, 50, PromptStyle())
    assert len(module.train_dataset()) == 4 and len(module.val_dataset()) == 1
    with pytest.raises(UserError, match="leave val_split_fraction unset"):
        JSON(folder, val_split_fraction=0.1).load()
    with pytest.raises(UserError, match="set --data.val_split_fraction"):
        JSON(tmp_path / "data.json").load()
    with pytest.raises(UserError, match="needs train.json"):
        JSON(tmp_path).load()


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", '{"instruction": "a", "output": "b"}\n\n{"instruction": "a", "output": \n',
         r"bad\.jsonl', line 3: invalid JSON"),
        ("missing.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n',
         r"missing\.jsonl', line 2: missing \"output\""),
        ("missing.json", '[{"instruction": "a", "output": "b"}, {"input": "x", "output": "b"}]',
         r"missing\.json', record 1 \(counting from 0\): missing \"instruction\""),
        ("type.json", '[{"instruction": "a", "output": 3}]', r"record 0 .*\"output\" must be a string, not a number"),
        ("notobject.jsonl", '["a", "b"]\n', r"line 1: expected a JSON object, got a list"),
        ("notlist.json", '{"instruction": "a", "output": "b"}', "must hold a JSON list of records"),
        ("broken.json", '[{"instruction": "a",\n "output": }]', r"broken\.json': invalid JSON at line 2, column 12"),
        ("empty.jsonl", "", r"empty\.jsonl' is empty"),
        ("blank.json", "  \n", r"blank\.json' is empty"),
        ("nothing.json", "[]", "holds no records"),
        ("role.jsonl", '{"messages": [{"role": "robot", "content": "x"}]}\n', r"line 1: messages\[0\] has role 'robot'"),
        ("noreply.jsonl", '{"messages": [{"role": "user", "content": "x"}]}\n', "no assistant message"),
    ],
)
def test_malformed_files_name_the_file_and_the_place(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        JSON(path, val_split_fraction=0.5).load()


# ---- SFT: the named data sets, from local files in their source's layout -------------------------------------------
def test_alpaca_local_file(tmp_path, tokenizer, monkeypatch):
    import urllib.request

    monkeypatch.setattr(urllib.request, "urlopen", _offline)
    records = [{"instruction": f"Task {i}", "input": "" if i % 2 else f"context {i}", "output": f"Answer {i}"}
               for i in range(100)]
    (tmp_path / "alpaca_data_cleaned_archive.json").write_text(json.dumps(records))
    module = Alpaca(download_dir=tmp_path)
    module.connect(tokenizer, 64, PromptStyle.from_name("alpaca"))
    module.prepare()
    train, val = module.train_dataset(), module.val_dataset()
    assert len(val) == 4 and len(train) == 96  # round(100 * 0.03865)
    sample = train[0]
    assert sample["input_ids"].shape == sample["labels"].shape and (sample["labels"] == -100).any()

    missing = Alpaca(download_dir=tmp_path / "nothing")
    with pytest.raises(UserError, match=r"Could not download https://raw\.githubusercontent\.com/tloen/alpaca-lora/"
                                        r".*Network is unreachable.*nothing/alpaca_data_cleaned_archive\.json"):
        missing.prepare()
    assert not (tmp_path / "nothing" / "alpaca_data_cleaned_archive.json").exists()


def test_dolly_local_file(tmp_path, word_tokenizer):
    rows = [{"instruction": "say hello", "context": "hi again" if i == 0 else "", "response": "good bye",
             "category": "open_qa"} for i in range(10)]
    write_jsonl(tmp_path / "databricks-dolly-15k.jsonl", rows)
    module = Dolly(download_dir=tmp_path, val_split_fraction=0.1)
    module.connect(word_tokenizer, 50, PromptStyle())
    module.prepare()
    train, val = module.records()
    assert len(train) == 9 and len(val) == 1
    assert {"instruction": "say hello", "input": "hi again", "output": "good bye"} in train + val
    write_jsonl(tmp_path / "bad" / "databricks-dolly-15k.jsonl", [{"instruction": "x", "context": ""}])
    with pytest.raises(UserError, match=r"line 1: missing \"response\""):
        Dolly(download_dir=tmp_path / "bad").load()


def test_alpaca2k_local_files(tmp_path, word_tokenizer):
    rows = [{"instruction": "say hello", "input": "", "output": "bye", "text": "..."} for _ in range(20)]
    write_jsonl(tmp_path / "alpaca_2000.jsonl", rows)
    module = Alpaca2k(download_dir=tmp_path)
    module.connect(word_tokenizer, 50, PromptStyle())
    module.prepare()
    assert len(module.train_dataset()) == 19 and len(module.val_dataset()) == 1


def test_alpaca2k_parquet(tmp_path, word_tokenizer):
    import pyarrow
    import pyarrow.parquet as parquet

    rows = [{"instruction": "say hello", "input": "", "output": "bye", "text": "..."} for _ in range(20)]
    parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "alpaca_2000.parquet")
    module = Alpaca2k(download_dir=tmp_path)
    module.connect(word_tokenizer, 50, PromptStyle())
    module.prepare()
    assert len(module.train_dataset()) == 19


def test_lima_local_file_single_and_multi_turn(tmp_path, word_tokenizer):
    rows = [{"conversations": ["hello", "hi", "say bye", "bye"], "source": "multi_turn"}] + [
        {"conversations": ["hello", f"good {i}"], "source": "stackexchange"} for i in range(9)
    ]
    write_jsonl(tmp_path / "train.jsonl", rows)
    single = LIMA(download_dir=tmp_path, val_split_fraction=0.1)
    single.connect(word_tokenizer, 50, PromptStyle.from_name("chatml"))
    single.prepare()
    train, val = single.records()
    assert len(train) + len(val) == 10
    assert all(len(r["messages"]) == 2 for r in train + val)

    multi = LIMA(download_dir=tmp_path, val_split_fraction=0.1, include_multiturn_conversations=True)
    multi.connect(word_tokenizer, 50, PromptStyle.from_name("chatml"))
    train, val = multi.records()
    assert len(train) + len(val) == 11
    conversation = [r for r in train + val if len(r["messages"]) == 4]
    assert conversation and conversation[0]["messages"][-1] == {"role": "assistant", "content": "bye"}
    sample = multi.train_dataset()[0]
    assert sample["input_ids"].shape == sample["labels"].shape

    write_jsonl(tmp_path / "bad" / "train.jsonl", [{"conversations": ["only a question"]}])
    with pytest.raises(UserError, match=r"line 1: the conversation needs a prompt and an answer"):
        LIMA(download_dir=tmp_path / "bad").load()


# ---- wiring -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL_MODULES)
def test_every_module_is_exported_and_built_from_the_command_line(name, tmp_path):
    cls = getattr(litgpt.data, name)
    assert issubclass(cls, DataModule)
    required = {"TextFiles": ["--data.train_data_path", str(tmp_path)], "JSON": ["--data.json_path", str(tmp_path)]}
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--data", type=DataModule)
    config = parser.parse_args(["--data", name, *required.get(name, [])])
    data = parser.instantiate(config).data
    assert type(data) is cls


def test_micro_batches_over_token_windows_and_sft(tmp_path, tokenizer, word_tokenizer):
    path = tmp_path / "tokens.bin"
    np.arange(1001, dtype=np.uint16).tofile(path)
    windows = TokenWindows(path, 16)
    batches = MicroBatches(windows, micro_batch_size=4, seed=0, rank=1, world_size=2)
    epoch, index, batch = next(batches.iterate())
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 16)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert batches.per_epoch == 62 // 2 // 4

    records = [{"instruction": "say " + " ".join(["hello"] * n), "output": "bye"} for n in range(1, 9)]
    dataset = SFTDataset(records, word_tokenizer, PromptStyle(), max_seq_length=8)
    _, _, batch = next(MicroBatches(dataset, micro_batch_size=4, seed=0).iterate())
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape == batch["labels"].shape
    assert batch["input_ids"].shape[1] <= 8
    assert (batch["labels"] == -100).any()

"""The bundled tiny corpus (litgpt/data/tiny/): reproducible from its script, disjoint splits, a working tokenizer."""

from __future__ import annotations

import filecmp
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import litgpt.data.tiny

# The generator is a repository script (scripts/make_tiny_corpus.py), not part of the installed package.
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_corpus.py"
_spec = importlib.util.spec_from_file_location("make_tiny_corpus", SCRIPT)
corpus = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = corpus  # its dataclasses look their module up there
_spec.loader.exec_module(corpus)

TINY_DIR = litgpt.data.tiny.TINY_DIR
TOKENIZER_DIR = TINY_DIR / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def bundled_texts() -> dict[str, str]:
    return {name: (TINY_DIR / f"{name}.txt").read_text(encoding="ascii") for name in ("train", "val")}


@pytest.fixture(scope="module")
def val_stories(bundled_texts) -> list[str]:
    return corpus.split_stories(bundled_texts["val"])


@pytest.fixture(scope="module")
def backend():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_tokenizer():
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def test_bundled_files_are_there_and_small():
    for name in ("train.txt", "val.txt", "README.md", *(f"tokenizer/{f}" for f in TOKENIZER_FILES)):
        assert (TINY_DIR / name).is_file(), name
    assert 2_000_000 <= (TINY_DIR / "train.txt").stat().st_size <= 3_000_000
    assert 100_000 <= (TINY_DIR / "val.txt").stat().st_size <= 200_000
    total = sum(path.stat().st_size for path in TINY_DIR.rglob("*") if path.is_file())
    assert total < 4_000_000


def test_generator_is_a_repository_script():
    """The generator is not in the installed package; run as a script, it writes to the bundled folder by default."""
    assert not (TINY_DIR.parent / "make_tiny_corpus.py").exists()
    assert corpus.DEFAULT_OUT_DIR == TINY_DIR.resolve()
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "--out_dir" in p.stdout and "--seed" in p.stdout


def test_regenerated_text_is_byte_identical(bundled_texts):
    """The script with its default seed gives exactly the bundled train.txt and val.txt."""
    val, train = corpus.generate_splits(corpus.DEFAULT_SEED)
    assert corpus.join_stories(train) == bundled_texts["train"]
    assert corpus.join_stories(val) == bundled_texts["val"]


def test_another_seed_gives_other_stories():
    first = corpus.generate_splits(corpus.DEFAULT_SEED, train_chars=20_000, val_chars=5_000)
    second = corpus.generate_splits(corpus.DEFAULT_SEED + 1, train_chars=20_000, val_chars=5_000)
    assert first != second
    assert first == corpus.generate_splits(corpus.DEFAULT_SEED, train_chars=20_000, val_chars=5_000)


def test_splits_are_disjoint_stories(bundled_texts):
    train = corpus.split_stories(bundled_texts["train"])
    val = corpus.split_stories(bundled_texts["val"])
    assert len(train) > 2000 and len(val) > 100
    assert len(set(train)) == len(train) and len(set(val)) == len(val)
    assert not set(train) & set(val)
    for text in bundled_texts.values():
        assert text.isascii()
        assert text.endswith("\n") and not text.endswith("\n\n")
        assert "\n\n\n" not in text
    for story in train[:200] + val:
        assert story == story.strip() and "\n\n" not in story
        assert story.count("\n") >= 2  # a beginning, a middle and an end, one paragraph each at least
        assert '"' in story  # every story has some dialogue


def test_full_regeneration_is_identical(tmp_path, backend, bundled_texts):
    """Text, README and tokenizer regenerated from scratch are the bundled ones.

    Tokenizer training is byte-deterministic, but another `tokenizers` version may write tokenizer.json in another
    layout: that file is compared by what it does (vocabulary and encodings), the others byte for byte.
    """
    from tokenizers import Tokenizer

    stats = corpus.build(tmp_path, corpus.DEFAULT_SEED)
    assert stats["vocab_size"] == corpus.VOCAB_SIZE
    for name in ("train.txt", "val.txt", "README.md", "tokenizer/tokenizer_config.json",
                 "tokenizer/generation_config.json"):
        assert filecmp.cmp(tmp_path / name, TINY_DIR / name, shallow=False), name
    regenerated = Tokenizer.from_file(str(tmp_path / "tokenizer" / "tokenizer.json"))
    assert regenerated.get_vocab(with_added_tokens=True) == backend.get_vocab(with_added_tokens=True)
    for text in (bundled_texts["val"], bundled_texts["train"][:200_000], "Zürich 東京 🤗 tabs\tand\r\nnewlines"):
        assert regenerated.encode(text).ids == backend.encode(text).ids


def test_tokenizer_vocabulary_and_special_tokens(backend):
    assert backend.get_vocab_size(with_added_tokens=True) == 4096
    assert backend.token_to_id("<s>") == 0
    assert backend.token_to_id("</s>") == 1
    encoding = backend.encode("Once upon a time")
    assert encoding.ids[0] == 0 and 1 not in encoding.ids  # BOS added in front, no EOS
    assert backend.encode("Once upon a time", add_special_tokens=False).ids == encoding.ids[1:]


def test_tokenizer_round_trip_and_compression(backend, bundled_texts, val_stories):
    text = bundled_texts["val"]
    ids = backend.encode(text, add_special_tokens=False).ids
    assert backend.decode(ids) == text
    for story in val_stories:
        assert backend.decode(backend.encode(story).ids, skip_special_tokens=True) == story
    chars_per_token = len(text) / len(ids)
    print(f"val.txt: {len(text):,} characters, {len(ids):,} tokens, {chars_per_token:.2f} characters per token")
    assert chars_per_token > 3.5
    # Text unlike the stories still round-trips (byte-level BPE has no unknown token).
    odd = "Zürich 東京 🤗 tabs\tand\r\nnewlines  {braces} 3.14"
    assert backend.decode(backend.encode(odd, add_special_tokens=False).ids) == odd


def test_transformers_loads_the_tokenizer(hf_tokenizer, backend, val_stories):
    assert len(hf_tokenizer) == 4096
    assert (hf_tokenizer.bos_token, hf_tokenizer.bos_token_id) == ("<s>", 0)
    assert (hf_tokenizer.eos_token, hf_tokenizer.eos_token_id) == ("</s>", 1)
    for story in val_stories[:50]:
        ids = hf_tokenizer.encode(story)
        assert ids == backend.encode(story).ids
        assert ids[0] == 0
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == story


def test_litgpt_tokenizer_matches_transformers(hf_tokenizer, val_stories):
    import litgpt.tokenizer as litgpt_tokenizer
    tokenizer = litgpt_tokenizer.Tokenizer(TOKENIZER_DIR)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (0, 1, 4096)
    for text in val_stories[:50] + ["", "Once upon a time", "Hello </s> world"]:
        ids = tokenizer.encode(text)
        assert ids.tolist() == hf_tokenizer.encode(text)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(hf_tokenizer.encode(text))
    story = val_stories[0]
    assert tokenizer.decode(tokenizer.encode(story, bos=False)) == story
    assert tokenizer.encode(story, eos=True)[-1].item() == 1

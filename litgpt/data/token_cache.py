"""Token caches: a text corpus tokenized once into a flat file of token ids that every rank memory-maps.

A cache is a folder holding two files:

- `tokens.bin`: the token ids of every document, one document after the other, each followed by the tokenizer's EOS
  token (and preceded by BOS when the tokenizer adds one by itself), as raw native-endian `uint16` (vocabularies of
  at most 65,536 ids) or `uint32`.
- `meta.json`: `version`, `num_tokens`, `dtype`, `documents`, the tokenizer's fingerprint (a SHA-256 of tokenizer.json
  and the files that choose its special tokens) and the source's fingerprint (size and SHA-256 of each source file,
  in order, plus the options that pick the documents, such as the validation split and its seed). Neither depends on
  where the files lie or when they were written: nodes that installed the same corpus separately find the same cache.

Where the folder is: `cache_dir/<name>` when a data module is given a `cache_dir`; otherwise
`~/.cache/litgpt/tokens/<name>-<key>` (`$LITGPT_CACHE_DIR/tokens/...` when that variable is set), `key` being a hash
of both fingerprints, so that a changed tokenizer or source gets a new folder. `name` says what it holds
(e.g. `tinystories-train`).

A cache counts only when `meta.json` matches the tokenizer and source at hand and `tokens.bin` has the size it
announces. It is never rewritten once valid. It is built under temporary names and renamed when complete: the token
file first, the meta last, after the old meta was removed. A tokenization killed halfway leaves at most a temporary
file behind, never a cache. Documents are streamed and their ids appended in chunks, so memory stays bounded
whatever the corpus size.

Training calls `prepare()` on global rank 0 first, then on the first process of each other machine (whose cache
folder may be on a node-local disk), then on every other process (`runtime.node_local_first`): the others find the
cache and only read it. A process other than the first of its machine never writes a cache.

This module also holds what the pretraining data modules share: `Corpus` (what to tokenize), `TokenCorpus` (a data
module made of a train and a val corpus), `TokenWindows` (the dataset over a cache), the deterministic validation
split, and the download helpers that fetch source files into a local folder once.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from litgpt.caches import cache_dir as litgpt_cache_dir
from litgpt.distributed.runtime import local_rank
from litgpt.io import atomic_path, file_sha256
from litgpt.data.base import DataModule
from litgpt.errors import UserError
from litgpt.progress import Progress

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

CACHE_VERSION = 1
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
# Token ids held in memory before they are appended to the token file.
CHUNK_TOKENS = 1 << 20
# Documents the tokenizer encodes at once (in parallel).
ENCODE_BATCH = 256
# A temporary file untouched for this long belongs to a killed tokenization (a live one appends every few seconds).
STALE_TEMP_SECONDS = 600
# Files of the tokenizer folder that decide which ids a text encodes to.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
# The source files' digests kept in the cache root, and how many (the newest) are kept.
DIGESTS_FILE = "source-digests.json"
MAX_DIGESTS = 100_000


# ---- fingerprints ---------------------------------------------------------------------------------------------------
def default_cache_root() -> Path:
    """`$LITGPT_CACHE_DIR/tokens`, or `~/.cache/litgpt/tokens`."""
    return litgpt_cache_dir() / "tokens"


def tokenizer_fingerprint(tokenizer: "Tokenizer") -> str:
    """A SHA-256 of the tokenizer's files (tokenizer.json first of all) and of its special ids."""
    digest = hashlib.sha256()
    folder = getattr(tokenizer, "checkpoint_dir", None)
    if folder is not None:
        for name in TOKENIZER_FILES:
            path = Path(folder) / name
            if path.is_file():
                digest.update(name.encode() + b"\0")
                digest.update(hashlib.sha256(path.read_bytes()).digest())
    special = [getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None), tokenizer.vocab_size]
    digest.update(json.dumps(special).encode())
    return digest.hexdigest()


def file_fingerprints(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Size and SHA-256 of each file, in order: what the files hold, not where they lie or when they were written, so
    that nodes holding their own copy of a corpus find the same cache.

    Hashing reads every byte once (about 0.8 GB/s a core, next to tokenizing's few MB/s); a digest is kept in the cache
    root's `source-digests.json` under the file's path, size, mtime and ctime (no writer can set ctime back), so that
    later runs and the other processes of the node only stat the files.
    """
    memo_path = default_cache_root() / DIGESTS_FILE
    memo = _read_digests(memo_path)
    result, learned = [], {}
    for path in paths:
        path = Path(path).resolve()
        stat = path.stat()
        key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"
        digest = memo.get(key)
        if digest is None:
            digest = learned[key] = file_sha256(path)
        result.append({"size": stat.st_size, "sha256": digest})
    if learned:
        _write_digests(memo_path, learned)
    return result


def _read_digests(path: Path) -> dict[str, str]:
    try:
        digests = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return digests if isinstance(digests, dict) else {}


def _write_digests(path: Path, learned: dict[str, str]) -> None:
    """Add `learned` to the digests on disk (re-read first: another process may have added its own); best effort, as
    a digest lost only costs hashing that file again."""
    digests = {**_read_digests(path), **learned}
    digests = dict(list(digests.items())[-MAX_DIGESTS:])
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(digests), encoding="utf-8")
    except OSError:
        pass


def _hash_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


# ---- what to tokenize -------------------------------------------------------------------------------------------------
@dataclass
class Corpus:
    """A stream of text documents and what identifies it.

    Args:
        name: What the cache holds, e.g. "tinystories-train" (names its folder).
        files: The source files; their sizes and contents (SHA-256) are part of the fingerprint.
        documents: Returns the documents (called only when the cache is built).
        options: Everything else that changes which documents come out (split fraction, seed, format).
    """

    name: str
    files: Sequence[Path]
    documents: Callable[[], Iterable[str]]
    options: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> dict[str, Any]:
        return {"files": file_fingerprints(self.files), "options": self.options}


def pick_validation(num_items: int, fraction: float, seed: int, what: str = "items") -> set[int]:
    """The indices of the validation items: `round(num_items * fraction)` of them (at least one, and at least one
    item left for training), drawn by `random.Random(seed)`, so the same inputs always give the same split."""
    if not 0.0 < fraction < 1.0:
        raise UserError(f"val_split_fraction must be between 0 and 1 (exclusive), got {fraction}.")
    if num_items < 2:
        raise UserError(
            f"Cannot split {num_items} {what} into a training and a validation set: at least 2 are needed. "
            "Add more data or give a separate validation set."
        )
    count = min(max(1, round(num_items * fraction)), num_items - 1)
    return set(random.Random(seed).sample(range(num_items), count))


def in_validation(index: int, fraction: float, seed: int) -> bool:
    """Whether item `index` of a stream too long to count first belongs to the validation set.

    Each item is picked with probability `fraction`, decided by a hash of (seed, index): the same on every run and
    machine, and needing a single pass.
    """
    if not 0.0 < fraction < 1.0:
        raise UserError(f"val_split_fraction must be between 0 and 1 (exclusive), got {fraction}.")
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


# ---- the cache --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenCache:
    """A cache folder: `tokens.bin` and `meta.json`."""

    folder: Path

    @property
    def tokens_path(self) -> Path:
        return self.folder / TOKENS_FILE

    @property
    def meta_path(self) -> Path:
        return self.folder / META_FILE

    def meta(self) -> Optional[dict[str, Any]]:
        """The meta, or None when there is none or it cannot be read."""
        try:
            meta = json.loads(self.meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def is_valid(self, identity: dict[str, Any]) -> bool:
        """Whether the cache is complete and was built from `identity` (version, tokenizer, source)."""
        meta = self.meta()
        if meta is None or any(meta.get(key) != value for key, value in identity.items()):
            return False
        try:
            itemsize = np.dtype(meta["dtype"]).itemsize
            return self.tokens_path.stat().st_size == int(meta["num_tokens"]) * itemsize
        except (KeyError, TypeError, ValueError, OSError):
            return False

    @property
    def num_tokens(self) -> int:
        meta = self.meta()
        if meta is None:
            raise RuntimeError(f"{str(self.folder)!r} is not a token cache.")
        return int(meta["num_tokens"])

    def windows(self, max_seq_length: int) -> "TokenWindows":
        meta = self.meta()
        if meta is None:
            raise RuntimeError(f"{str(self.folder)!r} is not a token cache.")
        return TokenWindows(self.tokens_path, max_seq_length, dtype=meta["dtype"], num_tokens=int(meta["num_tokens"]))


def cache_for(corpus: Corpus, identity: dict[str, Any], cache_dir: Optional[Path] = None) -> TokenCache:
    """Where the cache of `corpus` lives: `cache_dir/<name>`, or a folder keyed by `identity` in the default root."""
    if cache_dir is not None:
        return TokenCache(Path(cache_dir).expanduser() / corpus.name)
    return TokenCache(default_cache_root() / f"{corpus.name}-{_hash_json(identity)[:16]}")


def is_cache_writer() -> bool:
    """Whether this process may build caches: the first process of its machine (LOCAL_RANK or SLURM_LOCALID 0; the
    only one when no launcher started it)."""
    return local_rank() == 0


def ensure_token_cache(
    corpus: Corpus, tokenizer: "Tokenizer", cache_dir: Optional[Path] = None, build: bool = True
) -> TokenCache:
    """The valid cache of `corpus` tokenized by `tokenizer`, built first when there is none and `build` is set."""
    identity = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "source": corpus.fingerprint(),
    }
    cache = cache_for(corpus, identity, cache_dir)
    if cache.is_valid(identity):
        return cache
    if not build:
        raise RuntimeError(f"The token cache of {corpus.name} is missing from {str(cache.folder)!r}: call prepare() first.")
    if not is_cache_writer():
        raise RuntimeError(
            f"The token cache of {corpus.name} is missing from {str(cache.folder)!r}. prepare() must run on the first "
            "process of each machine before the others (which only read the cache), and the cache folder must be "
            "the same for all of them."
        )
    write_token_cache(cache, corpus.documents(), tokenizer, identity, what=corpus.name)
    return cache


def write_token_cache(
    cache: TokenCache, documents: Iterable[str], tokenizer: "Tokenizer", identity: dict[str, Any],
    what: str = "documents",
) -> None:
    """Tokenize `documents` into `cache` (documents that are only whitespace are left out), showing the progress
    in documents (of a known total when `documents` has a length; a stream's count otherwise)."""
    if tokenizer.eos_id is None:
        raise UserError(
            f"The tokenizer in {str(getattr(tokenizer, 'checkpoint_dir', '?'))!r} has no EOS token, which separates "
            "documents in pretraining data."
        )
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    cache.folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(cache.folder)
    # Without its meta, whatever token file is there stops being a cache before it is replaced.
    cache.meta_path.unlink(missing_ok=True)

    num_tokens = num_documents = 0
    total = len(documents) if hasattr(documents, "__len__") else None  # type: ignore[arg-type]
    shown = Progress(total, f"Tokenizing {what}", unit="doc")
    with atomic_path(cache.tokens_path) as tmp, shown:
        with open(tmp, "wb") as file:
            chunk: list[np.ndarray] = []
            held = 0
            for ids in _encode_documents(tokenizer, documents, shown.update):
                chunk.append(ids.astype(dtype))
                held += ids.size
                num_documents += 1
                if held >= CHUNK_TOKENS:
                    np.concatenate(chunk).tofile(file)
                    num_tokens += held
                    chunk, held = [], 0
            if chunk:
                np.concatenate(chunk).tofile(file)
                num_tokens += held
            file.flush()

    meta = {
        **identity,
        "num_tokens": num_tokens,
        "dtype": dtype.name,
        "documents": num_documents,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "vocab_size": tokenizer.vocab_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with atomic_path(cache.meta_path) as tmp:
        tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _encode_documents(
    tokenizer: "Tokenizer", documents: Iterable[str], on_done: Callable[[int], None] = lambda n: None
) -> Iterator[np.ndarray]:
    """`tokenizer.encode(document, eos=True)` of each document that is not only whitespace, as numpy arrays.

    Documents are encoded in batches by the `tokenizers` backend (in parallel threads) with the ids `encode` puts
    around a text; the first document of every batch is checked against `encode` itself, and on any difference the
    documents are encoded one by one. `on_done(n)` is called after each batch with the documents it consumed (the
    skipped blank ones included), for the progress.
    """
    batch_encode = _batch_encoder(tokenizer)
    batch: list[str] = []
    read = 0

    def flush() -> Iterator[np.ndarray]:
        if batch_encode is not None:
            encoded = batch_encode(batch)
            if encoded[0].tolist() == tokenizer.encode(batch[0], eos=True).tolist():
                yield from encoded
                return
        for document in batch:
            yield tokenizer.encode(document, eos=True).numpy()

    for document in documents:
        read += 1
        if not document.strip():
            continue
        batch.append(document)
        if len(batch) >= ENCODE_BATCH:
            yield from flush()
            on_done(read)
            batch, read = [], 0
    if batch:
        yield from flush()
    if read:
        on_done(read)


def _batch_encoder(tokenizer: "Tokenizer") -> Optional[Callable[[list[str]], list[np.ndarray]]]:
    """A function encoding many texts at once as `tokenizer.encode(text, eos=True)` would, or None."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    edges = None
    for probe in ("Hello world", "a", "1", "."):
        inner = backend.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, eos=True).tolist()
        if not inner:
            continue
        for start in range(len(full) - len(inner) + 1):
            if full[start : start + len(inner)] == inner:
                edges = full[:start], full[start + len(inner) :]
                break
        break
    if edges is None:
        return None
    prefix, suffix = edges

    def encode(texts: list[str]) -> list[np.ndarray]:
        return [
            np.array(prefix + encoding.ids + suffix, dtype=np.int64)
            for encoding in backend.encode_batch(texts, add_special_tokens=False)
        ]

    return encode


def _remove_stale_temporaries(folder: Path) -> None:
    """Remove temporary token files that killed tokenizations left behind (not those still being written)."""
    now = time.time()
    for path in folder.glob(f".{TOKENS_FILE}.*.tmp"):
        try:
            if now - path.stat().st_mtime > STALE_TEMP_SECONDS:
                path.unlink()
        except OSError:
            pass


# ---- the dataset --------------------------------------------------------------------------------------------------------
class TokenWindows:
    """Consecutive windows of a token file: sample i is tokens[i*L : i*L + L + 1] (L = max_seq_length), split into
    `input_ids` = window[:-1] and `labels` = window[1:]; there are (N - 1) // L samples for N tokens.

    The file is memory-mapped on first use in each process (and after unpickling, so DataLoader workers map it
    themselves instead of receiving a copy); a sample reads only its own window.
    """

    def __init__(
        self,
        path: Union[str, Path],
        max_seq_length: int,
        dtype: Union[str, np.dtype] = "uint16",
        num_tokens: Optional[int] = None,
    ) -> None:
        if max_seq_length < 1:
            raise ValueError(f"max_seq_length must be at least 1, got {max_seq_length}.")
        self.path = Path(path)
        self.max_seq_length = max_seq_length
        self.dtype = np.dtype(dtype)
        size = self.path.stat().st_size // self.dtype.itemsize
        self.num_tokens = size if num_tokens is None else num_tokens
        if self.num_tokens > size:
            raise ValueError(f"{str(self.path)!r} holds {size} tokens, fewer than the {self.num_tokens} expected.")
        self._tokens: Optional[np.ndarray] = None

    def tokens(self) -> np.ndarray:
        """All tokens, memory-mapped read-only."""
        if self._tokens is None:
            if self.num_tokens == 0:
                self._tokens = np.empty(0, dtype=self.dtype)
            else:
                self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.max_seq_length)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        length = len(self)
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError(f"sample {index} out of range for {length} samples")
        start = index * self.max_seq_length
        window = torch.from_numpy(self.tokens()[start : start + self.max_seq_length + 1].astype(np.int64))
        return {"input_ids": window[:-1].clone(), "labels": window[1:].clone()}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def __repr__(self) -> str:
        return f"TokenWindows({str(self.path)!r}, max_seq_length={self.max_seq_length}, samples={len(self)})"


# ---- the data modules -----------------------------------------------------------------------------------------------------
class TokenCorpus(DataModule):
    """A pretraining data module: a train and a val `Corpus`, each tokenized into a cache and cut into windows.

    Subclasses are dataclasses with a `cache_dir: Optional[Path]` field; they implement `corpora()` and, when their
    files can be fetched, `download()` (which must do nothing when the files are there).
    """

    cache_dir: Optional[Path] = None

    @abstractmethod
    def corpora(self) -> dict[str, Corpus]:
        """{"train": Corpus, "val": Corpus}."""

    def download(self) -> None:
        """Fetch missing source files."""

    def connect(self, tokenizer: "Tokenizer", max_seq_length: int, prompt_style: Any = None) -> None:
        super().connect(tokenizer, max_seq_length, prompt_style)
        self._caches = None  # found again for this tokenizer

    def prepare(self) -> None:
        tokenizer = self._connected_tokenizer()
        self.download()
        self._caches = {
            split: ensure_token_cache(corpus, tokenizer, self.cache_dir) for split, corpus in self.corpora().items()
        }

    def train_dataset(self) -> TokenWindows:
        return self._windows("train", "training")

    def val_dataset(self) -> TokenWindows:
        return self._windows("val", "validation")

    def _connected_tokenizer(self) -> "Tokenizer":
        if self.tokenizer is None:
            raise RuntimeError(f"{type(self).__name__}.connect(tokenizer, max_seq_length) must be called first.")
        return self.tokenizer

    def _cache(self, split: str) -> TokenCache:
        caches = getattr(self, "_caches", None)
        if caches is None:
            tokenizer = self._connected_tokenizer()
            caches = {
                name: ensure_token_cache(corpus, tokenizer, self.cache_dir, build=False)
                for name, corpus in self.corpora().items()
            }
            self._caches = caches
        return caches[split]

    def _windows(self, split: str, what: str) -> TokenWindows:
        if self.max_seq_length < 1:
            raise RuntimeError(f"{type(self).__name__}.connect(tokenizer, max_seq_length) must be called first.")
        cache = self._cache(split)
        windows = cache.windows(self.max_seq_length)
        if len(windows) == 0:
            raise UserError(
                f"The {what} set of {type(self).__name__} has {windows.num_tokens} tokens, but one sample of "
                f"max_seq_length={self.max_seq_length} needs {self.max_seq_length + 1}. Add more text or lower "
                "max_seq_length."
            )
        return windows


# ---- source files -----------------------------------------------------------------------------------------------------------
def hub_download(
    repo_id: str,
    filenames: Sequence[str],
    folder: Path,
    token: Optional[str] = None,
    hint: str = "",
) -> None:
    """Fetch the missing `filenames` of the Hugging Face dataset repo `repo_id` into `folder` (paths kept).

    Files already there are used as they are, without the network.
    """
    folder = Path(folder)
    missing = [name for name in filenames if not (folder / name).is_file()]
    if not missing:
        return
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError

    for name in missing:
        url = f"https://huggingface.co/datasets/{repo_id}/resolve/main/{name}"
        try:
            hf_hub_download(repo_id, name, repo_type="dataset", local_dir=folder, token=token)
        except GatedRepoError:
            raise UserError(
                f"The Hugging Face dataset {repo_id} is gated: accept its terms at "
                f"https://huggingface.co/datasets/{repo_id} and set HF_TOKEN to an access token of that account "
                f"(or download {url} yourself and put it at {str(folder / name)!r}).{hint}"
            ) from None
        except Exception as error:  # offline, unreachable, not found: every case needs the same advice
            raise UserError(
                f"Could not download {name!r} of the Hugging Face dataset {repo_id} ({_first_line(error)}). Download "
                f"{url} yourself and put it at {str(folder / name)!r}.{hint}"
            ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def hub_snapshot(repo_id: str, folder: Path, allow_patterns: Sequence[str], hint: str = "") -> None:
    """Fetch the files of the Hugging Face dataset repo `repo_id` that match `allow_patterns` into `folder`.

    While it runs, a marker file says the download is incomplete: the next call resumes it. Without the marker, files
    that match are taken as the complete download and the network is not used.
    """
    folder = Path(folder)
    marker = folder / ".litgpt-download-incomplete"
    if not marker.exists() and any(any(folder.glob(pattern)) for pattern in allow_patterns):
        return
    from huggingface_hub import snapshot_download

    folder.mkdir(parents=True, exist_ok=True)
    marker.touch()
    try:
        snapshot_download(repo_id, repo_type="dataset", local_dir=folder, allow_patterns=list(allow_patterns))
    except Exception as error:  # offline, unreachable, not found: every case needs the same advice
        raise UserError(
            f"Could not download the Hugging Face dataset {repo_id} ({_first_line(error)}). Download the files "
            f"{', '.join(allow_patterns)} of https://huggingface.co/datasets/{repo_id}/tree/main yourself and put them "
            f"in {str(folder)!r}, then delete {str(marker)!r}.{hint}"
        ) from None
    marker.unlink(missing_ok=True)

"""Token blocks streamed from litdata's optimized folders, for corpora too large to tokenize on every node.

A folder written by `litdata.optimize` (or `litgpt prepare`) holds `index.json` and chunk files of token ids. Each
rank streams only its own chunks through litdata's `StreamingDataset` and `StreamingDataLoader`, which split the
chunks across nodes, ranks and loader workers, download remote ones (`s3://`, `gs://`) into a node-local cache, and
report exactly how far a loader got (`state_dict`). Every checkpoint holds the loader position of every rank
(`TrainState.data_positions`), so a resumed run reads on from where each rank stopped.

litdata is imported only when such a folder is read: the core does not need it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from litgpt.distributed.runtime import print_once
from litgpt.errors import UserError
from litgpt.fetch import first_line

INDEX_FILE = "index.json"
# Written by `litgpt prepare` beside index.json: the tokenizer the ids come from.
TOKENIZER_RECORD = "litgpt_tokenizer.json"
REMOTE_PREFIXES = ("s3://", "gs://", "gcs://", "azure://", "hf://")
LOCAL_THROUGH_CACHE = "local:"


def import_litdata():
    """litdata, or one line saying how to install it without replacing the installed torch."""
    try:
        import litdata
    except ImportError:
        raise UserError(
            "Streaming litdata folders needs litdata: `pip install --no-deps litdata lightning-utilities boto3 "
            "filelock` (--no-deps: litdata's own requirements would replace the installed torch)."
        ) from None
    return litdata


def is_remote(path: str) -> bool:
    return str(path).startswith(REMOTE_PREFIXES)


def join(base: str, name: str) -> str:
    """`base/name` for a local folder or an object-store URL alike."""
    return f"{str(base).rstrip('/')}/{name}"


# ---- checks before the first step ---------------------------------------------------------------------------------
def check_local_folder(folder: str, what: str) -> dict:
    """The index of a local optimized folder, after checking that every chunk it names is there whole."""
    folder_path = Path(folder).expanduser()
    index_path = folder_path / INDEX_FILE
    if not folder_path.is_dir():
        raise UserError(f"The {what} folder {folder!r} does not exist: give the folder `litgpt prepare` wrote.")
    if not index_path.is_file():
        raise UserError(
            f"{folder!r} has no {INDEX_FILE}, so it is not a litdata optimized folder: write one with `litgpt prepare "
            "--input_dir TEXT --output_dir FOLDER --tokenizer_dir ...` (or litdata.optimize)."
        )
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        chunks = index["chunks"]
    except (ValueError, KeyError, TypeError) as error:
        raise UserError(f"{str(index_path)!r} is not a litdata index ({error}); write the folder again.") from None
    if not chunks or sum(int(chunk.get("dim") or chunk["chunk_size"]) for chunk in chunks) == 0:
        raise UserError(f"The {what} folder {folder!r} holds no tokens (its index lists no chunk): the split is "
                        "empty; prepare it from non-empty text.")
    for chunk in chunks:
        path = folder_path / chunk["filename"]
        if not path.is_file():
            raise UserError(f"Shard {str(path)!r} named in {INDEX_FILE} is missing: copy it again or prepare the "
                            "folder again.")
        if path.stat().st_size != int(chunk["chunk_bytes"]):
            raise UserError(f"Shard {str(path)!r} has {path.stat().st_size} bytes where {INDEX_FILE} says "
                            f"{chunk['chunk_bytes']}: it is truncated; copy it again or prepare the folder again.")
    return index


def check_tokenizer_record(folder: str, tokenizer) -> None:
    """Refuse a folder whose ids came from another tokenizer (when `litgpt prepare` recorded which one)."""
    record_path = Path(folder).expanduser() / TOKENIZER_RECORD
    if not record_path.is_file():
        return
    record = json.loads(record_path.read_text(encoding="utf-8"))
    mine = tokenizer_record(tokenizer)
    differs = [name for name in ("vocab_size", "bos_id", "eos_id") if record.get(name) != mine[name]]
    if differs:
        details = ", ".join(f"{name} {record.get(name)} there, {mine[name]} here" for name in differs)
        raise UserError(
            f"{folder!r} was tokenized with another tokenizer ({details}): prepare it again with this run's "
            "--tokenizer_dir, or train with the tokenizer it was prepared with."
        )


def tokenizer_record(tokenizer) -> dict:
    """What identifies a tokenizer's ids: its vocabulary size and special ids."""
    return {"vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}


def check_folder(folder: str, what: str, tokenizer) -> None:
    """A local folder is checked whole (index, every shard's size, tokenizer); a remote one is left to litdata.
    `local:FOLDER` is litdata's way to read a local (e.g. shared network) folder through the node's cache."""
    folder = str(folder).removeprefix(LOCAL_THROUGH_CACHE)
    if not is_remote(folder):
        check_local_folder(folder, what)
        check_tokenizer_record(folder, tokenizer)


def open_dataset(folder: str, block_size: int, shuffle: bool, seed: int):
    """litdata's `StreamingDataset` of blocks of `block_size` token ids; a folder it cannot reach is one line."""
    litdata = import_litdata()
    from litgpt.data.tokens_loader import TokensLoader

    try:
        return litdata.StreamingDataset(
            input_dir=str(folder), item_loader=TokensLoader(block_size=block_size), shuffle=shuffle,
            drop_last=True, seed=seed,
        )
    except Exception as error:  # litdata's storage clients raise their own kinds
        raise UserError(f"Cannot read the litdata folder {str(folder)!r}: {first_line(error)}") from None


def block_sample(block: torch.Tensor) -> dict[str, torch.Tensor]:
    """A block of max_seq_length + 1 ids as a next-token sample."""
    block = block.long()
    return {"input_ids": block[..., :-1], "labels": block[..., 1:]}


@dataclass
class StreamedBlocks:
    """A streaming dataset seen as samples: its first block says how long samples are; the loader does the rest."""

    dataset: Any  # a litdata StreamingDataset or CombinedStreamingDataset
    first: Any  # the StreamingDataset random access reads from

    def __len__(self) -> int:
        return sum(len(dataset) for dataset in getattr(self.dataset, "_datasets", [self.dataset]))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return block_sample(self.first[index])


@dataclass
class ValidationBlocks:
    """A validation folder in its stored order, read by random access: every rank reads the blocks the trainer's
    fixed validation order gives it."""

    dataset: Any  # a litdata StreamingDataset, not shuffled
    length: int

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return block_sample(self.dataset[index])


def validation_blocks(folder: str, block_size: int, seed: int) -> ValidationBlocks:
    """All the blocks of a validation folder, counted over the whole folder (litdata's `len` is one rank's share)."""
    dataset = open_dataset(folder, block_size, shuffle=False, seed=seed)
    dataset[0]  # opens the index (downloading it when remote)
    intervals = dataset.cache.get_chunk_intervals()
    return ValidationBlocks(dataset, sum(interval[2] - interval[1] for interval in intervals))


class StreamingBatches:
    """One rank's micro-batches from litdata's `StreamingDataLoader`, epoch after epoch, with the loader's position.

    It offers what the trainer reads of `MicroBatches` (`dataset`, `per_epoch`, `iterate`) plus the position
    (`state_dict`, `load_state_dict`) that makes a resumed run continue where each rank stopped.
    """

    def __init__(self, samples: StreamedBlocks, micro_batch_size: int, num_workers: int, rank: int,
                 world_size: int) -> None:
        litdata = import_litdata()
        self.dataset, self.rank, self.world_size = samples, rank, world_size
        self.micro_batch_size = micro_batch_size
        self.loader = litdata.StreamingDataLoader(samples.dataset, batch_size=micro_batch_size,
                                                  num_workers=num_workers, drop_last=True)

    @property
    def per_epoch(self) -> int:
        try:
            return len(self.loader)
        except TypeError:  # a weighted mixture has no length: it streams until its first dataset runs out
            return len(self.dataset) // self.world_size // self.micro_batch_size

    def iterate(self, epoch: int = 0, position: int = 0) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
        """Yield (epoch, index within the epoch, batch) forever; the loader itself knows where it resumes."""
        while True:
            batch = None
            for index, batch in enumerate(self.loader, start=position):
                yield epoch, index, block_sample(batch)
            if batch is None and position == 0:
                raise UserError("This rank got no micro-batch from the streaming dataset: it holds fewer blocks than "
                                "the ranks times --train.micro_batch_size; add data.")
            epoch, position = epoch + 1, 0

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, positions: Sequence[Optional[dict]]) -> None:
        """Continue from a checkpoint's positions (one per rank of the run that saved it)."""
        if not positions or positions[0] is None:
            return
        same_world = len(positions) == self.world_size
        mine = positions[self.rank] if same_world else positions[0]
        try:
            self.loader.load_state_dict(mine)
        except ValueError as error:  # litdata re-stripes a single dataset, not a mixture
            print_once(f"Warning: the data position the checkpoint saved with {len(positions)} rank(s) cannot be "
                       f"carried over to {self.world_size} rank(s) and {self.loader.num_workers} loader worker(s) "
                       f"({first_line(error)}); the data goes on with its next pass.")

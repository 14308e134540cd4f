"""A Hugging Face dataset streamed as pretraining text: `--data HFDataset --data.path ORG/NAME` (the hub) or a local
folder of Parquet, Arrow or JSONL files, never downloaded or tokenized whole.

Each rank reads its own part (`datasets.distributed.split_dataset_by_node`: whole shards when their number divides
by the ranks, else every world_size-th record), tokenizes it on the fly and packs the ids into blocks of
max_seq_length + 1 tokens. Its position (the dataset's own `state_dict` and the ids of the document under way) goes
into every checkpoint, so a resumed run continues with the next block. The validation set is the first `val_blocks`
blocks of `val_split`, or, without one, of the documents held out of training by a hash of their text.
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from litgpt.data.base import DataModule
from litgpt.data.streaming import block_sample
from litgpt.distributed.runtime import print_once
from litgpt.errors import UserError
from litgpt.fetch import first_line

# Documents held out for validation when there is no validation split: those whose text hashes below this, per mille.
HELD_OUT_PER_MILLE = 10


def held_out(text: str) -> bool:
    return zlib.crc32(text.encode("utf-8")) % 1000 < HELD_OUT_PER_MILLE


class PackedStream:
    """The texts of a dataset tokenized and packed into blocks; `state_dict` after any block says where it is."""

    def __init__(self, dataset, tokenizer, block_size: int, text_field: str, keep) -> None:
        self.dataset, self.tokenizer, self.block_size = dataset, tokenizer, block_size
        self.text_field, self.keep = text_field, keep
        self.pending: list[int] = []  # ids of the document under way, not yet in a block

    def blocks(self) -> Iterator[torch.Tensor]:
        for record in self.dataset:
            text = record.get(self.text_field)
            if not text or not self.keep(text):
                continue
            self.pending.extend(self.tokenizer.encode(text, eos=True).tolist())
            while len(self.pending) >= self.block_size:
                block, self.pending = self.pending[: self.block_size], self.pending[self.block_size:]
                yield torch.tensor(block, dtype=torch.long)

    def state_dict(self) -> dict:
        return {"dataset": self.dataset.state_dict(), "pending": list(self.pending)}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self.pending = list(state["pending"])


@dataclass
class StreamShape:
    """What the trainer reads of a streamed training set: how long a sample is (its length is not known ahead)."""

    block_size: int

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return block_sample(torch.zeros(self.block_size, dtype=torch.long))


class PackedBatches:
    """One rank's micro-batches of a `PackedStream`, pass after pass, with its position (`state_dict`)."""

    def __init__(self, stream: PackedStream, micro_batch_size: int, rank: int, world_size: int) -> None:
        self.stream, self.micro_batch_size, self.rank, self.world_size = stream, micro_batch_size, rank, world_size
        self.dataset = StreamShape(stream.block_size)
        self.per_epoch = sys.maxsize  # unknown ahead: bound the run with --train.max_steps or --train.max_tokens
        self.epoch = 0
        self.resumed_epoch: Optional[int] = None  # the pass a checkpoint's position is in

    def iterate(self, epoch: int = 0, position: int = 0) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
        self.epoch = epoch if self.resumed_epoch is None else self.resumed_epoch
        index = position
        while True:
            self.stream.dataset.set_epoch(self.epoch)
            rows: list[torch.Tensor] = []
            for block in self.stream.blocks():
                rows.append(block)
                if len(rows) == self.micro_batch_size:
                    yield self.epoch, index, block_sample(torch.stack(rows))
                    rows, index = [], index + 1
            if index == 0:
                raise UserError("This rank's part of the dataset holds fewer than one micro-batch of blocks: add data "
                                "or lower --train.micro_batch_size / --train.max_seq_length.")
            self.epoch, index = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "stream": self.stream.state_dict()}

    def load_state_dict(self, positions: Sequence[Optional[dict]]) -> None:
        if len(positions) != self.world_size:
            print_once(f"Warning: the checkpoint's data positions are those of {len(positions)} ranks; a Hugging Face "
                       f"stream split over {self.world_size} ranks cannot continue from them: each rank starts its "
                       "part of the dataset again.")
            return
        self.stream.load_state_dict(positions[self.rank]["stream"])
        self.resumed_epoch = positions[self.rank]["epoch"]


@dataclass
class ValidationList:
    samples: list

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.samples[index]


@dataclass
class HFDataset(DataModule):
    """Pretraining text from a Hugging Face dataset, streamed.

    Args:
        path: The dataset on the hub (ORG/NAME) or a local folder of Parquet, Arrow or JSONL files (or a builder name
            such as "json" with `data_files`).
        name: The dataset's configuration (subset), if it has several.
        split: The training split.
        val_split: The validation split; without it, documents held out of `split` by a hash of their text (1 %).
        text_field: The field that holds the text.
        streaming: Read the records as they come (nothing downloaded whole); false: load the dataset first.
        data_files: Files for a builder `path` ("json", "parquet", "arrow").
        val_blocks: Blocks of max_seq_length + 1 tokens in the validation set.
    """

    path: str = ""
    name: Optional[str] = None
    split: str = "train"
    val_split: Optional[str] = None
    text_field: str = "text"
    streaming: bool = True
    data_files: Optional[Any] = None
    val_blocks: int = 64

    def load(self, split: str):
        """The split as a `datasets.IterableDataset`; a path, name or split it cannot read is one line."""
        try:
            import datasets
        except ImportError:
            raise UserError("--data HFDataset needs the datasets library: pip install datasets") from None
        if not self.path:
            raise UserError("--data HFDataset needs --data.path: a dataset on the hub (ORG/NAME) or a local folder.")
        try:
            dataset = datasets.load_dataset(self.path, self.name, split=split, streaming=self.streaming,
                                            data_files=self.data_files)
        except Exception as error:  # the hub client, the builders and fsspec raise their own kinds
            raise UserError(f"Cannot read split {split!r} of the dataset {self.path!r}: {first_line(error)}") from None
        return dataset if self.streaming else dataset.to_iterable_dataset()

    def check_first_record(self, dataset, split: str) -> None:
        record = next(iter(dataset), None)
        if record is None:
            raise UserError(f"Split {split!r} of {self.path!r} is empty: name a split with records (--data.split).")
        if self.text_field not in record:
            raise UserError(f"The records of {self.path!r} have no field {self.text_field!r} (their fields: "
                            f"{', '.join(record)}): name the text's field with --data.text_field.")

    def prepare(self) -> None:
        """Check that the splits can be read and hold the text field; nothing is downloaded or tokenized whole."""
        for split in filter(None, (self.split, self.val_split)):
            self.check_first_record(self.load(split), split)

    def train_dataset(self) -> PackedStream:
        from datasets.distributed import split_dataset_by_node

        from litgpt.distributed.runtime import global_rank, world_size

        dataset = split_dataset_by_node(self.load(self.split), rank=global_rank(), world_size=world_size())
        keep = (lambda text: True) if self.val_split else (lambda text: not held_out(text))
        return PackedStream(dataset, self.tokenizer, self.max_seq_length + 1, self.text_field, keep)

    def val_dataset(self) -> ValidationList:
        """The first `val_blocks` blocks, the same on every rank (the trainer splits them across ranks)."""
        split = self.val_split or self.split
        keep = (lambda text: True) if self.val_split else held_out
        stream = PackedStream(self.load(split), self.tokenizer, self.max_seq_length + 1, self.text_field, keep)
        samples = [block_sample(block) for _, block in zip(range(self.val_blocks), stream.blocks())]
        if not samples:
            raise UserError(f"The validation documents of {self.path!r} (split {split!r}) make no block of "
                            f"{self.max_seq_length + 1} tokens: give --data.val_split or more data.")
        return ValidationList(samples)

    def batches(self, dataset: PackedStream, micro_batch_size: int, seed: int, rank: int,
                world_size: int) -> PackedBatches:
        return PackedBatches(dataset, micro_batch_size, rank, world_size)

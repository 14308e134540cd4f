"""LitGPT's streaming pretraining data, with its names and init args: `LitData` (any litdata optimized folder),
`TinyLlama` (SlimPajama mixed with Starcoder) and `MicroLlama` (SlimPajama alone).

The folders hold token ids already (written by `litgpt prepare` or `litdata.optimize`, locally or on `s3://` /
`gs://`); nothing is tokenized at start. Each rank streams its own share (`litgpt.data.streaming`).
"""

from __future__ import annotations

import os
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional, Union

from litgpt.data.base import DataModule
from litgpt.data.streaming import (
    StreamedBlocks,
    StreamingBatches,
    ValidationBlocks,
    check_folder,
    import_litdata,
    join,
    open_dataset,
    validation_blocks,
)

# LitGPT's loader workers when none are given, at most one per core.
DEFAULT_WORKERS = 8
# TinyLlama's mixture: SlimPajama and Starcoder in these proportions (LitGPT's recipe).
SLIMPAJAMA_WEIGHT, STARCODER_WEIGHT = 0.693584, 0.306416


class StreamingCorpus(DataModule):
    """A data module over litdata optimized folders: training folders (weighted when several) and a validation one."""

    loader_workers: ClassVar[bool] = True

    @abstractmethod
    def train_folders(self) -> list[tuple[str, float]]:
        """(folder, weight) of each training corpus."""

    @abstractmethod
    def val_folder(self) -> str: ...

    @property
    def block_size(self) -> int:
        return self.max_seq_length + 1

    def prepare(self) -> None:
        """Check the folders before step 1 (local ones whole: index, shards, tokenizer); nothing is tokenized. Opening
        each folder here, on the node's first process while the others wait, also fetches a remote folder's index into
        the node's cache: litdata lets another process wait only a second for a download already under way."""
        import_litdata()
        folders = [(folder, "training") for folder, _ in self.train_folders()] + [(self.val_folder(), "validation")]
        for folder, what in folders:
            check_folder(folder, what, self.tokenizer)
            open_dataset(folder, self.block_size, shuffle=False, seed=self.seed)

    def train_dataset(self) -> StreamedBlocks:
        folders = self.train_folders()
        datasets = [open_dataset(folder, self.block_size, shuffle=True, seed=self.seed) for folder, _ in folders]
        if len(datasets) == 1:
            return StreamedBlocks(datasets[0], datasets[0])
        litdata = import_litdata()
        mixture = litdata.CombinedStreamingDataset(datasets=datasets, seed=self.seed,
                                                   weights=[weight for _, weight in folders], iterate_over_all=False)
        return StreamedBlocks(mixture, datasets[0])

    def val_dataset(self) -> ValidationBlocks:
        return validation_blocks(self.val_folder(), self.block_size, self.seed)

    def batches(self, dataset, micro_batch_size: int, seed: int, rank: int, world_size: int) -> StreamingBatches:
        workers = self.num_workers if self.num_workers is not None else min(DEFAULT_WORKERS, os.cpu_count() or 1)
        return StreamingBatches(dataset, micro_batch_size, workers, rank, world_size)


@dataclass
class LitData(StreamingCorpus):
    """Any litdata optimized folder of token ids.

    Args:
        data_path: The folder (local, `s3://...` or `gs://...`). Without `split_names` it is read for both training
            and validation.
        split_names: The training and validation subfolders of `data_path`, e.g. ("train", "val").
        seed: The shuffle seed of the stream.
    """

    data_path: Union[str, Path] = Path("data/")
    split_names: Optional[tuple[str, str]] = None
    seed: int = 42

    def _split(self, index: int) -> str:
        return join(self.data_path, self.split_names[index]) if self.split_names else str(self.data_path)

    def train_folders(self) -> list[tuple[str, float]]:
        return [(self._split(0), 1.0)]

    def val_folder(self) -> str:
        return self._split(1)


@dataclass
class TinyLlama(StreamingCorpus):
    """SlimPajama (`slimpajama/train`, `slimpajama/val`) mixed with Starcoder (`starcoder`), as TinyLlama was
    trained, from folders under `data_path`.

    Args:
        data_path: The folder holding the optimized corpora (local, `s3://...` or `gs://...`).
        seed: The shuffle seed of the streams and of the mixture.
        use_starcoder: Mix in Starcoder (SlimPajama alone without it).
    """

    data_path: Union[str, Path] = Path("data/")
    seed: int = 42
    use_starcoder: bool = True

    def train_folders(self) -> list[tuple[str, float]]:
        slimpajama = join(self.data_path, "slimpajama/train")
        if not self.use_starcoder:
            return [(slimpajama, 1.0)]
        return [(slimpajama, SLIMPAJAMA_WEIGHT), (join(self.data_path, "starcoder"), STARCODER_WEIGHT)]

    def val_folder(self) -> str:
        return join(self.data_path, "slimpajama/val")


@dataclass
class MicroLlama(TinyLlama):
    """SlimPajama alone (`slimpajama/train`, `slimpajama/val` under `data_path`), as MicroLlama was trained."""

    use_starcoder: bool = False

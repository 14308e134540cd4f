"""What every data source provides, and the one loader that turns samples into resumable micro-batches.

A data module tokenizes its source once (`prepare`) and then offers two datasets whose samples are already shifted
for next-token prediction: `input_ids` and `labels` of equal length, with -100 in `labels` where no loss is taken
(prompt tokens, padding). The loader decides the order: a permutation per epoch drawn from the seed, split across
ranks, cut into micro-batches. Because the order is a pure function of (seed, epoch), a run resumes exactly where it
stopped by skipping the micro-batches it already consumed: no iterator state needs saving.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Iterator, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from litgpt.prompts import PromptStyle
    from litgpt.tokenizer import Tokenizer

IGNORE_INDEX = -100


class SampleDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """{"input_ids": LongTensor (T,), "labels": LongTensor (T,)}, T <= max_seq_length."""
        ...


@dataclass
class LoaderOptions:
    """LitGPT's loader option, which every data module of ours accepts (keyword only, after its own fields) so that
    LitGPT's recipes read as written. It has no effect on the token caches: samples are tokenized once into a cache
    and collated in the training process, so there are no loader workers; `litgpt.compat` says so when it is set
    (streamed data, `loader_workers`, has workers and uses it). And the packing switch,
    accepted everywhere so that data which cannot be packed says so in one line (`check_packing`).

    Args:
        num_workers: LitGPT's data loader workers; no effect here (there are none).
        packing: Instruction data: several samples in each training sequence, each attending only to itself
            (`litgpt.data.packing`).
    """

    num_workers: Optional[int] = field(default=None, kw_only=True)
    packing: bool = field(default=False, kw_only=True)
    loader_workers: ClassVar[bool] = False  # whether `num_workers` has an effect


class DataModule(LoaderOptions, ABC):
    """A data source. Entry points call `connect`, then `prepare` (rank 0 first, then every rank), then the datasets."""

    tokenizer: Optional["Tokenizer"] = None
    max_seq_length: int = -1
    prompt_style: Optional["PromptStyle"] = None

    def connect(self, tokenizer: "Tokenizer", max_seq_length: int, prompt_style: Optional["PromptStyle"] = None) -> None:
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.prompt_style = prompt_style

    def check_packing(self) -> None:
        """Fail in one line when `packing` is set on data that cannot be packed (instruction data overrides this)."""
        if self.packing:
            from litgpt.errors import UserError

            raise UserError(
                f"--data.packing is for instruction data (JSON, Alpaca, Alpaca2k, AlpacaGPT4, Dolly, LIMA); "
                f"{type(self).__name__} is pretraining text, already cut into full windows of max_seq_length tokens: "
                "drop --data.packing."
            )

    @abstractmethod
    def prepare(self) -> None:
        """Download and tokenize into the cache if that was not done yet. Must be safe to call repeatedly."""

    @abstractmethod
    def train_dataset(self) -> SampleDataset: ...

    @abstractmethod
    def val_dataset(self) -> SampleDataset: ...

    def batches(self, dataset: SampleDataset, micro_batch_size: int, seed: int, rank: int,
                world_size: int) -> "MicroBatches":
        """One rank's training micro-batches of `dataset` (streamed data has a loader of its own)."""
        return MicroBatches(dataset, micro_batch_size, seed, rank, world_size)


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the samples in `epoch`: a permutation that depends only on (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples, right-padding shorter ones (input 0, label IGNORE_INDEX). Packed samples' `positions` are
    stacked too, the padding continuing the positions of the row's last sample (causal: no sample sees it)."""
    length = max(s["input_ids"].numel() for s in samples)
    input_ids = torch.zeros(len(samples), length, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    packed = "positions" in samples[0]
    positions = torch.zeros(len(samples), length, dtype=torch.long) if packed else None
    for row, sample in enumerate(samples):
        n = sample["input_ids"].numel()
        input_ids[row, :n] = sample["input_ids"]
        labels[row, :n] = sample["labels"]
        if packed:
            positions[row, :n] = sample["positions"]
            start = int(sample["positions"][-1]) + 1 if n else 0
            positions[row, n:] = torch.arange(start, start + length - n)
    batch = {"input_ids": input_ids, "labels": labels}
    if packed:
        batch["positions"] = positions
    return batch


def pad_batch(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """A collated micro-batch right-padded to `length` positions as `collate` pads (input 0, label IGNORE_INDEX,
    packed positions continuing the row's last sample): causal attention keeps the padding out of every real
    position, and it has no label."""
    pad = length - batch["input_ids"].size(1)
    if pad <= 0:
        return batch
    padded = {"input_ids": F.pad(batch["input_ids"], (0, pad)),
              "labels": F.pad(batch["labels"], (0, pad), value=IGNORE_INDEX)}
    if "positions" in batch:
        positions = batch["positions"]
        steps = torch.arange(1, pad + 1, device=positions.device, dtype=positions.dtype)
        padded["positions"] = torch.cat((positions, positions[:, -1:] + steps), dim=1)
    return {**batch, **padded}


@dataclass
class MicroBatches:
    """Micro-batches of one rank, epoch after epoch, from a position given as (epoch, micro-batch index).

    Every rank gets the same number of equally sized micro-batches per epoch; the few samples that do not divide
    evenly are left out of that epoch (a different few each epoch, since the order changes).
    """

    dataset: SampleDataset
    micro_batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    shuffle: bool = True

    @property
    def collate(self):
        """How samples become a micro-batch: the dataset's own `collate` where it has one (preference pairs), else
        `collate`."""
        return getattr(self.dataset, "collate", collate)

    @property
    def per_epoch(self) -> int:
        return len(self.dataset) // self.world_size // self.micro_batch_size

    def indices(self, epoch: int) -> torch.Tensor:
        n = len(self.dataset)
        order = epoch_order(n, self.seed, epoch) if self.shuffle else torch.arange(n)
        usable = self.per_epoch * self.micro_batch_size * self.world_size
        mine = order[:usable][self.rank :: self.world_size]
        return mine.view(self.per_epoch, self.micro_batch_size)

    def state_dict(self) -> None:
        """None: the order is a function of (seed, epoch), so the trainer's epoch and position say where it is."""
        return None

    def load_state_dict(self, positions: Sequence[Optional[dict]]) -> None:
        """Nothing to load (see `state_dict`)."""

    def iterate(self, epoch: int = 0, position: int = 0) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
        """Yield (epoch, index within the epoch, batch) forever, starting at (epoch, position)."""
        if self.per_epoch == 0:
            raise ValueError("fewer samples than one micro-batch per rank")
        while True:
            batches = self.indices(epoch)
            for index in range(position, self.per_epoch):
                yield epoch, index, self.collate([self.dataset[int(i)] for i in batches[index]])
            epoch, position = epoch + 1, 0

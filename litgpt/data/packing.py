"""Packed finetuning data (`--data.packing true`): several instruction samples in each training sequence.

Instruction samples are mostly far shorter than max_seq_length, so a micro-batch of them, right-padded to its
longest, is mostly padding. Packing lays samples one after another in sequences of up to max_seq_length tokens, so
a micro-batch holds (nearly) only real tokens. Each sample still sees only itself: a pack carries `positions`, every
token's position within its own sample (0 where a sample starts), from which the model builds RoPE per token and a
block-diagonal causal attention mask (`GPT.forward(sample_positions=...)`). A sample's labels are its own, unchanged
(samples are already shifted: the last label of a sample is its EOS, predicted from its own last token), so no loss
crosses a boundary and the prompt stays masked. Padding is only at the end of a pack, when a micro-batch is collated.

Which samples share a pack is decided once, from the samples' lengths and the seed (`pack_samples`: best-fit
decreasing over the shuffled samples), so the packs are a pure function of the data and the seed like the samples
themselves: the loader shuffles the packs each epoch and a run resumes by skipping the packs it consumed.

The loss is the mean over every labelled token of the micro-batch, as without packing: each token weighs the same,
a micro-batch simply holds more of them (more samples per micro-batch, so fewer optimizer steps per epoch).
"""

from __future__ import annotations

import bisect

import torch

from litgpt.data.base import SampleDataset


def pack_samples(lengths: list[int], capacity: int, seed: int) -> list[list[int]]:
    """Groups of sample indices whose lengths add up to at most `capacity`, few groups: best-fit decreasing.

    The samples are shuffled with `seed` first, so equally long samples are packed in a seeded order; each sample,
    longest first, goes into the open pack with the least room left that still fits it (a new pack if none does).
    Within a pack, samples keep the order they were placed in.
    """
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sample is longer than the pack capacity {capacity}")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    order.sort(key=lambda i: -lengths[i])  # stable: ties stay in the shuffled order
    packs: list[list[int]] = []
    open_packs: list[tuple[int, int]] = []  # (room left, pack index), sorted
    for i in order:
        at = bisect.bisect_left(open_packs, (lengths[i], -1))
        if at == len(open_packs):
            packs.append([i])
            room, pack = capacity - lengths[i], len(packs) - 1
        else:
            room, pack = open_packs.pop(at)
            packs[pack].append(i)
            room -= lengths[i]
        if room > 0:
            bisect.insort(open_packs, (room, pack))
    return packs


class PackedDataset:
    """A sample dataset's samples packed into sequences of at most `max_seq_length` tokens (see the module docstring).

    Every sample is read once here to learn its length (an instruction dataset tokenizes on access), and again when
    its pack is read.

    Args:
        dataset: Samples whose `input_ids` are at most `max_seq_length` long (instruction data cuts longer ones).
        max_seq_length: The length of a pack.
        seed: Seed of which samples share a pack.
    """

    def __init__(self, dataset: SampleDataset, max_seq_length: int, seed: int) -> None:
        self.dataset, self.max_seq_length = dataset, max_seq_length
        self.lengths = [dataset[i]["input_ids"].numel() for i in range(len(dataset))]
        self.packs = pack_samples(self.lengths, max_seq_length, seed)

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        samples = [self.dataset[i] for i in self.packs[index]]
        return {
            "input_ids": torch.cat([s["input_ids"] for s in samples]),
            "labels": torch.cat([s["labels"] for s in samples]),
            "positions": torch.cat([torch.arange(s["input_ids"].numel()) for s in samples]),
        }

    def fill(self) -> float:
        """The share of the packs' tokens that are samples' tokens (1.0: no room left in any pack)."""
        return sum(self.lengths) / (len(self.packs) * self.max_seq_length) if self.packs else 0.0

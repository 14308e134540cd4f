"""The loader that decides data order: deterministic, split across ranks, resumable at any micro-batch."""

from __future__ import annotations

import torch

from litgpt.data.base import IGNORE_INDEX, MicroBatches, collate, epoch_order


class Numbers:
    """Sample i is the single token i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([i]), "labels": torch.tensor([i])}


def ids(batches, count, **position):
    iterator = batches.iterate(**position)
    return [next(iterator)[2]["input_ids"].flatten().tolist() for _ in range(count)]


def test_ranks_read_disjoint_parts_that_cover_the_epoch():
    data = Numbers(103)
    ranks = [MicroBatches(data, 5, seed=1, rank=r, world_size=4) for r in range(4)]
    per_rank = [sum(ids(b, b.per_epoch), []) for b in ranks]
    seen = sum(per_rank, [])
    assert all(len(p) == 5 * 5 for p in per_rank)  # 103 // 4 // 5 = 5 micro-batches each
    assert len(set(seen)) == len(seen) == 100  # disjoint; the 3 that do not divide are left out this epoch
    assert set(seen) == set(epoch_order(103, 1, 0)[:100].tolist())


def test_order_depends_only_on_seed_and_epoch():
    a, b = MicroBatches(Numbers(50), 4, seed=3), MicroBatches(Numbers(50), 4, seed=3)
    assert ids(a, 30) == ids(b, 30)  # crosses into the next epoch (12 micro-batches each)
    assert ids(a, 12) != ids(MicroBatches(Numbers(50), 4, seed=4), 12)
    epoch0, epoch1 = ids(a, 12), ids(a, 24)[12:]
    assert epoch0 != epoch1  # a new permutation each epoch
    assert len(set(sum(epoch0, []))) == len(set(sum(epoch1, []))) == 48  # each a permutation (50 // 4 * 4 used)


def test_resuming_at_a_position_continues_the_same_stream():
    batches = MicroBatches(Numbers(50), 4, seed=3)
    whole = ids(batches, 30)
    assert ids(batches, 30 - 17, epoch=1, position=5) == whole[17:]


def test_collate_pads_inputs_and_ignores_padded_labels():
    batch = collate([
        {"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([2, 3, 4])},
        {"input_ids": torch.tensor([5]), "labels": torch.tensor([6])},
    ])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [5, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, 4], [6, IGNORE_INDEX, IGNORE_INDEX]]

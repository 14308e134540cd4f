"""Peak bytes of the tensors that ops allocate, counted as they run on the CPU (what a CUDA allocator's peak would
show), for tests that check what `litgpt plan` counts."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors allocated under it that are alive at once (a storage counts once, until the
    last tensor on it dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.holders: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view of a storage allocated before the mode (a weight's, say) allocates nothing
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter):
                key = tensor.untyped_storage().data_ptr()
                if key in self.holders or key not in inputs:
                    self.track(tensor)
        return out

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return
        if key not in self.holders:
            self.holders[key] = 0
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.holders[key] += 1
        weakref.finalize(tensor, self.release, key, storage.nbytes())

    def release(self, key: int, nbytes: int) -> None:
        self.holders[key] -= 1
        if self.holders[key] == 0:
            del self.holders[key]
            self.live -= nbytes

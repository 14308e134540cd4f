"""Recognizing torchao's NF4 weights (`litgpt.quantize`'s ao.nf4) without importing torchao, and computing with
them: dequantized by slices (`NF4Slicer`, `litgpt.sliced_linear`), and stored with rows appended. What the model's
kernels and LoRA need, kept apart from the quantization code so that neither imports `litgpt.quantize`."""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

from litgpt.sliced_linear import forward_by_rows, sliced_linear


def is_nf4(tensor: Optional[torch.Tensor]) -> bool:
    """Whether `tensor` (or this rank's piece of a sharded one) is a torchao NF4Tensor (torchao is not imported)."""
    torchao = sys.modules.get("torchao.quantization")
    local = getattr(tensor, "_local_tensor", tensor)
    return torchao is not None and isinstance(local, torchao.NF4Tensor)


def linear_of_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """`F.linear` with the first `rows` rows of `weight`. An NF4 weight (maybe stored with rows appended so that FSDP
    can split it, `litgpt.quantize.store_nf4`) is dequantized by slices (`NF4Slicer`), the appended rows left out."""
    if not is_nf4(weight):
        if weight.shape[0] == rows:
            return F.linear(x, weight, bias)
        out = F.linear(x, weight)[..., :rows]
        return out if bias is None else out + bias
    device = x.device.type
    if torch.is_autocast_enabled(device):  # what F.linear would compute in
        x = x.to(torch.get_autocast_dtype(device))
    with torch.autocast(device, enabled=False):
        out = sliced_linear(x, NF4Slicer(weight, rows))
    return out if bias is None else out + bias.to(out.dtype)


class NF4Slicer:
    """One torchao NF4Tensor (out, in) as a `litgpt.sliced_linear.Slicer`, of which a layer computes `out_features`
    rows; its forward pass dequantizes it by slices of rows too (torchao's would dequantize it whole)."""

    def __init__(self, weight: torch.Tensor, out_features: int) -> None:
        self.weight, self.out_features = weight, out_features
        self.shape = tuple(weight.shape)
        self.column_step = weight.block_size if self.shape[1] % weight.block_size == 0 else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward_by_rows(self, x)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype

    def dequantizer(self) -> "NF4Dequantizer":
        return NF4Dequantizer(self.weight)


class NF4Dequantizer:
    """Slices of one NF4Tensor dequantized as its `get_original_weight` does, bit for bit, without its int64 codes:
    each byte holds two 4-bit codes, looked up at once as a pair of NF4 values in the weight's dtype, then scaled in
    place by their 64-block's scaler (the scalers are dequantized whole, one per 64 weights, by torchao)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.block = weight, weight.block_size
        self.shape = tuple(weight.shape)
        self.scalers = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                                 weight.scaler_block_size)
        codes = weight.nf4
        # byte 16 * high + low holds (codes[high], codes[low]), the high one first
        self.pairs = torch.stack([codes.repeat_interleave(16), codes.repeat(16)], dim=-1)

    def _dequantize(self, packed: torch.Tensor, scalers: torch.Tensor) -> torch.Tensor:
        """Weights of `packed` bytes (..., blocks * block / 2), scaled by their blocks' `scalers` (..., blocks)."""
        # index_select takes the int32 codes as they are (indexing with [] would copy them to int64 first)
        values = self.pairs.index_select(0, packed.int().reshape(-1)).view(*scalers.shape, self.block)
        return values.mul_(scalers.unsqueeze(-1))

    def rows(self, start: int, stop: int) -> torch.Tensor:
        columns = self.shape[1]
        first, last = start * columns, stop * columns  # a row range may start or end inside a 64-block
        block_start, block_stop = first // self.block, -(-last // self.block)
        packed = self.weight.quantized_data[block_start * self.block // 2:block_stop * self.block // 2]
        values = self._dequantize(packed, self.scalers[block_start:block_stop]).view(-1)
        offset = block_start * self.block
        return values[first - offset:last - offset].view(stop - start, columns)

    def columns(self, start: int, stop: int) -> torch.Tensor:
        out, columns = self.shape
        packed = self.weight.quantized_data.view(out, columns // 2)[:, start // 2:stop // 2]
        scalers = self.scalers.view(out, columns // self.block)[:, start // self.block:stop // self.block]
        return self._dequantize(packed, scalers).view(out, stop - start)

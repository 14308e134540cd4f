"""Bytes of a quantized frozen base (`--quantize`): bitsandbytes' layouts on one device, torchao's NF4 (sharded under
FSDP), what dequantizing a slice of one weight holds for the backward pass's matmul, and the work of quantizing one
weight while loading."""

from __future__ import annotations

import math

BNB_BLOCK = 64  # bitsandbytes' 4-bit quantization block (one absmax per 64 weights)
# Quantizing one weight to NF4 on the device: the 16-bit weight from the file, its copy in the compute dtype, the
# uint8 codes before packing and two temporaries in the compute dtype per weight, plus the nearest-code search over
# chunks of 2**20 weights (16 codes: a distance and its absolute value) in the compute dtype.
NF4_QUANTIZE_FIXED = 2 + 1
NF4_QUANTIZE_COPIES = 3
NF4_QUANTIZE_CHUNK = 2 * 16 * 2**20


def bnb_bytes(shape: tuple[int, ...], mode: str) -> int:
    """bitsandbytes' storage of one weight: the packed values and the quantization statistics."""
    numel = math.prod(shape)
    blocks = -(-numel // BNB_BLOCK)
    if mode == "bnb.int8":
        return numel + shape[0] * 4  # int8 values and a float32 scale per output row
    if mode == "bnb.nf4-dq":
        # the absmax of each block quantized to 8 bits, with a float32 scale per 256 of them and an offset
        return -(-numel // 2) + blocks + 4 * -(-blocks // 256) + 4
    return -(-numel // 2) + 4 * blocks  # nf4 / fp4: 4-bit values and a float32 absmax per block


def nf4_bytes(shape: tuple[int, ...], itemsize: int, shard: int = 1, gathered: bool = False) -> int:
    """torchao's NF4Tensor of one weight on one rank: the 4-bit codes, an int8 scaler per 64 weights and a scale per
    group of scalers (in the dtype it dequantizes to) are split by rows over `shard` ranks (`gathered`: the whole
    weight, as all-gathered or before sharding); every rank keeps the scalers' mean and the 16 code values. A weight
    whose rows do not split so is stored with zero rows appended (`litgpt.quantize.nf4_stored_rows`), counted too."""
    from litgpt.quantize import NF4_BLOCK, nf4_scaler_block, nf4_stored_rows

    scalers_per_scale = nf4_scaler_block(math.prod(shape))
    numel = nf4_stored_rows(shape, shard) * shape[1]
    blocks = numel // NF4_BLOCK
    split = numel // 2 + blocks + blocks // scalers_per_scale * itemsize
    return (split if gathered else -(-split // shard)) + 17 * itemsize


def stored_bytes(shape: tuple[int, ...], mode: str, compute_itemsize: int, shard: int) -> int:
    """One quantized weight as a run stores it on a device in `mode` (the stored mode, `litgpt.quantize.storage_mode`):
    bitsandbytes' layout, or torchao's NF4 (in the compute dtype) split over the shard group."""
    if mode == "ao.nf4":
        return nf4_bytes(shape, compute_itemsize, shard)
    return bnb_bytes(shape, mode)


def dequantize_bytes(shape: tuple[int, ...], mode: str, compute_itemsize: int, weight_itemsize: int) -> int:
    """What the backward pass of one quantized layer of weight `shape` holds at once to dequantize it: one slice of its
    columns (`litgpt.sliced_linear`; the whole weight where its rows do not split into 64-blocks, and for bnb.int8,
    which bitsandbytes dequantizes whole). torchao's NF4: the slice's codes widened to int32 (a pair of weights each)
    beside their looked-up values, scaled in place, and every 64-block's scaler. bitsandbytes' 4-bit: the slice's bytes
    and float32 block scales copied beside the slice dequantized in the weights' dtype (`weight_itemsize`), then its
    copy in the compute dtype where that differs; double quantization's scales dequantized whole in float32."""
    from litgpt.sliced_linear import slices

    rows, columns = shape
    numel = rows * columns
    if mode == "bnb.int8":
        return numel * weight_itemsize
    sliced = numel  # weights in one slice; both formats have blocks of 64 weights
    if columns % BNB_BLOCK == 0:
        start, stop = slices(columns, BNB_BLOCK, rows)[0]
        sliced = rows * (stop - start)
    if mode == "ao.nf4":
        return sliced * (2 + compute_itemsize) + numel // BNB_BLOCK * compute_itemsize
    scales = numel // BNB_BLOCK * 4 if mode == "bnb.nf4-dq" else 0
    cast = sliced * compute_itemsize if compute_itemsize != weight_itemsize else 0
    return scales + sliced * weight_itemsize + max(sliced // 2 + sliced // BNB_BLOCK * 4, cast)


def quantize_work_bytes(numel: int, mode: str, compute_itemsize: int, master_itemsize: int) -> int:
    """The work of quantizing one weight of `numel` elements on the device: torchao's temporaries, or the weight in
    the master dtype that bitsandbytes quantizes there."""
    if mode == "ao.nf4":
        per_weight = NF4_QUANTIZE_FIXED + NF4_QUANTIZE_COPIES * compute_itemsize
        return numel * per_weight + NF4_QUANTIZE_CHUNK * compute_itemsize
    return numel * master_itemsize

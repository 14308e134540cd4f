"""Bytes of a quantized frozen base (`--quantize`): bitsandbytes' layouts on one device, torchao's NF4 (sharded under
FSDP), what dequantizing one weight holds for its matmul, and the work of quantizing one weight while loading."""

from __future__ import annotations

import math

BNB_BLOCK = 64  # bitsandbytes' 4-bit quantization block (one absmax per 64 weights)
# torchao 0.18's NF4 dequantization holds, per weight: the 4-bit codes unpacked to int64 (8 bytes), then the looked-up
# values, their scaled copies and the interleaved result (3 in the compute dtype); measured in tests/test_plan.py.
NF4_DEQUANTIZE_INT64 = 8
NF4_DEQUANTIZE_COPIES = 3
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


def dequantize_bytes(numel: int, mode: str, compute_itemsize: int, weight_itemsize: int) -> int:
    """What dequantizing one weight of `numel` elements holds at once for the matmul: torchao's NF4 temporaries, or
    bitsandbytes' weight in the dtype the module sees its weights in (`weight_itemsize`)."""
    if mode == "ao.nf4":
        return numel * (NF4_DEQUANTIZE_INT64 + NF4_DEQUANTIZE_COPIES * compute_itemsize)
    return numel * weight_itemsize


def quantize_work_bytes(numel: int, mode: str, compute_itemsize: int, master_itemsize: int) -> int:
    """The work of quantizing one weight of `numel` elements on the device: torchao's temporaries, or the weight in
    the master dtype that bitsandbytes quantizes there."""
    if mode == "ao.nf4":
        per_weight = NF4_QUANTIZE_FIXED + NF4_QUANTIZE_COPIES * compute_itemsize
        return numel * per_weight + NF4_QUANTIZE_CHUNK * compute_itemsize
    return numel * master_itemsize

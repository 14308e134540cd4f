"""Quantized frozen base weights (QLoRA, arXiv:2305.14314) with bitsandbytes or torchao; both are optional.

`quantize_frozen_base(model, mode)` stores the weight of every linear layer of the transformer blocks (q/k/v,
attention output, every MLP and expert linear) in 4 or 8 bits, whether or not the layer carries LoRA adapters. The
adapters, norms, embeddings, the output head and the mixture-of-experts router stay in floating point:

- the output head is often tied to the embeddings, sets the dtype of the KV cache, and decides the logits;
- the router is tiny and its top-k choice is discontinuous, so quantization noise there changes which experts run.

Modes: `bnb.nf4` (4-bit NormalFloat), `bnb.nf4-dq` (nf4 with quantized quantization statistics, "double
quantization"), `bnb.fp4` (4-bit float) and `bnb.int8` (LLM.int8() with outlier threshold 6), all bitsandbytes; and
`ao.nf4`, torchao's `NF4Tensor`: the same 4-bit NormalFloat, double-quantized (an int8 scaler per 64 weights, a float
scale per 256 scalers: about 4.13 bits per weight).

Only `ao.nf4` can be sharded by FSDP2 (`SHARDABLE_MODES`, `storage_mode`). An NF4Tensor implements FSDP2's all-gather
extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather`): its packed 4-bit data and its scalers are split over the
ranks and all-gathered as they are, in 4 bits, and the gathered tensor is an NF4Tensor again (FSDP2 splits rows; a
weight whose rows do not split into whole NF4 blocks and scale groups is stored with zero rows appended and computed
by its layer as its own rows, `store_nf4`). bitsandbytes' Params4bit
keeps its quantization statistics in a `quant_state` beside the tensor, which FSDP2 neither shards nor gathers, so a
sharded bitsandbytes weight would lose them. Under FSDP `bnb.nf4` and `bnb.nf4-dq` (the same format) are therefore
stored as `ao.nf4`; `bnb.fp4` and `bnb.int8` are refused.

bitsandbytes layers compute in the dtype the weights had before (float32, bfloat16 or float16); an NF4 weight is
dequantized in its own dtype (the training commands give it the run's compute dtype) and cast to its input's. The
4-bit layers' backward passes (bitsandbytes' and torchao's NF4's forward pass too) dequantize the weight a slice at a
time (`litgpt.sliced_linear`: `Linear4bitSlicedBackward`, `NF4Linear` and LoRA's `linear_of_rows`), where both
libraries dequantize it whole: 16 MiB of a weight at once instead of up to 14 bytes for each of its weights. For
bitsandbytes, before quantizing, a tiny layer of the chosen mode is run forward and
backward on the target device, so a mode that this bitsandbytes build cannot run there gives a UserError instead of a
crash in the middle of training.

Order: build (on meta), `add_lora`, load the base weights, cast the model to its training dtype, then quantize.
A later `model.to(device)` is safe, and so is `model.to(dtype)` for bitsandbytes (integer storage is never cast) and
for an NF4 weight already in that dtype; the quantized layers keep computing in the dtype they were quantized from.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
from typing import Iterator, Optional, Union

import torch
import torch.nn as nn

from litgpt.errors import UserError
from litgpt.precision import Precision
from litgpt.lora import LoRALinear, is_lora_key
from litgpt.nf4 import is_nf4, linear_of_rows
from litgpt.sliced_linear import sliced_linear

QUANTIZE_MODES = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8", "ao.nf4")
# What FSDP2 can shard: torchao's NF4, and bitsandbytes' NF4 modes, which a sharded run stores as torchao NF4.
SHARDABLE_MODES = ("ao.nf4", "bnb.nf4", "bnb.nf4-dq")
INSTALL_HINT = "pip install 'litgpt[quantize]'"
INT8_THRESHOLD = 6.0
NF4_BLOCK = 64  # torchao NF4: one int8 scaler per 64 weights ...
NF4_SCALER_BLOCK = 256  # ... and one scale (in the weight's dtype) per 256 scalers
NF4_LOGGERS = ("torchao", "torch.utils._pytree")  # what torchao's import logs: missing optional kernels, deprecations


def check_quantize_mode(mode: str, sharded: bool = False) -> None:
    """UserError for an unknown mode, a mode FSDP cannot shard (`sharded`), or when the library that stores it
    cannot be imported."""
    if mode not in QUANTIZE_MODES:
        raise UserError(f"Unknown quantization {mode!r}; use one of {', '.join(QUANTIZE_MODES)}.")
    mode = storage_mode(mode, sharded)
    if mode == "ao.nf4":
        _import_torchao(mode)
    else:
        _import_bitsandbytes(mode)


def storage_mode(mode: str, sharded: bool) -> str:
    """The mode that stores the base: under FSDP (`sharded`) bitsandbytes' NF4 modes become `ao.nf4`, the same 4-bit
    NormalFloat in a tensor FSDP2 can shard; bnb.fp4 and bnb.int8 are refused."""
    if not sharded or mode == "ao.nf4":
        return mode
    if mode in SHARDABLE_MODES:
        return "ao.nf4"
    raise UserError(
        f"--quantize {mode} cannot be sharded by FSDP (bitsandbytes keeps its quantization state outside the weight "
        f"tensor): on several devices use one of {', '.join(SHARDABLE_MODES)} (stored as torchao NF4), or --devices 1."
    )


def check_quantized_offload(option: str, cpu_offload: bool, shard: int, sharding_strategy: str) -> None:
    """UserError for CPU offload (`option`) of a quantized base that FSDP does not shard: with a shard group of one
    device (NO_SHARD, or HYBRID_SHARD with one device per node) the NF4 base stays whole on every device."""
    if cpu_offload and shard == 1:
        layout = "NO_SHARD" if sharding_strategy == "NO_SHARD" else f"{sharding_strategy} with one device per node"
        raise UserError(
            f"{option} with --quantize offloads a sharded base, but {layout} keeps the whole 4-bit base on every "
            f"device: use FULL_SHARD, or leave out {option}."
        )


def check_nf4_precision(precision: "Precision", sharded: bool) -> None:
    """UserError for torchao NF4 weights that the model's cast would dequantize: a 16-bit -true precision casts the
    whole module (`module.to(dtype)`), and `.to(dtype)` of an NF4Tensor returns a dequantized copy, which
    `nn.Module` keeps beside the 4-bit data. A sharded NF4 weight (a DTensor in that dtype already) is left as it is."""
    if precision.weights_dtype != torch.float32 and not sharded:
        raise UserError(
            f"--precision {precision} would dequantize torchao's NF4 weights where FSDP does not shard them (one "
            "device, or NO_SHARD): use --precision bf16-mixed, bnb.nf4 on one device, or FULL_SHARD on several."
        )


@contextlib.contextmanager
def _quiet(logger_names: tuple[str, ...]) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in logger_names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _import_torchao(mode: str):
    """`torchao.quantization` (NF4Tensor, to_nf4). Its import logs, once per process, which optional compiled kernels
    it could not load (NF4 uses none of them): kept off the console."""
    try:
        with _quiet(NF4_LOGGERS):
            import torchao.quantization
    except ImportError:
        raise UserError(f"--quantize {mode} needs the torchao package: {INSTALL_HINT}.") from None
    except Exception as error:  # a broken install or a torch it was not built for
        raise UserError(
            f"--quantize {mode}: torchao is installed but failed to import ({_first_line(error)}). "
            f"Reinstall it with {INSTALL_HINT}."
        ) from None
    return torchao.quantization


def _import_bitsandbytes(mode: str):
    try:
        import bitsandbytes
    except ImportError:
        raise UserError(f"--quantize {mode} needs the bitsandbytes package: {INSTALL_HINT}.") from None
    except Exception as error:  # a broken install raises RuntimeError, OSError, ... at import
        raise UserError(
            f"--quantize {mode}: bitsandbytes is installed but failed to import ({_first_line(error)}). "
            f"Reinstall it with {INSTALL_HINT}."
        ) from None
    return bitsandbytes


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def quantize_frozen_base(
    model: nn.Module, mode: str, device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None
) -> None:
    """Replace the frozen base weights of the blocks' linear layers of `model` by quantized ones.

    bitsandbytes: plain `nn.Linear` layers become bitsandbytes layers (same state-dict prefix); a `LoRALinear` keeps
    its adapters in float and gets its base as a child `base_layer` (its `weight` and `bias` become None).
    ao.nf4: every layer stays what it is and its `weight` becomes a frozen NF4Tensor parameter that dequantizes to
    `dtype` (default: the weight's dtype; bitsandbytes ignores it); `F.linear` on it computes in the input's dtype.

    The weights must be loaded (not on the meta device). They are quantized on `device` (default: where they are),
    layer by layer, so a model loaded on the CPU can be quantized straight onto a GPU. Adapters and other parameters
    are not moved.
    """
    check_quantize_mode(mode)
    targets = quantize_targets(model)
    if not targets:
        raise RuntimeError("The model has no float linear layers left to quantize (already quantized?).")
    first = targets[0][2].weight
    if any(module.weight.is_meta for _, _, module in targets):
        raise RuntimeError("Load the base weights before quantizing: the model is on the meta device.")
    target = torch.device(device) if device is not None else first.device
    if mode == "ao.nf4":
        check_nf4_shapes(model)
        for block, name, module in targets:
            store_nf4(block, name, module, module.weight.to(target), dtype or module.weight.dtype, shard=1)
        return
    for weight_dtype in sorted({module.weight.dtype for _, _, module in targets}, key=str):
        check_mode_runs(mode, target, weight_dtype)

    for block, name, module in targets:
        quantized = quantized_linear(module.weight, module.bias, mode, target)
        if isinstance(module, LoRALinear):
            module.weight = None
            module.bias = None
            module.base_layer = quantized
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(block.get_submodule(parent_name) if parent_name else block, child, quantized)


def quantize_targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(block, name in the block, layer) of every linear layer whose float weight `quantize_frozen_base` quantizes."""
    return [(block, name, module) for block in model.transformer.h for name, module in block_targets(block)]


def block_targets(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name in the block, layer) of the block's linear layers whose weight is still float (the router excepted)."""
    targets = []
    for name, module in block.named_modules():
        if isinstance(module, LoRALinear):
            if module.weight is not None and not is_nf4(module.weight):
                targets.append((name, module))
        elif type(module) is nn.Linear and not name.endswith("mlp.gate") and not is_nf4(module.weight):
            targets.append((name, module))
    return targets


# ---- torchao NF4 -----------------------------------------------------------------------------------------------------
def nf4_scaler_block(numel: int) -> int:
    """Scalers per scale for a weight of `numel` elements: torchao's 256, or the largest power of two that divides
    its number of 64-blocks (small layers), so that whole scaler blocks cover the weight."""
    return math.gcd(NF4_SCALER_BLOCK, numel // NF4_BLOCK)


def frozen_nf4(weight: torch.Tensor, dtype: torch.dtype, rows: Optional[int] = None) -> nn.Parameter:
    """`weight` (out, in) quantized where it is to a frozen NF4Tensor parameter that dequantizes to `dtype`; with
    `rows` (at least out) it is stored with zero rows appended up to `rows` (`nf4_stored_rows`). The appended rows do
    not touch the statistics of the weight's own: its NF4 values are exactly those of the weight quantized alone."""
    to_nf4 = _import_torchao("ao.nf4").to_nf4
    source = weight.detach().to(dtype).contiguous()
    nf4 = to_nf4(source, NF4_BLOCK, nf4_scaler_block(source.numel()))
    if rows is not None and rows != weight.shape[0]:
        nf4 = _append_rows(nf4, rows)
    return nn.Parameter(nf4, requires_grad=False)


def _append_rows(nf4: torch.Tensor, rows: int) -> torch.Tensor:
    """The NF4Tensor `nf4` with zero codes, zero scalers and unit scales appended up to `rows` rows. Dequantization
    reads a weight's own 64-block and its own group of scalers (the scalers' mean stays the weight's), so the first
    rows dequantize exactly as before; whole groups are appended, as `nf4_stored_rows` counts them."""
    columns = nf4.shape[1]
    extra = (rows - nf4.shape[0]) * columns
    blocks, groups = extra // NF4_BLOCK, extra // NF4_BLOCK // nf4.scaler_block_size
    assert extra > 0 and blocks * NF4_BLOCK == extra and groups * nf4.scaler_block_size == blocks, (nf4.shape, rows)
    parts = {
        "quantized_data": torch.cat([nf4.quantized_data, nf4.quantized_data.new_zeros(extra // 2)]),
        "quantized_scalers": torch.cat([nf4.quantized_scalers, nf4.quantized_scalers.new_zeros(blocks)]),
        "quantization_factor": torch.cat([nf4.quantization_factor, nf4.quantization_factor.new_ones(groups)]),
        "n_blocks": nf4.n_blocks + blocks, "size": torch.Size((rows, columns)), "stride": (columns, 1),
    }
    # torchao's own way to build an NF4Tensor from another with some parts replaced (its split and gather use it)
    construct_nf4_args = sys.modules[type(nf4).__module__].construct_nf4_args
    return type(nf4)(*construct_nf4_args(nf4, parts))


def nf4_stored_rows(shape: tuple[int, int], shard: int) -> int:
    """The rows an NF4 weight of `shape` is stored with to be split over `shard` ranks: FSDP2 splits rows, and each
    rank's piece must hold whole 64-blocks and whole groups of their scalers. A weight that splits so keeps its rows;
    any other gets zero rows appended up to the next count that does (their outputs are dropped:
    `litgpt.nf4.linear_of_rows`)."""
    rows, columns = shape
    group = NF4_BLOCK * nf4_scaler_block(rows * columns)  # weights per group of scalers
    step = group // math.gcd(columns, group)  # a rank's rows must be a multiple of this
    return -(-rows // (shard * step)) * shard * step


class NF4Linear(nn.Module):
    """A frozen linear layer with a torchao NF4 weight, dequantized by slices (`litgpt.nf4.linear_of_rows`). The
    weight may be stored with rows appended so that FSDP2 can split it (`nf4_stored_rows`): the layer returns its own
    `out_features`."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], out_features: int) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.in_features, self.out_features = weight.shape[1], out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_of_rows(x, self.weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored_rows={self.weight.shape[0]}"


def store_nf4(block: nn.Module, name: str, layer: nn.Linear, weight: torch.Tensor, dtype: torch.dtype,
              shard: int) -> None:
    """Give `layer` (the block's target `name`, `block_targets`) `weight` as a frozen NF4 weight split over `shard`
    ranks, stored with the rows `nf4_stored_rows` gives. A LoRA layer keeps it as its base weight; a plain layer is
    replaced by an `NF4Linear` (the same state-dict keys)."""
    stored = frozen_nf4(weight, dtype, nf4_stored_rows(tuple(weight.shape), shard))
    if isinstance(layer, LoRALinear):
        layer.weight = stored
        return
    parent_name, _, child = name.rpartition(".")
    setattr(block.get_submodule(parent_name) if parent_name else block, child,
            NF4Linear(stored, layer.bias, layer.out_features))


def check_nf4_shapes(model: nn.Module) -> None:
    """UserError unless every weight `quantize_targets` finds can be stored as NF4 (a multiple of 64 weights); any
    such weight splits over any number of ranks (`nf4_stored_rows`)."""
    for block_index, block in enumerate(model.transformer.h):
        for name, module in block_targets(block):
            if module.weight.numel() % NF4_BLOCK:
                where = f"transformer.h.{block_index}.{name}.weight {tuple(module.weight.shape)}"
                raise UserError(f"--quantize ao.nf4 cannot store {where}: NF4 needs a multiple of 64 weights.")


def quantized_linear(
    weight: torch.Tensor, bias: Optional[torch.Tensor], mode: str, device: torch.device
) -> nn.Module:
    """A frozen bitsandbytes linear layer holding `weight` (out, in) quantized on `device`, and `bias` as it is."""
    bnb = _import_bitsandbytes(mode)
    out_features, in_features = weight.shape
    dtype = weight.dtype
    if mode == "bnb.int8":
        layer = bnb.nn.Linear8bitLt(
            in_features, out_features, bias=bias is not None, has_fp16_weights=False, threshold=INT8_THRESHOLD,
            device="meta",
        )
        # Int8Params quantizes when it moves from the CPU to a device (the CPU included).
        source = weight.detach().to("cpu")
        layer.weight = bnb.nn.Int8Params(source, requires_grad=False, has_fp16_weights=False).to(device)
    else:
        quant_type = "fp4" if mode == "bnb.fp4" else "nf4"
        double = mode == "bnb.nf4-dq"
        layer = _linear4bit_sliced_backward()(
            in_features, out_features, bias=bias is not None, compute_dtype=dtype, compress_statistics=double,
            quant_type=quant_type, device="meta",
        )
        # On CPUs with AVX512-BF16, inference would repack the weight into a layout that training cannot use.
        layer.support_avx512bf16_for_cpu = False
        param = bnb.nn.Params4bit(
            weight.detach(), requires_grad=False, compress_statistics=double, quant_type=quant_type, module=layer
        )
        layer.weight = param.to(device)  # quantization happens here
    stored = layer.weight
    if stored.element_size() != 1 or stored.device.type != device.type:
        # Older bitsandbytes releases quantize only when moving to CUDA and leave the weight as it was elsewhere.
        raise RuntimeError(f"bitsandbytes {bnb.__version__} did not quantize the weight on {device.type}")
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().to(device), requires_grad=False)
    return layer


@functools.lru_cache(maxsize=None)
def _linear4bit_sliced_backward() -> type:
    """bitsandbytes' `Linear4bit` whose backward pass dequantizes the weight by slices of columns
    (`litgpt.sliced_linear`) instead of whole; its forward pass is bitsandbytes' own (a class made on first use:
    bitsandbytes is optional)."""
    bnb = _import_bitsandbytes("bnb.nf4")

    class Linear4bitSlicedBackward(bnb.nn.Linear4bit):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.bias is not None and self.bias.requires_grad:  # bitsandbytes' own pass gives the bias its gradient
                return super().forward(x)
            return sliced_linear(x, Bnb4bitSlicer(self, bnb.nn.Linear4bit.forward))

    return Linear4bitSlicedBackward


class Bnb4bitSlicer:
    """The weight of one bitsandbytes `Linear4bit` (nf4 or fp4, block scales quantized or not) as a
    `litgpt.sliced_linear.Slicer`: the forward pass is bitsandbytes' own (`layer_forward`)."""

    def __init__(self, layer: nn.Module, layer_forward) -> None:
        self.layer, self.layer_forward = layer, layer_forward
        self.shape = tuple(layer.weight.quant_state.shape)
        self.out_features = self.shape[0]
        block = layer.weight.quant_state.blocksize
        self.column_step = block if self.shape[1] % block == 0 else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.layer_forward(self.layer, x)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        return self.layer.compute_dtype or x.dtype

    def dequantizer(self) -> "Bnb4bitDequantizer":
        return Bnb4bitDequantizer(self.layer.weight)


class Bnb4bitDequantizer:
    """Slices of one bitsandbytes 4-bit weight, each dequantized by bitsandbytes from the slice's bytes and block
    scales (the blocks of 64 weights lie within rows when the row length is a multiple of 64; `Bnb4bitSlicer` slices
    only then)."""

    def __init__(self, weight: torch.Tensor) -> None:
        from bitsandbytes.functional import dequantize_blockwise

        self.weight, self.state = weight, weight.quant_state
        self.shape, self.block = tuple(self.state.shape), self.state.blocksize
        absmax = self.state.absmax
        if self.state.nested:  # the block scales are quantized too: dequantized whole, as bitsandbytes does
            absmax = dequantize_blockwise(absmax, self.state.state2) + self.state.offset
        self.absmax = absmax.float()

    def _dequantize(self, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        from bitsandbytes.functional import QuantState, dequantize_4bit

        state = QuantState(absmax=absmax.contiguous(), shape=torch.Size(shape), code=self.state.code,
                           blocksize=self.block, quant_type=self.state.quant_type, dtype=self.state.dtype)
        return dequantize_4bit(packed.reshape(-1, 1), state)  # bitsandbytes' own layout of packed bytes

    def rows(self, start: int, stop: int) -> torch.Tensor:
        if (start, stop) == (0, self.shape[0]) or self.shape[1] % self.block:
            return self._dequantize(self.weight.data, self.absmax, self.shape)[start:stop]
        columns = self.shape[1]
        packed = self.weight.data.view(-1)[start * columns // 2:stop * columns // 2]
        absmax = self.absmax[start * columns // self.block:stop * columns // self.block]
        return self._dequantize(packed, absmax, (stop - start, columns))

    def columns(self, start: int, stop: int) -> torch.Tensor:
        out, columns = self.shape
        packed = self.weight.data.view(out, columns // 2)[:, start // 2:stop // 2]
        absmax = self.absmax.view(out, columns // self.block)[:, start // self.block:stop // self.block]
        return self._dequantize(packed, absmax, (out, stop - start))


@functools.lru_cache(maxsize=None)
def _probe(mode: str, device: str, dtype: torch.dtype) -> None:
    torch_device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator).to(torch_device, dtype)
    layer = quantized_linear(weight, torch.zeros(64, device=torch_device, dtype=dtype), mode, torch_device)
    x = torch.randn(3, 128, generator=generator).to(torch_device, dtype).requires_grad_(True)
    out = layer(x)
    out.float().sum().backward()
    if out.shape != (3, 64) or x.grad is None or not torch.isfinite(out.float()).all():
        raise RuntimeError("the test layer computed no usable result or gradient")
    expected = x.detach().float() @ weight.float().t()
    error = (out.detach().float() - expected).norm() / expected.norm()
    if error > 0.5:  # 4-bit noise on this layer is about 0.1, int8 about 0.01
        raise RuntimeError(f"the test layer's result is off by {error:.0%}")


def check_mode_runs(mode: str, device: Union[str, torch.device], dtype: torch.dtype) -> None:
    """Run a tiny quantized layer forward and backward; UserError if bitsandbytes cannot do it on this device."""
    check_quantize_mode(mode)
    device = torch.device(device)
    try:
        _probe(mode, str(device), dtype)
    except UserError:
        raise
    except Exception as error:  # whatever bitsandbytes raises on this device, the advice is the same: the probe's job
        import bitsandbytes

        raise UserError(
            f"bitsandbytes {bitsandbytes.__version__} cannot run --quantize {mode} with "
            f"{str(dtype).replace('torch.', '')} weights on {device.type}: {_first_line(error)}. "
            f"Try another mode or device, or update bitsandbytes ({INSTALL_HINT} -U)."
        ) from None


def weight_bytes(module: nn.Module, skip_lora: bool = True) -> int:
    """Bytes of the parameters of `module` plus the statistics bitsandbytes keeps beside quantized weights
    (block scales, code books, double-quantization state, int8 row scales); shared tensors count once. An NF4Tensor
    counts its packed data, scalers and scales; a sharded parameter (DTensor) this rank's piece."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(tensor) -> None:
        nonlocal total
        tensor = getattr(tensor, "_local_tensor", tensor)
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.numel() == 0:
            return
        if is_nf4(tensor):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                add(getattr(tensor, name))
            return
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if key not in seen:
            seen.add(key)
            total += key[1]

    def add_quant_state(state) -> None:
        if state is None:
            return
        for attribute in ("absmax", "code", "offset"):
            add(getattr(state, attribute, None))
        add_quant_state(getattr(state, "state2", None))

    for name, param in module.named_parameters():
        if skip_lora and is_lora_key(name):
            continue
        add(param)
        add_quant_state(getattr(param, "quant_state", None))
        add(getattr(param, "SCB", None))
    for submodule in module.modules():
        state = getattr(submodule, "state", None)
        if state is not None and hasattr(state, "SCB"):
            add(state.SCB)
            add(getattr(state, "CB", None))
    return total

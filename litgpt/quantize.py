"""Quantized frozen base weights with bitsandbytes (QLoRA, arXiv:2305.14314); bitsandbytes is optional.

`quantize_frozen_base(model, mode)` stores the weight of every linear layer of the transformer blocks (q/k/v,
attention output, every MLP and expert linear) in 4 or 8 bits, whether or not the layer carries LoRA adapters. The
adapters, norms, embeddings, the output head and the mixture-of-experts router stay in floating point:

- the output head is often tied to the embeddings, sets the dtype of the KV cache, and decides the logits;
- the router is tiny and its top-k choice is discontinuous, so quantization noise there changes which experts run.

Modes: `bnb.nf4` (4-bit NormalFloat), `bnb.nf4-dq` (nf4 with quantized quantization statistics, "double
quantization"), `bnb.fp4` (4-bit float) and `bnb.int8` (LLM.int8() with outlier threshold 6). Quantized layers
compute in the dtype the weights had before (float32, bfloat16 or float16). Before quantizing, a tiny layer of the
chosen mode is run forward and backward on the target device, so a mode that this bitsandbytes build cannot run
there gives a UserError instead of a crash in the middle of training.

Order: build (on meta), `add_lora`, load the base weights, cast the model to its training dtype, then quantize.
A later `model.to(device)` or `model.to(dtype)` is safe (integer storage is never cast), but the quantized layers keep
computing in the dtype they were quantized from.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import torch.nn as nn

from litgpt.errors import UserError
from litgpt.lora import LoRALinear, is_lora_key

QUANTIZE_MODES = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8")
INSTALL_HINT = "pip install 'litgpt[quantize]'"
INT8_THRESHOLD = 6.0


def check_quantize_mode(mode: str) -> None:
    """UserError for an unknown mode or when bitsandbytes cannot be imported."""
    if mode not in QUANTIZE_MODES:
        raise UserError(f"Unknown quantization {mode!r}; use one of {', '.join(QUANTIZE_MODES)}.")
    _import_bitsandbytes(mode)


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


def quantize_frozen_base(model: nn.Module, mode: str, device: Optional[Union[str, torch.device]] = None) -> None:
    """Replace the frozen base weights of the blocks' linear layers of `model` by bitsandbytes quantized ones.

    Plain `nn.Linear` layers become bitsandbytes layers (same state-dict prefix); a `LoRALinear` keeps its adapters in
    float and gets its base as a child `base_layer` (its `weight` and `bias` become None). The weights must be loaded
    (not on the meta device). They are quantized on `device` (default: where they are), layer by layer, so a model
    loaded on the CPU can be quantized straight onto a GPU. Adapters and other parameters are not moved.
    """
    check_quantize_mode(mode)
    targets = quantize_targets(model)
    if not targets:
        raise RuntimeError("The model has no float linear layers left to quantize (already quantized?).")
    first = targets[0][2].weight
    if any(module.weight.is_meta for _, _, module in targets):
        raise RuntimeError("Load the base weights before quantizing: the model is on the meta device.")
    target = torch.device(device) if device is not None else first.device
    for dtype in sorted({module.weight.dtype for _, _, module in targets}, key=str):
        check_mode_runs(mode, target, dtype)

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
    targets = []
    for block in model.transformer.h:
        for name, module in block.named_modules():
            if isinstance(module, LoRALinear):
                if module.weight is not None:
                    targets.append((block, name, module))
            elif type(module) is nn.Linear and not name.endswith("mlp.gate"):
                targets.append((block, name, module))
    return targets


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
        layer = bnb.nn.Linear4bit(
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
    (block scales, code books, double-quantization state, int8 row scales); shared tensors count once."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(tensor) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.numel() == 0:
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

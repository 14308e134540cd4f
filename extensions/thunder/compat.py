"""Making Lightning Thunder 0.2.6 import and run our model on newer torch releases.

Two gaps, each bridged only where it exists, so a torch or thunder that has what is needed is left as it is:

- torch 2.13 removed the named-tensor methods `Tensor.align_as`, `align_to`, `has_names`, `refine_names` and
  `rename`; thunder's table of torch operations names them at import time. They come back as functions that carry
  their own names (thunder registers an operation under its function's `__name__`) and raise when called.
- thunder 0.2.6 translates `F.scaled_dot_product_attention` without its `enable_gqa` argument (torch >= 2.5), which
  our attention passes for grouped-query models. The translation learns it: the key and value heads are repeated to
  the query heads, which is what `enable_gqa` means, then thunder's own attention runs.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Any

from litgpt.errors import UserError

NAMED_TENSOR_METHODS = ("align_as", "align_to", "has_names", "refine_names", "rename")
MINIMUM_THUNDER = (0, 2, 6)
INSTALL_HINT = "pip install -e '.[thunder]'"


def removed_method(name: str):
    def method(*args, **kwargs):
        raise RuntimeError(f"Tensor.{name} was removed from torch (named tensors); it exists only so thunder imports.")

    method.__name__ = name
    method.__qualname__ = f"Tensor.{name}"
    return method


def add_named_tensor_methods(tensor_class: type) -> list[str]:
    """Give `tensor_class` the named-tensor methods it lacks; returns the names added (none on an older torch)."""
    added = [name for name in NAMED_TENSOR_METHODS if not hasattr(tensor_class, name)]
    for name in added:
        setattr(tensor_class, name, removed_method(name))
    return added


def parse_version(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def check_thunder_version(version: str) -> None:
    if parse_version(version) < MINIMUM_THUNDER:
        minimum = ".".join(map(str, MINIMUM_THUNDER))
        raise UserError(
            f"lightning-thunder {version} is too old for --compiler thunder (it needs {minimum} or newer): "
            f"{INSTALL_HINT} installs a recent one."
        )


def import_thunder() -> tuple[Any, list[str]]:
    """Import thunder with the bridges in place: (the thunder module, the torch methods that had to be added).

    Thunder missing (or one of its requirements) or too old: one UserError that says how to install it.
    """
    import torch

    added = add_named_tensor_methods(torch.Tensor)
    # Noise nobody can act on: thunder looks for Transformer Engine at import, and its collectives call torch APIs
    # that torch 2.13 deprecates.
    warnings.filterwarnings("ignore", message="transformer_engine module not found")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`")
    try:
        thunder = importlib.import_module("thunder")
    except ImportError as error:
        missing = f" (missing: {error.name})" if error.name and error.name != "thunder" else ""
        raise UserError(
            f"--compiler thunder needs Lightning Thunder, which is not installed{missing}: run `{INSTALL_HINT}` "
            "in the litgpt checkout (it keeps your torch), or use --compiler torch or none."
        ) from None
    check_thunder_version(getattr(thunder, "__version__", "0"))
    teach_grouped_query_attention(thunder)
    return thunder, added


def teach_grouped_query_attention(thunder) -> bool:
    """Let thunder translate `enable_gqa=True` in scaled_dot_product_attention; False when it already can."""
    import torch.nn.functional as F
    import thunder.torch as ltorch
    from thunder.core.interpreter import interpreter_needs_wrap
    from thunder.core.jit_ext import _general_jit_lookaside_map, ensure_recursive_proxies

    if "enable_gqa" in inspect.signature(ltorch.scaled_dot_product_attention.meta).parameters:
        return False
    translation = _general_jit_lookaside_map.get(F.scaled_dot_product_attention)
    if getattr(translation, "litgpt_gqa", False):
        return True  # taught already in this process

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                  enable_gqa=False):
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            repeats = query.shape[-3] // key.shape[-3]
            key = ltorch.repeat_interleave(key, repeats, -3)
            value = ltorch.repeat_interleave(value, repeats, -3)
        return ltorch.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)

    translation = ensure_recursive_proxies(interpreter_needs_wrap(attention))
    translation.litgpt_gqa = True
    _general_jit_lookaside_map[F.scaled_dot_product_attention] = translation
    return True

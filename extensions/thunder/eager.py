"""The plain-PyTorch side of a Thunder-compiled model: what tracing leaves behind in it, and eager copies for decoding.

Leftovers. thunder.jit traces a module by interpreting its Python code, and the interpreter performs the code's
side effects on the real objects, with its proxies as the values. Only writes into a module's own registries
(`_parameters`, `_buffers`, `_modules`) become outputs of the trace; a write into any other container that the module
holds is done on the real container and stays there (thunder 0.2.6: the `dict.__setitem__` lookaside of
`thunder/core/jit_ext.py`, `_general_jit_dict_setitem`, records only dicts flagged EXT_FLAG_IS_MODULE_MEMBER_DICT
and stores the value either way). litgpt's GPT fills such a container on first use: `GPT._rope_cache`, the rotary
tables, keyed by the device of the activations (inside a trace a thunder Device, so the eager entries, keyed by torch
devices, are never affected). After the first trace it holds that trace's TensorProxies, and the next trace of the
same module, which thunder makes whenever its cache misses (under `torch.no_grad`, in eval mode, for a new input shape:
validation), reads them back as if they were inputs. They belong to no trace, so thunder fails to unpack them:
`AssertionError: <TensorProxy ...> has history None` (`unpack_inputs`, thunder/core/jit_ext.py). `drop_leftovers`
removes them before every trace; a new trace then computes the tables itself, as the first one did.

Eager copies. litgpt decodes with a KV cache and a position-dependent forward (`litgpt.generate`), which the compiled
module is not traced for, and under thunder's FSDP the original module holds meta tensors only. `eager_copy` builds a
plain module of the original's class and config on the meta device and assigns it given full weights (shared with
the compiled module's where it holds them whole, gathered where it holds shards).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# A module's registries: thunder returns its writes into these from the trace; they never hold leftovers.
MODULE_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def is_trace_value(value, proxy_type: type) -> bool:
    if isinstance(value, proxy_type):
        return True
    return isinstance(value, (tuple, list)) and any(is_trace_value(item, proxy_type) for item in value)


def drop_leftovers(module: nn.Module) -> int:
    """Remove the entries of the modules' plain dicts (and lists) that hold thunder proxies; returns how many."""
    from thunder.core.proxies import Proxy

    dropped = 0
    for sub in module.modules():
        for name, container in vars(sub).items():
            if name in MODULE_REGISTRIES or name.endswith("hooks"):
                continue
            if isinstance(container, dict):
                stale = [key for key, value in container.items() if is_trace_value(value, Proxy)]
                for key in stale:
                    del container[key]
                dropped += len(stale)
            elif isinstance(container, list) and any(is_trace_value(v, Proxy) for v in container):
                kept = [value for value in container if not is_trace_value(value, Proxy)]
                dropped += len(container) - len(kept)
                container[:] = kept
    return dropped


def clean_before_every_trace(compiled: nn.Module) -> None:
    """Before each call of the compiled module: if the previous call traced (thunder counts a cache miss before it
    traces), drop what that trace left in the original module, so the trace this call may make starts clean."""
    import thunder

    original = compiled._model
    seen = {"misses": 0}

    def before_call(module, args, kwargs=None):
        misses = thunder.cache_misses(compiled)
        if misses != seen["misses"]:
            drop_leftovers(original)
            seen["misses"] = misses

    compiled.register_forward_pre_hook(before_call)


def eager_copy(original: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """A plain module of `original`'s class and config holding `weights` (assigned, not copied), in eval mode.

    `weights` has every parameter name (tied ones under each of their names, the same tensor where they are tied).
    """
    from litgpt.checkpoint.model_files import meta_device

    with meta_device():
        copy = type(original)(original.config)
    copy.load_state_dict(weights, strict=True, assign=True)
    for param in copy.parameters():
        param.requires_grad_(False)
    return copy.eval()


def full_weights(named: dict[str, torch.Tensor], gather: Callable[[str, torch.Tensor], torch.Tensor]) -> dict:
    """Every name with its full tensor, `gather(name, local)` called once per tensor (tied names share it)."""
    by_id: dict[int, torch.Tensor] = {}
    weights = {}
    for name, local in named.items():
        if id(local) not in by_id:
            by_id[id(local)] = gather(name, local.detach())
        weights[name] = by_id[id(local)]
    return weights

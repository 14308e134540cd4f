"""The optimizer a run trains with, from a name or a class_path/init_args mapping, and its learning-rate schedule."""

from __future__ import annotations

import importlib
import math
from typing import Iterable, Union

import torch

from litgpt.class_paths import may_import
from litgpt.errors import UserError


def build_optimizer(spec: Union[str, dict], parameters: Iterable[torch.nn.Parameter], device: torch.device):
    """An optimizer from a name ("AdamW") or {"class_path": ..., "init_args": {...}}; fused AdamW where supported."""
    class_path, cls, init_args = optimizer_spec(spec)
    if cls in (torch.optim.AdamW, torch.optim.Adam) and "fused" not in init_args and device.type in ("cuda", "cpu"):
        init_args["fused"] = True
    try:
        return cls([p for p in parameters if p.requires_grad], **init_args)
    except TypeError as error:
        raise UserError(f"--optimizer {class_path}: {error}") from None


def optimizer_spec(spec: Union[str, dict]) -> tuple[str, type, dict]:
    """The class path, class and keyword arguments of an --optimizer value, checked (a run calls this before it writes
    anything, so that a bad optimizer leaves no trace)."""
    if isinstance(spec, str):
        class_path, init_args = spec, {}
    elif isinstance(spec, dict):
        # No class_path: `--optimizer.lr 1e-4` alone changes the default optimizer, AdamW.
        class_path, init_args = spec.get("class_path", "AdamW"), dict(spec.get("init_args") or {})
        # `--optimizer.init_args.lr 0.01` on the command line reaches us flattened, as {"lr": "0.01"}.
        flat = {key: value for key, value in spec.items() if key not in ("class_path", "init_args")}
        init_args.update({key: flag_value(value) for key, value in flat.items()})
    else:
        raise UserError(f"--optimizer must be a name such as AdamW or a class_path/init_args mapping, got {spec!r}.")
    return class_path, optimizer_class(class_path), init_args


def optimizer_class(class_path: str) -> type:
    """The `torch.optim.Optimizer` subclass a class path names ("AdamW" is torch.optim.AdamW).

    Its module is imported only if it belongs to an installed distribution (torch.optim, torchao.optim,
    bitsandbytes.optim, ...): `may_import`, the check every class path gets (litgpt/class_paths.py).
    """
    module_name, _, class_name = class_path.rpartition(".")
    not_an_optimizer = UserError(
        f"--optimizer {class_path!r} is not an optimizer class (a torch.optim.Optimizer subclass such as AdamW, "
        "torch.optim.SGD or bitsandbytes.optim.AdamW8bit)."
    )
    module_name = module_name or "torch.optim"
    if not may_import(module_name):
        raise not_an_optimizer
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        raise not_an_optimizer from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise not_an_optimizer
    return cls


def flag_value(text):
    """A command-line value as YAML reads it (`0.9`, `[0.9, 0.95]`, `true`), with `1e-3`-style floats too."""
    import yaml

    if not isinstance(text, str):
        return text
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def base_learning_rate(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_lr` at `total_steps`."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))

"""Reading and writing checkpoint files: atomic writes, safe loads, clear errors for folders that do not fit."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from litgpt.errors import UserError

WEIGHTS_FILE = "lit_model.pth"
CONFIG_FILE = "model_config.yaml"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is fsynced and renamed onto `path`.

    An interrupted write leaves the previous file (if any) untouched and no half-written file under the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def save_state_dict(state_dict: dict, path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(state_dict, tmp)


def load_state_dict(path: Path) -> dict:
    """Load a checkpoint memory-mapped and without running pickled code (weights_only)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"Checkpoint file {str(path)!r} does not exist.")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # torch raises several types for corrupt or unsafe files
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"Could not load {str(path)!r} safely: {first_line}. The file is corrupt, incomplete, or holds "
            "objects other than tensors; re-download or re-convert it."
        ) from None


def find_checkpoint_dir(checkpoint_dir: Path) -> Path:
    """Check that a folder holds a litgpt checkpoint and return it."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(
            f"Checkpoint folder {str(checkpoint_dir)!r} does not exist. Download one with `litgpt download REPO_ID` "
            "or convert one with `litgpt convert_to_litgpt HF_DIR`."
        )
    if not (checkpoint_dir / WEIGHTS_FILE).is_file():
        hint = ""
        if any(checkpoint_dir.glob("*.safetensors")) or any(checkpoint_dir.glob("pytorch_model*.bin")):
            hint = f" It looks like a Hugging Face folder: run `litgpt convert_to_litgpt {checkpoint_dir}` first."
        raise UserError(f"{str(checkpoint_dir)!r} has no {WEIGHTS_FILE}.{hint}")
    if not (checkpoint_dir / CONFIG_FILE).is_file():
        raise UserError(f"{str(checkpoint_dir)!r} has no {CONFIG_FILE}; it is needed to build the model.")
    return checkpoint_dir


class _SkipInitOnMeta(torch.overrides.TorchFunctionMode):
    """Skip random initializers on meta tensors, where they compute nothing.

    The meta kernel of `normal_` (nn.Embedding's initializer) lives in Python and costs seconds of imports on first
    use; building a model on the meta device does not need it.
    """

    SKIPPED = ("normal_", "trunc_normal_", "uniform_", "kaiming_uniform_")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.SKIPPED:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device() -> Iterator[None]:
    """Create modules on the meta device (no memory, no initialization); materialize or `assign` weights later."""
    with torch.device("meta"), _SkipInitOnMeta():
        yield


def load_model_weights(model: torch.nn.Module, state_dict: dict, source: str) -> None:
    """Load `state_dict` into `model`, naming the first missing, unexpected or misshapen key on failure."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (first: {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (first: {unexpected[0]})")
        raise UserError(
            f"The weights in {source} do not match the model config: {', '.join(parts)}. "
            "Check that model_config.yaml belongs to these weights."
        )
    for key, tensor in expected.items():
        if state_dict[key].shape != tensor.shape:
            raise UserError(
                f"The weights in {source} do not match the model config: {key} has shape "
                f"{tuple(state_dict[key].shape)}, the config expects {tuple(tensor.shape)}. "
                "Check that model_config.yaml belongs to these weights."
            )
    model.load_state_dict(state_dict, strict=True, assign=any(p.is_meta for p in model.parameters()))
    config = getattr(model, "config", None)
    if getattr(config, "tie_embeddings", False):
        # `assign` replaces the two tied parameters separately: share them again.
        model.lm_head.weight = model.transformer.wte.weight

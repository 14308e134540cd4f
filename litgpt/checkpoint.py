"""Reading and writing checkpoint files: atomic writes, safe loads, clear errors for folders that do not fit."""

from __future__ import annotations

import os
import re
import shutil
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


def check_weights_match(
    expected: dict[str, torch.Size], state_dict: dict, source: str, subject: str = "The weights", fix: str = ""
) -> None:
    """Raise UserError naming the first missing, unexpected or misshapen key of `state_dict` against `expected`."""
    fix = fix or "Check that model_config.yaml belongs to these weights."
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (first: {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (first: {unexpected[0]})")
        raise UserError(f"{subject} in {source} do not match the model config: {', '.join(parts)}. {fix}")
    for key, shape in expected.items():
        if state_dict[key].shape != shape:
            raise UserError(
                f"{subject} in {source} do not match the model config: {key} has shape "
                f"{tuple(state_dict[key].shape)}, the config expects {tuple(shape)}. {fix}"
            )


def retie_embeddings(model: torch.nn.Module) -> None:
    """Share the output head with the embedding again (loading with `assign` replaces the two one by one)."""
    if getattr(getattr(model, "config", None), "tie_embeddings", False):
        model.lm_head.weight = model.transformer.wte.weight


def load_model_weights(model: torch.nn.Module, state_dict: dict, source: str) -> None:
    """Load `state_dict` into `model`, naming the first missing, unexpected or misshapen key on failure."""
    check_weights_match({k: v.shape for k, v in model.state_dict().items()}, state_dict, source)
    model.load_state_dict(state_dict, strict=True, assign=any(p.is_meta for p in model.parameters()))
    retie_embeddings(model)


@contextmanager
def publish_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; when the block succeeds it replaces `path` in one rename.

    A reader never sees a half-written checkpoint folder; a failure leaves the previous one as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield staging
        for file in staging.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        if path.exists():
            retired = path.with_name(f".{path.name}.old")
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(path, retired)
            os.replace(staging, path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(destination) / name)


STEP_DIR = re.compile(r"^step-(\d+)$")
TRAINING_STATE_FILE = "training_state.pth"


def step_checkpoints(out_dir: Path) -> list[Path]:
    """The run's resumable checkpoints, oldest first."""
    if not Path(out_dir).is_dir():
        return []
    found = [p for p in Path(out_dir).iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted((p for p in found if (p / TRAINING_STATE_FILE).is_file()), key=lambda p: int(p.name[5:]))


def resolve_resume(out_dir: Path, resume) -> "Path | None":
    """The checkpoint folder to resume from, or None to start fresh; refuses to train over an existing run."""
    out_dir = Path(out_dir)
    existing = step_checkpoints(out_dir)
    if resume is False or resume is None:
        if existing or (out_dir / "final").exists():
            newest = existing[-1].name if existing else "final"
            raise UserError(
                f"--out_dir {str(out_dir)!r} already holds a run ({newest}). Pass --resume auto to continue it, "
                "or choose another --out_dir; nothing was overwritten."
            )
        return None
    if resume is True or resume == "auto":
        if not existing:
            print(f"No checkpoint to resume in {str(out_dir)!r}: starting from the beginning.")
            return None
        print(f"Resuming from {existing[-1]}")
        return existing[-1]
    path = Path(resume)
    if not path.is_dir() or not (path / TRAINING_STATE_FILE).is_file():
        raise UserError(
            f"--resume {str(path)!r} is not a checkpoint folder with {TRAINING_STATE_FILE} "
            f"(use a step-XXXXXX folder of a run, or --resume auto)."
        )
    return path

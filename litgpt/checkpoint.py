"""Reading and writing checkpoint files: atomic writes, safe loads, clear errors for folders that do not fit."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

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
        elif (checkpoint_dir / "sharded").is_dir():
            hint = f" It is a sharded checkpoint: run `litgpt consolidate {checkpoint_dir}` to write one."
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


def copy_weights(
    model: torch.nn.Module,
    state_dict: dict,
    source: str,
    select: Callable[[str], bool] = lambda key: True,
    subject: str = "The weights",
    fix: str = "",
) -> None:
    """Copy a full `state_dict` (e.g. memory-mapped) into a materialized model's selected keys, sharded or not.

    Each rank reads only the part of each tensor that it holds. Names the first missing, unexpected or misshapen key.
    """
    from litgpt.parallel import copy_into_shard

    targets = {key: value for key, value in model.state_dict().items() if select(key)}
    check_weights_match({key: value.shape for key, value in targets.items()}, state_dict, source, subject, fix)
    for key, target in targets.items():
        copy_into_shard(target, state_dict[key])


def assign_weights(model: torch.nn.Module, state_dict: dict, source: str, select: Callable[[str], bool]) -> None:
    """Load the selected keys of `state_dict`; a meta-device model takes its (memory-mapped) tensors without a copy."""
    expected = {key: value.shape for key, value in model.state_dict().items() if select(key)}
    check_weights_match(expected, state_dict, source)
    assign = any(value.is_meta for key, value in model.state_dict().items() if select(key))
    model.load_state_dict(state_dict, strict=False, assign=assign)
    retie_embeddings(model)


def load_model_weights(model: torch.nn.Module, state_dict: dict, source: str) -> None:
    """Load `state_dict` into `model`, naming the first missing, unexpected or misshapen key on failure."""
    check_weights_match({k: v.shape for k, v in model.state_dict().items()}, state_dict, source)
    model.load_state_dict(state_dict, strict=True, assign=any(p.is_meta for p in model.parameters()))
    retie_embeddings(model)


def staging_dir(path: Path) -> Path:
    """The temporary folder a checkpoint is written into before `publish_dir` renames it into place.

    Its name is fixed so that every rank of a run writes its shards into the same one.
    """
    return Path(path).with_name(f".{Path(path).name}.partial")


@contextmanager
def publish_dir(path: Path, staging: "Path | None" = None) -> Iterator[Path]:
    """Yield a temporary folder beside `path` (or `staging`, already holding files); when the block succeeds it
    replaces `path` in one rename.

    A reader never sees a half-written checkpoint folder; a failure leaves the previous one as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if staging is None:
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield staging
        for file in staging.rglob("*"):
            if file.is_file():
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
        fsync_dir(path.parent)  # the rename itself survives a power loss only once its folder is synced
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(destination) / name)


STEP_DIR = re.compile(r"^step-(\d+)$")
TRAINING_STATE_FILE = "training_state.pth"
MANIFEST_FILE = "manifest.json"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, info: dict, digests: "dict[str, str] | None" = None) -> None:
    """Record what a complete checkpoint holds: `info` (step, tokens, world size, ...) and every file's size and
    SHA-256 (taken from `digests` where the ranks that wrote the files computed them). Written last, so a folder whose
    manifest verifies was written completely."""
    folder = Path(folder)
    digests = digests or {}
    files = {}
    for file in sorted(folder.rglob("*")):
        if file.is_file() and file.name != MANIFEST_FILE:
            name = file.relative_to(folder).as_posix()
            files[name] = {"bytes": file.stat().st_size, "sha256": digests.get(name) or file_sha256(file)}
    atomic_write_text(folder / MANIFEST_FILE, json.dumps({**info, "files": files}, indent=2) + "\n")


def read_manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST_FILE).read_text())


def verify_checkpoint(folder: Path, checksums: bool = True, part: tuple[int, int] = (0, 1)) -> "str | None":
    """None when the folder's manifest verifies (every file present, with its size and, if asked, its SHA-256);
    otherwise the reason, in words. `part=(i, n)` reads the checksums of every n-th file from the i-th only."""
    folder = Path(folder)
    if not (folder / MANIFEST_FILE).is_file():
        return f"it has no {MANIFEST_FILE} (its save never finished)"
    try:
        files = read_manifest(folder)["files"]
        entries = [(name, int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST_FILE} is unreadable"
    for name, size, _ in entries:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
    if checksums:
        index, count = part
        for name, _, sha256 in entries[index::count]:
            if file_sha256(folder / name) != sha256:
                return f"{name} does not match its SHA-256 in the manifest (the file was damaged)"
    return None


def step_checkpoints(out_dir: Path) -> list[Path]:
    """The run's step-XXXXXX folders, oldest first (complete or not: `verify_checkpoint` tells)."""
    if not Path(out_dir).is_dir():
        return []
    found = [p for p in Path(out_dir).iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def is_rank_zero() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def say_rank_zero(text: str) -> None:
    if is_rank_zero():
        print(text, flush=True)


def every_rank(value: object) -> list:
    """Every rank's `value`, on every rank (collective); [value] in one process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def shared_verdict(folder: Path) -> "str | None":
    """`verify_checkpoint` with the checksums split over the ranks, each reading its share of the files, and the
    verdict the same on every rank (collective)."""
    import torch.distributed as dist

    reason = verify_checkpoint(folder, checksums=False)  # the same on every rank: decides alike whether to go on
    if reason is None and dist.is_initialized():
        part = (dist.get_rank(), dist.get_world_size())
        reason = next((r for r in every_rank(verify_checkpoint(folder, part=part)) if r), None)
    elif reason is None:
        reason = verify_checkpoint(folder)
    return reason


def resolve_resume(out_dir: Path, resume) -> "Path | None":
    """The checkpoint folder to resume from, or None to start fresh; refuses to train over an existing run.

    `auto` takes the newest checkpoint whose manifest verifies and says why it passed over any newer one.
    Collective in a run of several processes.
    """
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
        for unfinished in sorted(out_dir.glob(".step-*.partial")) if out_dir.is_dir() else []:
            say_rank_zero(f"Ignoring {unfinished.name}: a checkpoint save that was interrupted.")
        skipped = []
        for folder in reversed(existing):
            reason = shared_verdict(folder)
            if reason is None:
                step = read_manifest(folder).get("step")
                say_rank_zero(f"Resuming from {folder} (step {step}; manifest verified).")
                return folder
            skipped.append(f"{folder.name}: {reason}")
            say_rank_zero(f"Skipping {folder}: {reason}.")
        if skipped:
            raise UserError(
                f"None of the {len(skipped)} checkpoints in {str(out_dir)!r} is complete ({'; '.join(skipped)}). "
                "Resume from a copy of an intact one with --resume PATH, or start over in another --out_dir."
            )
        say_rank_zero(f"No checkpoint to resume in {str(out_dir)!r}: starting from the beginning.")
        return None
    path = Path(resume)
    if not path.is_dir() or not (path / TRAINING_STATE_FILE).is_file():
        raise UserError(
            f"--resume {str(path)!r} is not a checkpoint folder with {TRAINING_STATE_FILE} "
            f"(use a step-XXXXXX folder of a run, or --resume auto)."
        )
    reason = shared_verdict(path)
    if reason is not None:
        raise UserError(f"--resume {str(path)!r} is not a complete checkpoint: {reason}. Use another step folder.")
    return path


def prune_checkpoints(out_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (never the newest); returns what was deleted.

    A folder that does not verify is left alone: it is not counted as one of the kept, and not ours to judge.
    """
    complete = [p for p in step_checkpoints(out_dir) if verify_checkpoint(p, checksums=False) is None]
    deleted = complete[: max(0, len(complete) - max(1, keep_last))]
    for folder in deleted:
        # Renamed first: a kill during the deletion leaves a hidden folder, never a half-deleted step-XXXXXX.
        doomed = folder.with_name(f".{folder.name}.deleting")
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return deleted


# ---- disk space ----------------------------------------------------------------------------------------------------------
def format_bytes(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def free_bytes(folder: Path) -> int:
    """Free space where `folder` is (or would be created)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_writable(out_dir: Path) -> None:
    """Say now, not at the first checkpoint, when out_dir cannot be written (created nothing if it does not exist)."""
    out_dir = Path(out_dir).absolute()
    existing = out_dir
    while not existing.exists():
        existing = existing.parent
    problem = None
    if not existing.is_dir():
        problem = f"{str(existing)!r} is a file, not a folder"
    elif existing == out_dir:
        try:  # a real write: permissions, read-only mounts and quotas all show here
            fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=out_dir)
            os.close(fd)
            os.unlink(probe)
        except OSError as error:
            problem = error.strerror or str(error)
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{str(existing)!r} is not writable"
    if problem:
        raise UserError(f"--out_dir {str(out_dir)!r} cannot be written ({problem}): choose a folder you can write to.")


def check_free_space(out_dir: Path, needed: int, what: str) -> None:
    """Raise UserError when less than `needed` bytes (plus 5%) are free where out_dir is."""
    free = free_bytes(out_dir)
    if free < needed * 1.05:
        raise UserError(
            f"Not enough disk space in {str(out_dir)!r} for {what}: it needs about {format_bytes(needed)}, "
            f"{format_bytes(free)} are free. Free some space, point --out_dir at a larger disk, or keep fewer "
            "checkpoints with --train.keep_last."
        )


# ---- training checkpoints: full (one file written by rank 0) or sharded (torch.distributed.checkpoint) --------------------
SHARDED_DIR = "sharded"  # the torch.distributed.checkpoint folder inside a sharded checkpoint


def gather_weights(model: torch.nn.Module, select: Callable[[str], bool]) -> dict:
    """The selected weights as whole CPU tensors on rank 0 ({} on the others); every rank must call this."""
    from litgpt.parallel import gather_full

    gathered = {}
    for key, value in model.state_dict().items():
        if select(key):
            full = gather_full(value).detach()
            if is_rank_zero():
                gathered[key] = full.cpu()
    return gathered


def gather_optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """The optimizer state keyed by parameter names, whole, on rank 0; every rank must call this."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load a whole, name-keyed optimizer state (`gather_optimizer_state`) into a possibly sharded optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def sharded_state(model: torch.nn.Module, optimizer, select: Callable[[str], bool]) -> dict:
    """This rank's shards of the selected weights and of the optimizer state, as torch.distributed.checkpoint reads
    and writes them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = {key: value for key, value in get_model_state_dict(model).items() if select(key)}
    return {"model": weights, "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_sharded(folder: Path, model: torch.nn.Module, optimizer, select: Callable[[str], bool]) -> None:
    """Every rank writes its shards into folder/sharded in parallel (collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(model, optimizer, select), checkpoint_id=Path(folder) / SHARDED_DIR)


class _ShardedMetadataUnpickler(pickle.Unpickler):
    """Reads the `.metadata` pickle of a torch.distributed.checkpoint folder admitting only the types such a file
    holds: torch reads it with plain pickle, which would run whatever code a planted file asks for."""

    ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self.ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which checkpoint metadata never holds")


def read_sharded_metadata(path: Path):
    """The metadata of a torch.distributed.checkpoint folder, read without running pickled code."""
    file = Path(path) / ".metadata"  # the name torch.distributed.checkpoint gives it
    try:
        with open(file, "rb") as f:
            return _ShardedMetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"{str(path)!r} is not a sharded checkpoint: it has no .metadata file.") from None
    except Exception as error:  # pickle raises many types for corrupt files
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"Could not load {str(file)!r} safely: {reason}. The file is corrupt, incomplete, or holds objects other "
            "than a checkpoint's metadata; use a checkpoint you wrote yourself."
        ) from None


def load_sharded(folder: Path, model: torch.nn.Module, optimizer, select: Callable[[str], bool]) -> None:
    """Load a sharded checkpoint into the model and optimizer, resharding when the world size differs from the
    run that saved it (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    state = sharded_state(model, optimizer, select)
    path = Path(folder) / SHARDED_DIR
    read_sharded_metadata(path)  # refuses a planted pickle before dcp.load unpickles it
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as error:  # DCP's exception (a BaseException) gathers every rank's
        cause = next(iter(getattr(error, "failures", {}).values()), error)  # (exception, traceback) per rank
        reason = " ".join(str(cause[0] if isinstance(cause, tuple) else cause).split())[:300]
        raise UserError(
            f"Cannot load the sharded checkpoint {str(path)!r} into this model: {reason}. Check that the model "
            "config and the fine-tuning settings (e.g. lora_r) are those of the run that saved it."
        ) from None
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def consolidated_weights(folder: Path) -> dict:
    """The weights of a sharded checkpoint as one plain state dict (read in this one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(folder) / SHARDED_DIR
    metadata = read_sharded_metadata(path)  # refuses a planted pickle before dcp.load unpickles it
    weights = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            weights[key[len("model."):]] = torch.empty(item.size, dtype=item.properties.dtype)
    dcp.load({"model": weights}, checkpoint_id=path, no_dist=True)
    return weights

"""A run's checkpoint folders on disk: staged and published whole, verified by their manifest, found for resuming,
pruned, and the disk checks around them.

out_dir/step-XXXXXX/ holds the weights, training_state.pth (optimizer, loop position, RNG), the config, the
tokenizer and manifest.json, written last; a sharded checkpoint keeps its weights and optimizer state in sharded/.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from litgpt.distributed.runtime import distributed_is_up, every_rank, global_rank, print_once, world_size
from litgpt.errors import UserError
from litgpt.failpoints import failpoint
from litgpt.io import atomic_write_text, file_sha256, fsync_dir, read_sharded_metadata
from litgpt.safe_paths import inside

STEP_DIR = re.compile(r"^step-(\d+)$")

FINAL_DIR = "final"  # the last step's weights and files, without the training state: what a run publishes

TRAINING_STATE_FILE = "training_state.pth"

MANIFEST_FILE = "manifest.json"

SHARDED_DIR = "sharded"  # the torch.distributed.checkpoint folder inside a sharded checkpoint

# How long ranks verifying a checkpoint together wait for the slowest: a minute plus its share at 25 MB/s.
HASHING_BASE_SECONDS = 60.0
HASHING_FLOOR_BYTES_PER_SECOND = 25e6


def staging_dir(path: Path) -> Path:
    """The temporary folder a checkpoint is written into before `publish_dir` renames it into place.

    Its name is fixed so that every rank of a run writes its shards into the same one; runs do not clash over it, as
    one run at a time holds the out_dir (`run_lock`).
    """
    return Path(path).with_name(f".{Path(path).name}.partial")


_RENAME_EXCHANGE = 2  # renameat2's flag (linux/fs.h): swap two existing paths in one step


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux renameat2); False where the system or filesystem cannot."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28
        return False
    at_cwd = -100
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a filesystem without exchange (NFS, ...)
        return False
    raise OSError(code, os.strerror(code), str(a))


@contextmanager
def publish_dir(path: Path, staging: "Path | None" = None) -> Iterator[Path]:
    """Yield a temporary folder beside `path` (or `staging`, already holding files); when the block succeeds it
    takes the place of `path`.

    A reader never sees a half-written checkpoint folder, and never a moment without a complete one under `path`: an
    existing folder is swapped with the new one in one step (renameat2 RENAME_EXCHANGE); where the filesystem cannot,
    the old one is retired under a hidden name first and `restore_retired` brings it back after a kill in between. A
    failure leaves the previous folder as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    restore_retired(path)
    if staging is None:
        staging = staging_dir(path)
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed run (one run at a time holds the out_dir)
        staging.mkdir()
    try:
        yield staging
        for file in staging.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(staging)
        if not path.exists():
            os.replace(staging, path)
        elif exchange(staging, path):
            failpoint("publish:exchanged")  # the new folder in place, the old one under the staging name
        else:
            retired = retired_dir(path)
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(path, retired)
            failpoint("publish:retired")
            os.replace(staging, path)
        fsync_dir(path.parent)  # the rename itself survives a power loss only once its folder is synced
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        restore_retired(path)  # a failure between the two renames
        shutil.rmtree(retired_dir(path), ignore_errors=True)


def retired_dir(path: Path) -> Path:
    return Path(path).with_name(f".{Path(path).name}.old")


def restore_retired(path: Path) -> None:
    """Put back a folder that a publish without RENAME_EXCHANGE retired, when it failed or was killed before the new
    one took its place."""
    retired = retired_dir(path)
    if retired.is_dir() and not Path(path).exists():
        os.replace(retired, path)


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
    try:  # nothing is read before every name is known to stay inside the folder
        paths = {name: inside(folder, name, source=folder / MANIFEST_FILE) for name, _, _ in entries}
    except UserError as refused:
        return str(refused).rstrip(".")
    for name, size, _ in entries:
        path = paths[name]
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
    if checksums:
        index, count = part
        for name, _, sha256 in entries[index::count]:
            if file_sha256(paths[name]) != sha256:
                return f"{name} does not match its SHA-256 in the manifest (the file was damaged)"
    return None


def step_dir(out_dir: Path, step: int) -> Path:
    """The folder of the checkpoint after optimizer step `step`: out_dir/step-XXXXXX."""
    return Path(out_dir) / f"step-{step:06d}"


def step_checkpoints(out_dir: Path) -> list[Path]:
    """The run's step-XXXXXX folders, oldest first (complete or not: `verify_checkpoint` tells)."""
    if not Path(out_dir).is_dir():
        return []
    found = [p for p in Path(out_dir).iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def shared_verdict(folder: Path) -> "str | None":
    """`verify_checkpoint` with the checksums split over the ranks, each reading its share of the files, and the
    verdict the same on every rank (collective)."""
    reason = verify_checkpoint(folder, checksums=False)  # the same on every rank: decides alike whether to go on
    if reason is None and distributed_is_up():
        part = (global_rank(), world_size())
        # A rank hashing a 140 GB file outlasts the collective timeout: the others wait for as long as the largest
        # share takes to read from a slow shared filesystem.
        sizes = [entry["bytes"] for entry in read_manifest(folder)["files"].values()]
        largest_share = max(sum(sizes[index::world_size()]) for index in range(world_size()))
        bound = HASHING_BASE_SECONDS + largest_share / HASHING_FLOOR_BYTES_PER_SECOND
        reason = next((r for r in every_rank(verify_checkpoint(folder, part=part), bound) if r), None)
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
        if existing or (out_dir / FINAL_DIR).exists():
            newest = existing[-1].name if existing else FINAL_DIR
            raise UserError(
                f"--out_dir {str(out_dir)!r} already holds a run ({newest}). Pass --resume auto to continue it, "
                "or choose another --out_dir; nothing was overwritten."
            )
        return None
    if resume is True or resume == "auto":
        for unfinished in sorted(out_dir.glob(".step-*.partial")) if out_dir.is_dir() else []:
            print_once(f"Ignoring {unfinished.name}: a checkpoint save that was interrupted.")
        skipped = []
        for folder in reversed(existing):
            reason = shared_verdict(folder)
            if reason is None:
                step = read_manifest(folder).get("step")
                print_once(f"Resuming from {folder} (step {step}; manifest verified).")
                return folder
            skipped.append(f"{folder.name}: {reason}")
            print_once(f"Skipping {folder}: {reason}.")
        if skipped:
            raise UserError(
                f"None of the {len(skipped)} checkpoints in {str(out_dir)!r} is complete ({'; '.join(skipped)}). "
                "Resume from a copy of an intact one with --resume PATH, or start over in another --out_dir."
            )
        print_once(f"No checkpoint to resume in {str(out_dir)!r}: starting from the beginning.")
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


def consolidated_weights(folder: Path) -> dict:
    """The weights of a sharded checkpoint as one plain state dict (read in this one process)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from litgpt.checkpoint.sharded_reader import load_sharded_state

    path = Path(folder) / SHARDED_DIR
    metadata = read_sharded_metadata(path)  # refuses a planted pickle; the reader reuses it
    weights = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            weights[key[len("model."):]] = torch.empty(item.size, dtype=item.properties.dtype)
    load_sharded_state({"model": weights}, path, metadata, hint="Its files are incomplete or damaged.", no_dist=True)
    return weights

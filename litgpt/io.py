"""Files that survive a crash and files from strangers: atomic writes, and loads that never run code.

Every file litgpt writes goes to a temporary name and is renamed into place when complete; every file it reads
(weights, training state, the metadata of a sharded checkpoint) is read so that only tensors and plain containers can
come out of it. torch is imported only by the functions that need it, so `litgpt.config` can use this module.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from litgpt.errors import UserError
from litgpt.safe_paths import inside


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


def atomic_copy(source: Path, destination: Path) -> None:
    """Copy a file with its permissions and times; `destination` is the old file or the whole new one, never a part."""
    with atomic_path(destination) as tmp:
        shutil.copy2(source, tmp)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def save_state_dict(state_dict: dict, path: Path) -> None:
    """torch.save to `path` atomically; a failed write raises its OSError (whose errno says e.g. "disk full")."""
    import torch

    with atomic_path(path) as tmp, open(tmp, "wb", buffering=0) as file:
        writer = _WriteErrorKeeper(file)
        try:
            torch.save(state_dict, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None


class _WriteErrorKeeper:
    """The file torch.save writes through, keeping the OSError of a failed write: torch reports it as a RuntimeError
    that has lost the errno."""

    def __init__(self, file) -> None:
        self.file = file
        self.error: "OSError | None" = None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def load_state_dict(path: Path) -> dict:
    """Load a checkpoint memory-mapped and without running pickled code (weights_only)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"Checkpoint file {str(path)!r} does not exist.")
    import torch

    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except MemoryError:
        raise out_of_memory_error(path) from None
    except Exception as error:  # torch raises many types (pickle, zip, EOF, runtime) for corrupt or unsafe files
        if cannot_map(path):  # torch's RuntimeError for a failed mmap carries no errno
            raise out_of_memory_error(path) from None
        raise unsafe_file_error(path, error) from None


def cannot_map(path: Path) -> bool:
    """Whether this process lacks the memory (address space) to map `path`, as `mmap` itself reports it."""
    import mmap

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
            return False
    except OSError as error:
        return error.errno == errno.ENOMEM
    except ValueError:  # an empty file cannot be mapped; it is not short of memory
        return False


def out_of_memory_error(path: Path) -> UserError:
    """The one line for a checkpoint that this machine has not the memory to load (it is not corrupt for that)."""
    path = Path(path)
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    size = sum(f.stat().st_size for f in files)
    return UserError(
        f"Not enough memory to load {str(path)!r} ({size / 2**30:,.2f} GiB on disk): free memory (other processes, "
        "fewer dataloader workers) or use a machine with more."
    )


def unsafe_file_error(path: Path, error: Exception) -> UserError:
    """The one line for a checkpoint file that could not be read as tensors and plain containers."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return UserError(
        f"Could not load {str(path)!r} safely: {first_line}. The file is corrupt, incomplete, or holds objects other "
        "than tensors; re-download or re-convert it, or use a checkpoint you wrote yourself."
    )


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_json(path: Path, values: dict) -> None:
    from litgpt.io import atomic_write_text

    atomic_write_text(path, json.dumps(values, indent=2, default=str) + "\n")


def write_yaml(path: Path, values: dict) -> None:
    import yaml

    from litgpt.io import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(values, sort_keys=False))


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
        import torch

        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self.ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which checkpoint metadata never holds")


def read_sharded_metadata(path: Path):
    """The metadata of a torch.distributed.checkpoint folder, read without running pickled code."""
    file = Path(path) / ".metadata"  # the name torch.distributed.checkpoint gives it
    try:
        with open(file, "rb") as f:
            metadata = _ShardedMetadataUnpickler(f).load()
        check_storage_paths(metadata, Path(path), file)
        return metadata
    except FileNotFoundError:
        raise UserError(f"{str(path)!r} is not a sharded checkpoint: it has no .metadata file.") from None
    except MemoryError:
        raise out_of_memory_error(file) from None
    except Exception as error:  # pickle raises many types for corrupt files
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"Could not load {str(file)!r} safely: {reason}. The file is corrupt, incomplete, or holds objects other "
            "than a checkpoint's metadata; use a checkpoint you wrote yourself."
        ) from None


def check_storage_paths(metadata, folder: Path, file: Path) -> None:
    """Refuse metadata that points the reader at a file outside its own folder (`../../secret`, `/etc/...`)."""
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        inside(folder, getattr(info, "relative_path", None), source=file)

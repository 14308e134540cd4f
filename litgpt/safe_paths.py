"""File names read out of a file from elsewhere (an index, a manifest, a config) stay inside that file's folder."""

from __future__ import annotations

import os
from pathlib import Path

from litgpt.errors import UserError


def inside(folder: Path, name: object, source: Path) -> Path:
    """`folder / name` for a file name that `source` lists, refused unless it stays inside `folder`.

    An absolute name, a `..` that climbs out, or a symlink that leads out would have us read (or hash, or copy) a
    file of the user's that the file's author chose; the file may only point at its own folder's files.
    """
    folder = Path(folder)
    refused = UserError(
        f"{str(source)!r} names the file {name!r}, which is not inside its folder {str(folder)!r}; a file from "
        "elsewhere may only name files in its own folder: use an intact copy of it."
    )
    if not isinstance(name, str) or name in ("", ".") or "\0" in name or os.path.isabs(name) or ".." in Path(name).parts:
        raise refused
    path = folder / name
    # resolve() follows every symlink on the way, so the comparison sees where the read would really go.
    target = path.resolve()
    if not (target.is_relative_to(folder.resolve()) or target.is_relative_to(hub_cache_blobs(folder))):
        raise refused
    return path


def hub_cache_blobs(folder: Path) -> Path:
    """The blobs folder of a Hugging Face cache snapshot (`.../snapshots/REV/`, whose files are symlinks into
    `../../blobs/`), where the hub client put them; the folder itself elsewhere (no file of a folder resolves there)."""
    folder = Path(folder).resolve()
    blobs = folder.parent.parent / "blobs"
    return blobs if folder.parent.name == "snapshots" and blobs.is_dir() else folder

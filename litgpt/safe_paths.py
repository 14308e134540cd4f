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
    if not isinstance(name, str) or name in ("", ".") or "\0" in name or os.path.isabs(name):
        raise refused
    path = folder / name
    # resolve() follows every symlink and `..` on the way, so the comparison sees where the read would really go.
    if not path.resolve().is_relative_to(folder.resolve()):
        raise refused
    return path

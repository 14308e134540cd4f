"""Training data the tests write from the bundled tiny corpus."""

from __future__ import annotations

from pathlib import Path

from litgpt.data.tiny import TINY_DIR


def write_story_files(folder: Path, count: int) -> Path:
    """The first `count` stories of the tiny corpus's training split, one text file each (`--data TextFiles`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, story in enumerate((TINY_DIR / "train.txt").read_text().split("\n\n")[:count]):
        (folder / f"{i:03d}.txt").write_text(story)
    return folder

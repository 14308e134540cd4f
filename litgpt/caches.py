"""Where litgpt keeps what it can compute again but need not: `$LITGPT_CACHE_DIR`, or `~/.cache/litgpt`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The root of litgpt's caches (token caches under `tokens/`, the measured matmul peaks in `matmul-peaks.json`)."""
    base = os.environ.get("LITGPT_CACHE_DIR")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "litgpt"

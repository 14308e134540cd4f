"""Progress of long operations (conversion, tokenizing, calibration, evaluation, downloads), shown the same way
everywhere.

On a terminal a tqdm bar on stderr. When stderr is not a terminal (a log file, Slurm, CI) a bar would fill the log
with carriage returns, so a plain line is printed instead every `LINE_EVERY_PERCENT` percent of the work, with the
count, the elapsed time and the time left; without a known total, a line every `LINE_EVERY_SECONDS` seconds.
Only the run's first process (rank 0) shows anything: every rank runs the same command.
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, Optional, TextIO, TypeVar

from tqdm import tqdm

from litgpt.distributed.runtime import global_rank

LINE_EVERY_PERCENT = 10
LINE_EVERY_SECONDS = 30.0

T = TypeVar("T")


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def terminal_bar(total: Optional[int], description: str = "", unit: str = "it", initial: int = 0,
                 file: Optional[TextIO] = None) -> tqdm:
    """A tqdm bar on rank 0 when `file` (default stderr) is a terminal; else a disabled one (its calls do nothing).

    For loops that print their own log lines (training); others use `Progress`, which also writes to log files.
    """
    file = file if file is not None else sys.stderr
    show = global_rank() == 0 and _is_terminal(file)
    return tqdm(total=total, initial=initial, desc=description or None, unit=unit, disable=not show, file=file,
                dynamic_ncols=True, mininterval=1.0)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:d}:{rest % 60:02d}"


class Progress:
    """Progress of `total` units of work (None: unknown), advanced with `update(n)`; use it as a context manager.

    Args:
        total: How many units the work has, or None when that is not known in advance.
        description: What is being done, e.g. "Converting weights"; starts every log line.
        unit: The unit of `total`, e.g. "tensor" or "batch".
        enabled: False shows nothing (as lm-eval's `disable_tqdm`).
        initial: Units done before this start (a resumed download); the time left is estimated from the rest.
        file: Where to write (default: stderr, looked up when the progress starts).
    """

    def __init__(self, total: Optional[int], description: str, unit: str = "it", enabled: bool = True,
                 initial: int = 0, file: Optional[TextIO] = None) -> None:
        self.total = total if total else None
        self.description = description
        self.unit = unit
        self.count = self._initial = initial
        self.file = file if file is not None else sys.stderr
        shown = enabled and global_rank() == 0
        on_terminal = shown and _is_terminal(self.file)
        self._bar = terminal_bar(self.total, description, unit, initial, self.file) if on_terminal else None
        self._lines = shown and not on_terminal
        self._start = self._last_line_time = time.monotonic()
        self._last_percent = self._percent()

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._lines:
            self._maybe_write_line()

    def _maybe_write_line(self) -> None:
        now = time.monotonic()
        if self.total is None:
            if now - self._last_line_time >= LINE_EVERY_SECONDS:
                self._last_line_time = now
                rate = (self.count - self._initial) / max(now - self._start, 1e-9)
                elapsed = _duration(now - self._start)
                self._write(f"{self.count} {self.unit} ({rate:.1f} {self.unit}/s), elapsed {elapsed}")
            return
        percent = self._percent()
        if percent <= self._last_percent:
            return
        self._last_percent = percent
        elapsed = now - self._start
        rate = (self.count - self._initial) / max(elapsed, 1e-9)
        eta = "" if percent >= 100 or rate <= 0 else f", ETA {_duration((self.total - self.count) / rate)}"
        self._write(f"{percent}% ({self.count}/{self.total} {self.unit}), elapsed {_duration(elapsed)}{eta}")

    def _percent(self) -> int:
        """The share done, rounded down to a multiple of LINE_EVERY_PERCENT (0 without a total)."""
        if self.total is None:
            return 0
        return min(100, self.count * 100 // self.total) // LINE_EVERY_PERCENT * LINE_EVERY_PERCENT

    def _write(self, text: str) -> None:
        print(f"{self.description}: {text}", file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._lines and self.total is None and self.count:
            self._write(f"{self.count} {self.unit} in {_duration(time.monotonic() - self._start)}")
        self._lines = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(items: Iterable[T], description: str, total: Optional[int] = None, unit: str = "it",
             enabled: bool = True) -> Iterator[T]:
    """`items`, one at a time, with their progress shown (`total`: default len(items) when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(total, description, unit, enabled) as shown:
        for item in items:
            yield item
            shown.update(1)

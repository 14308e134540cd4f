"""A port for a test's distributed run to listen on (MASTER_PORT)."""

from __future__ import annotations

import os
import random
import socket

BAND = 1000  # ports per pytest-xdist worker
FIRST = 20000  # below the kernel's ephemeral range (32768-60999 on Linux)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 when picked, for a rank 0 to bind a moment later. Not one the kernel picks
    (`bind(0)`): those come from its ephemeral range, which also gives outgoing connections their local ports, and two
    pytest-xdist workers running distributed tests at once could be handed the same one. Each worker draws from a
    band of its own below that range, from a random point."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = FIRST + BAND * (int(worker) % 12 if worker.isdigit() else 0)
    start = random.randrange(BAND)
    for offset in range(BAND):
        port = low + (start + offset) % BAND
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or still in TIME_WAIT
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + BAND - 1}")

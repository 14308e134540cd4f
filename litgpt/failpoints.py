"""Named points where a test makes this process fail on purpose, to prove that no failure there loses a run.

`LITGPT_FAILPOINT=NAME[@HIT][/RANK][=ACTION]` acts the HIT-th time (default 1st) the process passes the point NAME,
on rank RANK only (default every rank). ACTION is `kill` (SIGKILL: the process vanishes mid-write, as when a node dies;
the default), `raise` (a RuntimeError: a crash of this rank alone), `hang` (sleep: a rank that stops answering), or a
signal's name such as `SIGUSR1` (sent to this process, as a scheduler would, at an exact moment).

A failpoint acts only when `LITGPT_FAILPOINTS_ARMED=1` is set too, as litgpt's tests set it: a `LITGPT_FAILPOINT`
left in a user's environment (or inherited from a test shell) never kills a real run. Unarmed, a failpoint is one
cached call. The variables are read when a process first passes a failpoint, not at import, so that a process forked
from one that imported litgpt (tests/litgpt_forkserver.py) reads its own.
"""

from __future__ import annotations

import functools
import os
import signal
import time

_hits: dict[str, int] = {}


def _parse(spec: str) -> tuple[str, int, "int | None", str]:
    spec, _, action = spec.partition("=")
    spec, _, rank = spec.partition("/")
    name, _, hit = spec.partition("@")
    return name, int(hit or 1), int(rank) if rank else None, action or "kill"


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    from litgpt.distributed.runtime import launcher_rank

    return launcher_rank()


@functools.cache
def _armed_spec() -> str:
    return os.environ.get("LITGPT_FAILPOINT", "") if os.environ.get("LITGPT_FAILPOINTS_ARMED") == "1" else ""


def failpoint(name: str) -> None:
    spec = _armed_spec()
    if not spec:
        return
    target, hit, rank, action = _parse(spec)
    if name != target or (rank is not None and rank != _rank()):
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != hit:
        return
    if action == "raise":
        raise RuntimeError(f"failpoint {name} (hit {hit}) raised on purpose")
    if action == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), getattr(signal, action) if action.startswith("SIG") else signal.SIGKILL)

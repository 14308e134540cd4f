"""Who this process is in the run, and how the ranks talk: ranks, printing once, barriers, node-local disks.

Every process of a run executes the same command. The launcher (Fabric, torchrun or srun) tells each one its place
through environment variables before any process group exists; once one does, torch.distributed is the authority.
Nothing here imports torch at module level, so the CLI can use it before deciding to load anything heavy.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator, Optional, TextIO

# Where each launcher puts the global rank, the rank within the node and the node's index.
GLOBAL_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "LOCAL_RANK")  # LOCAL_RANK alone: Fabric's children of one node
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")
NODE_RANK_VARIABLES = ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID")


def _first_int(names: tuple[str, ...], environ=None) -> Optional[int]:
    environ = os.environ if environ is None else environ
    for name in names:
        if environ.get(name):
            return int(environ[name])
    return None


def _process_group():
    """torch.distributed if a process group is up (without importing torch when nothing has)."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed
    return None


def distributed_is_up() -> bool:
    return _process_group() is not None


def launcher_rank(environ=None) -> int:
    """This process's global rank as the launcher set it, readable before any process group exists."""
    rank = _first_int(GLOBAL_RANK_VARIABLES, environ)
    return 0 if rank is None else rank


def global_rank() -> int:
    distributed = _process_group()
    return distributed.get_rank() if distributed is not None else launcher_rank()


def world_size() -> int:
    distributed = _process_group()
    if distributed is not None:
        return distributed.get_world_size()
    return _first_int(("WORLD_SIZE", "SLURM_NTASKS")) or 1


def local_rank() -> int:
    """This process's rank among the processes of its node."""
    rank = _first_int(LOCAL_RANK_VARIABLES)
    return global_rank() if rank is None else rank


def node_rank() -> int:
    """The index of this process's node (0 on one machine)."""
    node = _first_int(NODE_RANK_VARIABLES)
    return 0 if node is None else node


def is_rank_zero() -> bool:
    return global_rank() == 0


def print_once(text: str, file: Optional[TextIO] = None) -> None:
    """Print from the first process of the run only (every process executes the same command)."""
    if global_rank() == 0:
        print(text, file=file or sys.stdout, flush=True)


def print_error_once(text: str) -> None:
    """Print an error; in a run of several processes, once per machine however many ranks hit it, with the rank.

    The first rank to fail claims the message with an exclusive file; a claim older than a minute is from another run.
    """
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or "1")
    if world > 1:
        rank = launcher_rank()
        run_id = os.environ.get("MASTER_PORT", "") + os.environ.get("SLURM_JOB_ID", "")
        digest = hashlib.sha1(f"{run_id}{text}".encode()).hexdigest()[:16]
        claim = os.path.join(tempfile.gettempdir(), f"litgpt-error-{digest}")
        try:
            if time.time() - os.path.getmtime(claim) > 60:
                os.unlink(claim)
        except OSError:
            pass
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another rank of this run printed it
        text = f"[rank {rank}] {text}"
    print(text, file=sys.stderr)


def print_once_per_node(text: str, file: Optional[TextIO] = None) -> None:
    """Print from the first process of each machine (e.g. about its node-local disk)."""
    if local_rank() == 0:
        print(f"[node {node_rank()}] {text}" if world_size() > local_world_size() else text,
              file=file or sys.stdout, flush=True)


def local_world_size() -> int:
    size = _first_int(("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"))
    return world_size() if size is None else size


def every_rank(value: object) -> list:
    """Every rank's `value`, on every rank (collective); [value] in one process."""
    distributed = _process_group()
    if distributed is None:
        return [value]
    values = [None] * distributed.get_world_size()
    distributed.all_gather_object(values, value)
    return values


_BARRIER_GROUPS: dict = {}


def barrier(timeout_seconds: float, name: str = "barrier") -> None:
    """Wait until every rank arrives, for at most `timeout_seconds`; then fail naming the ranks that did not come.

    Runs on a gloo group of its own (on the CPU: no GPU stream is involved), created once per timeout.
    """
    distributed = _process_group()
    if distributed is None:
        return
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if timeout not in _BARRIER_GROUPS:
        _BARRIER_GROUPS[timeout] = distributed.new_group(backend="gloo", timeout=timeout)
    try:
        distributed.monitored_barrier(group=_BARRIER_GROUPS[timeout], timeout=timeout)
    except RuntimeError as error:
        from litgpt.errors import UserError

        reason = " ".join(str(error).split())[:300]
        raise UserError(f"Not every rank reached the {name} within {timeout_seconds:g} s: {reason}") from None


@contextmanager
def node_local_first(timeout_seconds: float = 1800.0) -> Iterator[None]:
    """Run the block on global rank 0 first, then on the first process of every other node, then everywhere else.

    For work on disks that may be node-local (a data cache, a tokenizer copy): global rank 0 does it once where
    the others may see it (a shared disk); each node's first process then finds it or does it on its own disk; the
    remaining processes of every node find it done. Collective: every rank must enter.
    """
    first_of_node = local_rank() == 0
    if global_rank() == 0:
        yield
        barrier(timeout_seconds, "global rank 0's turn")
        barrier(timeout_seconds, "the nodes' first processes' turn")
    elif first_of_node:
        barrier(timeout_seconds, "global rank 0's turn")
        yield
        barrier(timeout_seconds, "the nodes' first processes' turn")
    else:
        barrier(timeout_seconds, "global rank 0's turn")
        barrier(timeout_seconds, "the nodes' first processes' turn")
        yield

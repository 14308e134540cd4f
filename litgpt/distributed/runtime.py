"""Who this process is in the run, and how the ranks talk: ranks, printing once, waiting on one rank's work, node-local
disks.

Every process of a run executes the same command. The launcher (Fabric, torchrun or srun) tells each one its place
through environment variables before any process group exists; once one does, torch.distributed is the authority.
Nothing here imports torch at module level, so the CLI can use it before deciding to load anything heavy.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
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


_GATHER_GROUPS: dict = {}


def every_rank(value: object, timeout_seconds: Optional[float] = None) -> list:
    """Every rank's `value`, on every rank (collective); [value] in one process.

    `timeout_seconds`: how long a rank may wait for the others here, when it is not the run's collective timeout (each
    rank worked on its share of something large first); the gather then runs on a gloo group of that timeout.
    """
    distributed = _process_group()
    if distributed is None:
        return [value]
    group = None
    if timeout_seconds is not None:
        import datetime

        timeout = datetime.timedelta(seconds=timeout_seconds)
        if timeout not in _GATHER_GROUPS:
            _GATHER_GROUPS[timeout] = distributed.new_group(backend="gloo", timeout=timeout)
        group = _GATHER_GROUPS[timeout]
    values = [None] * distributed.get_world_size()
    distributed.all_gather_object(values, value, group=group)
    return values


# Work one rank does while others wait (writing a checkpoint, tokenizing) can outlast any collective timeout: the
# waiters poll the run's key-value store for the worker's result instead, and judge it alive by a heartbeat it adds
# to the store every HEARTBEAT_SECONDS from a thread of its own. Silent for SILENCE_SECONDS, it died or froze.
HEARTBEAT_SECONDS = 5.0
SILENCE_SECONDS = 180.0
# Waiters poll every 50 ms at first, then less and less often, up to every 2 s: a thousand ranks waiting through a
# long save do not flood the store.
_FIRST_POLL_SECONDS, _LAST_POLL_SECONDS = 0.05, 2.0
_turns = [0]


def _store():
    """The key-value store of the run's process group (hosted by rank 0's process), or None in one process."""
    distributed = _process_group()
    return distributed.distributed_c10d._get_default_store() if distributed is not None else None


def next_turn(name: str) -> str:
    """A store key prefix unique to this call of `name`: every rank calls the same collectives in the same order."""
    _turns[0] += 1
    return f"litgpt/{name}/{_turns[0]}"


@contextmanager
def working(store, key: str) -> Iterator[None]:
    """Run the block as the worker that others `wait_for`: beat while it runs, then publish its outcome."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS):
            try:
                store.add(f"{key}/beat", 1)
            except RuntimeError:  # torch's DistError: the store went away, the run is ending (the waiters learn it)
                return

    thread = threading.Thread(target=beat, name="litgpt-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:  # tell the waiters this rank failed, then re-raise
        stop.set()
        try:
            store.set(f"{key}/done", "failed")
        except RuntimeError:  # torch's DistError: the store is gone too; the error that matters is the one raised
            pass
        raise
    stop.set()
    store.set(f"{key}/done", "ok")


def wait_for(store, key: str, who: str, what: str, silence_seconds: float = SILENCE_SECONDS) -> None:
    """Wait, for as long as it takes, until the worker `working` under `key` is done; fail with one line when it
    failed, or gave no heartbeat for `silence_seconds` (killed, its node down, or frozen)."""
    from torch.distributed import DistNetworkError, DistStoreError

    from litgpt.errors import UserError

    beats, last_sign, pause = -1, time.monotonic(), _FIRST_POLL_SECONDS
    try:
        while not store.check([f"{key}/done"]):
            try:
                current = store.add(f"{key}/beat", 0)
            except DistStoreError:  # the store answered late (its host is busy or paused): no sign of life this time
                current = beats
            if current != beats:
                beats, last_sign = current, time.monotonic()
            elif time.monotonic() - last_sign > silence_seconds:
                raise UserError(f"{who} gave no sign of life for {silence_seconds:g} s while {what}: it died or froze "
                                "(see its node's log); the run stops.")
            time.sleep(pause)
            pause = min(pause * 1.5, _LAST_POLL_SECONDS)
        outcome = store.get(f"{key}/done").decode()
    except DistNetworkError:  # the store's host, rank 0's process, is gone
        raise UserError(f"Rank 0's process, which holds the run's store, is gone (the connection to it closed) while "
                        f"{who} was {what}; see its node's log.") from None
    if outcome != "ok":
        raise UserError(f"{who} failed while {what} (its error is printed above); the run stops.")


@contextmanager
def rank_zero_alone(what: str) -> Iterator[bool]:
    """Rank 0 runs the block's work (the block gets True) while the others wait, however long it takes, as long as
    rank 0 shows signs of life; the others get False and must skip the work. Collective: every rank must enter.

        with rank_zero_alone("writing step-000100") as worker:
            if worker: write()
    """
    store = _store()
    if store is None:
        yield True
        return
    key = next_turn("rank-zero-alone")
    if global_rank() == 0:
        with working(store, key):
            yield True
    else:
        yield False
        wait_for(store, key, "rank 0", what)


@contextmanager
def node_local_first(what: str = "preparing the data", silence_seconds: float = SILENCE_SECONDS) -> Iterator[None]:
    """Run the block on global rank 0 first, then on the first process of every other node, then everywhere else.

    For work on disks that may be node-local (a data cache, a tokenizer copy): global rank 0 does it once where
    the others may see it (a shared disk); each node's first process then finds it or does it on its own disk; the
    remaining processes of every node find it done. Each waits as long as the process it waits for works and beats
    (not bounded by the collective timeout: tokenizing a corpus takes what it takes). Collective: every rank enters.
    """
    store = _store()
    if store is None:
        yield
        return
    turn = next_turn("node-local-first")
    node_key = f"{turn}/node-{node_rank()}"
    if global_rank() == 0:
        with working(store, f"{turn}/first"), working(store, node_key):
            yield
    elif local_rank() == 0:
        wait_for(store, f"{turn}/first", "global rank 0", what, silence_seconds)
        with working(store, node_key):
            yield
    else:
        wait_for(store, node_key, f"the first process of node {node_rank()}", what, silence_seconds)
        yield

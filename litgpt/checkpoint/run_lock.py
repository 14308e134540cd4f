"""One run per out_dir, and the same out_dir on every node.

Rank 0 holds out_dir/.litgpt-run.lock for the whole run: JSON with its host, pid, start time and a random token. A
second run on the folder finds the lock and is refused, naming the holder; a lock whose holder is gone (its pid no
longer lives on this host) is taken over with a note. The first process of every node then reads the token through its
own --out_dir: a node that does not find it writes into another folder (a node-local disk), whose checkpoints rank 0
would never publish, and the run stops before any training.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from litgpt.checkpoint.store import restore_retired
from litgpt.distributed.runtime import every_rank, global_rank, local_rank, node_rank, print_once
from litgpt.errors import UserError

LOCK_FILE = ".litgpt-run.lock"
# How long a node's first process looks for the lock rank 0 wrote before it concludes its out_dir is another folder.
SAME_FOLDER_WAIT_SECONDS = 15.0


def _holder_is_gone(holder: dict) -> bool:
    """Whether the process named by a lock surely no longer runs (only knowable on its own host)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    if holder["pid"] == os.getpid():
        return True  # a lock left by an earlier process that had our pid (a container's pid 1, say)
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, under another user
    return False


def _read_holder(lock: Path) -> dict:
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def acquire(out_dir: Path) -> dict:
    """Create the lock (creating out_dir if needed) and return what it holds; refuse while another run holds it."""
    out_dir, lock = Path(out_dir), Path(out_dir) / LOCK_FILE
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "created_out_dir": not out_dir.exists()}
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, draft = tempfile.mkstemp(prefix=f"{LOCK_FILE}.", suffix=".tmp", dir=out_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        for _ in range(2):
            try:
                os.link(draft, lock)  # appears complete or not at all, and never over another run's lock
                for retired in out_dir.glob(".*.old"):  # a publish killed mid-way on a filesystem without exchange
                    restore_retired(out_dir / retired.name[1:-len(".old")])
                return mine
            except FileExistsError:
                holder = _read_holder(lock)
                if not _holder_is_gone(holder):
                    raise UserError(
                        f"--out_dir {str(out_dir)!r} is in use by another run (host {holder.get('host', '?')}, pid "
                        f"{holder.get('pid', '?')}, since {holder.get('started', '?')}): wait for it to end or choose "
                        f"another --out_dir. If that run is gone, delete {str(lock)!r}.")
                print_once(f"Taking over {lock}: the run that held it (pid {holder['pid']} on this host) is gone.")
                try:  # renamed rather than deleted: of two runs taking over at once, one renames and one finds none
                    os.replace(lock, f"{draft}.stale")
                    os.unlink(f"{draft}.stale")
                except FileNotFoundError:
                    pass
        raise UserError(f"Another run took {str(lock)!r} while this one took over its stale lock: choose another "
                        "--out_dir or try again.")
    finally:
        os.unlink(draft)


def release(out_dir: Path, mine: dict) -> None:
    """Remove our lock (not one another run took over), and out_dir itself if we created it and it stayed empty."""
    out_dir, lock = Path(out_dir), Path(out_dir) / LOCK_FILE
    if _read_holder(lock).get("token") == mine["token"]:
        lock.unlink(missing_ok=True)
    if mine["created_out_dir"]:
        try:
            out_dir.rmdir()
        except OSError:
            pass  # not empty: the run wrote something


def _find_token(out_dir: Path, token: str) -> Optional[str]:
    """The lock's token as this node sees it; on a network filesystem a file just created on another node can take a
    few seconds to appear (cached directory lookups), so look again for a while before concluding it is not there."""
    deadline = time.monotonic() + SAME_FOLDER_WAIT_SECONDS
    while True:
        try:
            os.listdir(out_dir)  # reading the folder revalidates a network filesystem's cached lookups
        except OSError:
            pass
        seen = _read_holder(out_dir / LOCK_FILE).get("token")
        if seen == token or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def check_same_folder(out_dir: Path, token: str) -> None:
    """Every node's first process reads the lock's token through its own out_dir; refuse the run (on every rank)
    when one does not find it: that node's out_dir is another folder. Collective."""
    seen = _find_token(Path(out_dir), token) if local_rank() == 0 else token
    verdicts = every_rank((node_rank(), socket.gethostname(), seen == token))
    blind = sorted({f"node {node} ({host})" for node, host, ok in verdicts if not ok})
    if blind:
        raise UserError(
            f"--out_dir {str(out_dir)!r} is not the same folder on every node: {', '.join(blind)} cannot see the "
            f"{LOCK_FILE} that rank 0 wrote there. Put --out_dir on a filesystem every node shares (a node-local "
            "disk would hold checkpoints that are never published).")


@contextmanager
def out_dir_claimed(out_dir: Path) -> Iterator[None]:
    """Hold out_dir for this run (rank 0 locks it) and check that every node writes into that same folder; every
    rank refuses alike when either fails. Collective."""
    mine: Optional[dict] = None
    refusal = None
    if global_rank() == 0:
        try:
            mine = acquire(out_dir)
        except UserError as error:
            refusal = str(error)
    token, refusal = every_rank((mine["token"] if mine else None, refusal))[0]
    try:
        if refusal is not None:
            raise UserError(refusal)
        check_same_folder(out_dir, token)
        yield
    finally:
        if mine is not None:
            release(out_dir, mine)

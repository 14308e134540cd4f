"""Real clusters: one run per out_dir, the same out_dir on every node, folders published without a gap, token caches on
node-local disks, and work of one rank that outlasts the collective timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from torch.distributed import HashStore

from litgpt.checkpoint.run_lock import LOCK_FILE
from litgpt.checkpoint.store import restore_retired, verify_checkpoint, write_manifest
from litgpt.distributed import runtime
from litgpt.errors import UserError
from test_distributed import torchrun_nodes as two_torchrun_nodes
from test_fault_tolerance import ROOT, child_environment, data, litgpt, pretrain_args  # noqa: F401


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if not line.startswith("Seed set to")]


# ---- one run per out_dir ------------------------------------------------------------------------------------------
def write_lock(out_dir: Path, host: str, pid: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / LOCK_FILE).write_text(json.dumps({"host": host, "pid": pid, "token": "t", "started": "earlier"}))


@pytest.mark.parametrize("host", ["this", pytest.param("another", marks=pytest.mark.slow)])
def test_a_second_run_on_a_held_out_dir_is_refused_and_nothing_changes(data, tmp_path, host):
    """The holder is alive on this host (this test's process), or on another host where its pid cannot be judged."""
    out_dir = tmp_path / "held"
    holder = socket.gethostname() if host == "this" else "node-elsewhere"
    write_lock(out_dir, holder, os.getpid())
    before = snapshot(out_dir)
    p = litgpt(*pretrain_args(data, out_dir, 1))
    assert p.returncode == 1, p.stdout + p.stderr
    assert error_lines(p.stderr) == [
        f"litgpt pretrain: error: --out_dir {str(out_dir)!r} is in use by another run (host {holder}, pid "
        f"{os.getpid()}, since earlier): wait for it to end or choose another --out_dir. If that run is gone, delete "
        f"{str(out_dir / LOCK_FILE)!r}."]
    assert snapshot(out_dir) == before


@pytest.mark.slow
def test_a_lock_whose_holder_is_gone_is_taken_over_and_released(data, tmp_path):
    out_dir = tmp_path / "stale"
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_lock(out_dir, socket.gethostname(), gone.pid)
    p = litgpt(*pretrain_args(data, out_dir, 1))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"Taking over {out_dir / LOCK_FILE}: the run that held it (pid {gone.pid} on this host) is gone." in p.stdout
    assert (out_dir / "final" / "lit_model.pth").is_file()
    assert not (out_dir / LOCK_FILE).exists()  # released at the end


# ---- publishing without a gap ------------------------------------------------------------------------------------
PUBLISH = textwrap.dedent("""
    import sys
    from pathlib import Path
    from litgpt.checkpoint import store
    from litgpt.failpoints import failpoint
    folder = Path(sys.argv[1])
    if sys.argv[2] == "no-exchange":
        store.exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE (NFS): the fallback path
    with store.publish_dir(folder) as staging:
        (staging / "weights").write_bytes(b"new" * 1000)
        store.write_manifest(staging, {"step": 2})
        failpoint("test:written")
""")


@pytest.mark.parametrize("mode, point, expected", [
    ("exchange", "test:written", b"old"),  # the new folder complete, not yet in place
    ("exchange", "publish:exchanged", b"new"),  # swapped in one step; the old one not yet deleted
    ("exchange", None, b"new"),
    ("no-exchange", "publish:retired", b"old"),  # the old one retired, the new not in place: put back
    ("no-exchange", None, b"new"),
])
def test_publish_leaves_a_complete_folder_under_its_name_at_every_kill_point(tmp_path, mode, point, expected):
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "weights").write_bytes(b"old" * 1000)
    write_manifest(folder, {"step": 1})
    env = child_environment(PYTHONPATH=str(ROOT), **({"LITGPT_FAILPOINT": point} if point else {}))
    p = subprocess.run([sys.executable, "-c", PUBLISH, str(folder), mode], env=env, capture_output=True, text=True)
    assert p.returncode == (-signal.SIGKILL if point else 0), p.stderr
    if mode == "exchange":  # no moment without the folder: it is there right after the kill, untouched since
        assert verify_checkpoint(folder) is None
    restore_retired(folder)  # what the next run does first (the lock's holder, before anything else)
    assert verify_checkpoint(folder) is None
    assert (folder / "weights").read_bytes() == expected * 1000
    publish_leftovers = [p.name for p in tmp_path.iterdir() if p.name != "final"]
    assert publish_leftovers in ([], [".final.partial"]), publish_leftovers  # the next publish removes a leftover


# ---- waiting on one rank's work -------------------------------------------------------------------------------------
def test_waiting_on_a_worker_lasts_while_it_beats_and_ends_when_it_falls_silent(monkeypatch):
    """The real store and heartbeat: a worker beating for longer than the silence bound is waited for; a silent one
    is reported after the bound; a failed one at once."""
    monkeypatch.setattr(runtime, "HEARTBEAT_SECONDS", 0.1)
    store = HashStore()

    def work() -> None:
        with runtime.working(store, "slow"):
            time.sleep(2.0)

    worker = threading.Thread(target=work)
    start = time.monotonic()
    worker.start()
    runtime.wait_for(store, "slow", "rank 0", "writing", silence_seconds=0.5)
    assert time.monotonic() - start >= 2.0
    worker.join()

    start = time.monotonic()
    with pytest.raises(UserError, match=r"^rank 0 gave no sign of life for 0.5 s while writing: it died or froze"):
        runtime.wait_for(store, "silent", "rank 0", "writing", silence_seconds=0.5)
    assert 0.5 <= time.monotonic() - start < 5

    with pytest.raises(RuntimeError, match="disk on fire"):
        with runtime.working(store, "failing"):
            raise RuntimeError("disk on fire")
    with pytest.raises(UserError, match=r"^rank 0 failed while writing \(its error is printed above\)"):
        runtime.wait_for(store, "failing", "rank 0", "writing")


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
def test_a_save_of_rank_zero_that_outlasts_the_collective_timeout_does_not_end_the_run(data, tmp_path):
    """Rank 0 stops (SIGSTOP) while writing its full checkpoint, for 10 s longer than --fsdp.timeout; rank 1 waits
    on its store instead of a barrier, and the run completes. (The timeout also bounds the ranks' start-up, which a
    busy CI machine stretched past 12 s: 30 s leaves room.)"""
    out_dir = tmp_path / "slow-save"
    timeout, pause = 30, 40
    command = [sys.executable, "-m", "litgpt", *map(str, pretrain_args(data, out_dir, 2, "--devices", "2",
                                                                          "--fsdp.timeout", timeout))]
    env = child_environment(LITGPT_FAILPOINT="save:weights@1/0=SIGSTOP")
    run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while run.poll() is None and process_state(run.pid) != "T":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert run.poll() is None, run.communicate()
    time.sleep(pause)
    os.kill(run.pid, signal.SIGCONT)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stdout + stderr
    assert (out_dir / "final" / "lit_model.pth").is_file() and verify_checkpoint(out_dir / "step-000002") is None


@pytest.mark.slow
def test_when_rank_zero_dies_during_its_save_the_waiting_rank_says_so_in_one_line(data, tmp_path):
    out_dir = tmp_path / "dead-save"
    start = time.monotonic()
    p = litgpt(*pretrain_args(data, out_dir, 2, "--devices", "2"), failpoint="save:weights@1/0=kill")
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert time.monotonic() - start < 120  # rank 1's stderr is this pipe too: it has left by now
    ours = [line for line in p.stderr.splitlines() if "litgpt pretrain: error" in line]
    assert ours == ["[rank 1] litgpt pretrain: error: Rank 0's process, which holds the run's store, is gone (the "
                    "connection to it closed) while rank 0 was writing checkpoint step-000001; see its node's log."]


# ---- two torchrun "nodes" ----------------------------------------------------------------------------------------
def torchrun_nodes(args_per_node: list[list], env_per_node: list[dict], timeout: int = 600) -> list:
    """`test_distributed.torchrun_nodes` with the flags of a 2 nodes x 2 devices run."""
    args = [[*node_args, "--devices", "2", "--num_nodes", "2"] for node_args in args_per_node]
    return two_torchrun_nodes(args, env_per_node, timeout)


def without_cache_dir(args: list) -> list:
    """The arguments with --data.cache_dir left out: caches go to $LITGPT_CACHE_DIR/tokens."""
    index = args.index("--data.cache_dir")
    return args[:index] + args[index + 2:]


@pytest.mark.slow
def test_token_caches_on_node_local_disks_are_built_once_per_node(data, tmp_path):
    """Each node has its own cache folder (LITGPT_CACHE_DIR): node 1's first process builds its cache while node 1's
    other process waits, and both nodes' caches hold the same tokens."""
    out_dir = tmp_path / "shared-out"
    args = without_cache_dir(pretrain_args(data, out_dir, 2, "--train.micro_batch_size", "1"))
    caches = [tmp_path / "node0-disk", tmp_path / "node1-disk"]
    results = torchrun_nodes([args, args], [{"LITGPT_CACHE_DIR": str(c)} for c in caches])
    for result in results:
        assert result.returncode == 0, result.stderr
    built = [sorted((c / "tokens").glob("textfiles-*")) for c in caches]
    assert [f.name for f in built[0]] == [f.name for f in built[1]] and len(built[0]) == 2  # train and val
    for ours, theirs in zip(*built):
        np.testing.assert_array_equal(np.fromfile(ours / "tokens.bin", np.uint16),
                                      np.fromfile(theirs / "tokens.bin", np.uint16))
    assert (out_dir / "final" / "lit_model.pth").is_file()


@pytest.mark.slow
def test_an_out_dir_that_is_not_the_same_folder_on_every_node_is_refused_before_training(data, tmp_path):
    node_dirs = [tmp_path / "node0-out", tmp_path / "node1-out"]
    results = torchrun_nodes([pretrain_args(data, d, 2, "--train.micro_batch_size", "1") for d in node_dirs],
                             [{}, {}])
    stderr = "".join(r.stderr for r in results)
    assert all(r.returncode != 0 for r in results), stderr
    message = (f"--out_dir {str(node_dirs[0])!r} is not the same folder on every node: node 1 "
               f"({socket.gethostname()}) cannot see the {LOCK_FILE} that rank 0 wrote there.")
    assert message in results[0].stderr, results[0].stderr
    assert f'File "{ROOT / "litgpt"}' not in stderr  # torchrun's agents print a traceback of theirs, none of ours
    assert not node_dirs[0].exists() and not node_dirs[1].exists()  # nothing trained, nothing left behind

"""Errors are reported as what they are, recognized from real exceptions (their types and errno), never from words in
a message; failpoints act only when armed; --optimizer names only optimizer classes."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from litgpt_forkserver import run_litgpt
from ports import free_port

from litgpt.checkpoint.manager import failed_write
from litgpt.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def python(code: str, *args, env: dict | None = None, preexec_fn=None, timeout: int = 120) -> subprocess.Popen:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=ROOT,
                            env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec_fn)


def output(process: subprocess.Popen, timeout: int = 120) -> str:
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr
    return stdout.strip()



# A rank of a gloo group of `world` processes (timeout 3 s) that meets the others once, then, as rank 1: dies
# ("die"), hangs ("hang"); rank 0 then enters a collective, or raises an error of its own mentioning a timeout
# ("own"). It prints what litgpt's CLI would say about the exception it got (None: not a distributed failure).
RANK = """
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from litgpt.__main__ import distributed_failure_message
    mode, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=3))
        dist.barrier()
        if rank == 1:
            if mode == "die":
                os._exit(3)
            time.sleep(10)
            os._exit(0)
        if mode == "own":
            raise RuntimeError("our own code timed out: timeout, Timed out, Connection reset by peer")
        time.sleep(0.5)
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
    except RuntimeError as error:
        print(distributed_failure_message("litgpt x", error))
    os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_dead_or_hung_peer_is_recognized_from_the_collective_that_failed(mode):
    """gloo raises a plain RuntimeError for both (checked here: torch 2.13 gives it no type of its own); the CLI
    knows it from the collective it came out of, and says so in the same words on every rank."""
    port = free_port()
    rank1 = python(RANK, mode, 1, 2, port)
    message = output(python(RANK, mode, 0, 2, port))
    rank1.communicate(timeout=60)
    assert message.startswith("litgpt x: error: another rank died or stopped answering within --fsdp.timeout"), message
    assert "RuntimeError" in message


def test_words_about_timeouts_in_an_error_of_our_own_are_not_a_peer_failure():
    """The old classification took any text with "timeout" or "Connection reset by peer" for a peer failure."""
    assert output(python(RANK, "own", 0, 1, free_port())) == "None"


@pytest.mark.slow
def test_ranks_that_never_meet_are_told_apart_by_the_rendezvous_error():
    """Rank 0 alone waits for the others (DistStoreError); a rank with nobody at MASTER_PORT cannot connect
    (DistNetworkError)."""
    alone = output(python(RANK, "die", 0, 2, free_port()))
    assert alone.startswith("litgpt x: error: not every rank joined the run within --fsdp.timeout"), alone
    lost = output(python(RANK, "die", 1, 2, free_port()))
    assert lost.startswith("litgpt x: error: this rank could not reach rank 0 at MASTER_ADDR/MASTER_PORT"), lost


# ---- disks ---------------------------------------------------------------------------------------------------------
def real_oserror(action) -> OSError:
    try:
        action()
    except OSError as error:
        return error
    raise AssertionError("no OSError")


def write_to_dev_full() -> None:
    with open("/dev/full", "wb") as f:
        f.write(b"x" * 10)


def test_a_failed_write_is_found_with_its_errno_and_a_lost_peer_is_not_one(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    full = real_oserror(write_to_dev_full)
    assert full.errno == errno.ENOSPC and failed_write(full) is full
    wrapped = RuntimeError("a save failed")
    wrapped.__cause__ = full
    assert failed_write(wrapped) is full
    is_a_directory = real_oserror(lambda: open(tmp_path, "wb"))
    assert failed_write(CheckpointException("write", {1: (is_a_directory, None)})) is is_a_directory
    assert failed_write(ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")) is None
    assert failed_write(ValueError("file write failed, PytorchStreamWriter")) is None  # the words are not enough


def limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_save_state_dict_raises_the_errno_that_torch_save_loses(tmp_path):
    """torch.save reports a failed write as a RuntimeError without errno; litgpt's save hands on the OSError."""
    code = """
        import sys, torch
        from litgpt.io import save_state_dict
        try:
            save_state_dict({"w": torch.zeros(1 << 20)}, sys.argv[1])
        except OSError as error:
            print(error.errno)
    """
    assert output(python(code, tmp_path / "w.pth", preexec_fn=limit_file_size(1 << 20))) == str(errno.EFBIG)
    assert list(tmp_path.iterdir()) == []  # no half-written file under any name


def test_a_checkpoint_that_exceeds_the_file_size_limit_is_reported_as_room_to_make(tmp_path):
    """A one-process finetune whose first checkpoint hits `ulimit -f` (EFBIG): the disk-full message."""
    from test_safe_loading import base_checkpoint, finetune_command

    args = [*finetune_command(tmp_path, base_checkpoint(tmp_path)), "--out_dir", tmp_path / "out",
            "--train.max_steps", "1"]
    result = subprocess.run([sys.executable, "-m", "litgpt", *map(str, args)], capture_output=True, text=True,
                            cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=limit_file_size(1 << 19))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert "Could not write checkpoint step-000001" in error and "File too large" in error, error
    assert "are free now" in error and "ulimit -f" in error, error
    assert not (tmp_path / "out" / "step-000001").exists()


# ---- memory --------------------------------------------------------------------------------------------------------
def test_a_checkpoint_too_large_for_the_memory_is_not_called_corrupt(tmp_path):
    """With the address space limited, torch's mmap fails (a RuntimeError without errno): litgpt says memory."""
    torch.save({"w": torch.zeros(32 << 20)}, tmp_path / "big.pth")  # 128 MiB
    code = """
        import os, resource, sys
        from litgpt.errors import UserError
        from litgpt.io import load_state_dict
        import torch
        load_state_dict(sys.argv[1] + "/small.pth")  # everything torch needs for loading is mapped by now
        used = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (used + (32 << 20), resource.RLIM_INFINITY))
        try:
            load_state_dict(sys.argv[1] + "/big.pth")
        except UserError as error:
            print(error)
    """
    torch.save({"w": torch.zeros(4)}, tmp_path / "small.pth")
    message = output(python(code, tmp_path))
    assert message.startswith(f"Not enough memory to load '{tmp_path / 'big.pth'}' (0.13 GiB on disk)"), message


# ---- failpoints and optimizer class paths --------------------------------------------------------------------------
@pytest.mark.parametrize("armed, exit_code", [(False, 0), (True, 1)])
def test_a_failpoint_acts_only_when_armed(armed, exit_code):
    code = "from litgpt.failpoints import failpoint; failpoint('step:backward'); print('passed')"
    env = {"LITGPT_FAILPOINT": "step:backward=raise"}
    env.update({"LITGPT_FAILPOINTS_ARMED": "1"} if armed else {})
    env = {**{k: v for k, v in os.environ.items() if k != "LITGPT_FAILPOINTS_ARMED"}, **env}
    process = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == exit_code, process.stderr
    assert ("failpoint step:backward (hit 1) raised on purpose" in process.stderr) == armed


def test_optimizer_class_paths_resolve_only_to_optimizers(tmp_path, monkeypatch):
    """Optimizer classes of torch and of installed packages are taken; anything else is refused in one line, and a
    module of the standard library or a loose file in the working directory is never imported."""
    from litgpt.train.optimizer import optimizer_class

    assert optimizer_class("AdamW") is torch.optim.AdamW and optimizer_class("torch.optim.SGD") is torch.optim.SGD
    planted, marker = tmp_path / "planted_optim.py", tmp_path / "imported"
    planted.write_text(f"open({str(marker)!r}, 'w').close()\nimport torch\nclass Adam(torch.optim.Adam): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for class_path in ("os.system", "subprocess.Popen", "antigravity.Fly", "planted_optim.Adam", "torch.nn.Linear",
                       "litgpt.errors.UserError", "torch.optim.lr_scheduler.LambdaLR", "torch.optim.Nope"):
        with pytest.raises(UserError, match="is not an optimizer class"):
            optimizer_class(class_path)
    assert not marker.exists() and "antigravity" not in sys.modules and "planted_optim" not in sys.modules


def test_cli_refuses_an_optimizer_that_is_not_one(tmp_path):
    from test_safe_loading import base_checkpoint, finetune_command

    popen = {"class_path": "subprocess.Popen", "init_args": {"args": f"touch {tmp_path}/ran"}}
    args = [*finetune_command(tmp_path, base_checkpoint(tmp_path)), "--out_dir", tmp_path / "out",
            "--optimizer", json.dumps(popen)]
    # forked from a server that imported torch and Lightning once (tests/litgpt_forkserver.py)
    result = run_litgpt(args, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert "'subprocess.Popen' is not an optimizer class" in error, error
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_every_broad_except_says_why():
    """A handler of Exception (or BaseException) hides whatever it does not name: each says on its line why that is
    right there (it re-raises what it does not understand, or every case needs the same advice)."""
    import re

    broad = re.compile(r"^\s*except(\s*:|\s*\(?[^#]*\b(Base)?Exception\b[^#]*:)")
    assert broad.match("    except Exception as error:") and broad.match("  except (OSError, BaseException):")
    assert not broad.match("    except (ValueError, MisconfigurationException) as error:")
    unexplained = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted([*(ROOT / "litgpt").rglob("*.py"), *(ROOT / "extensions").rglob("*.py")])
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if broad.match(line) and "#" not in line
    ]
    assert not unexplained, unexplained

"""Fault tolerance: verified checkpoints, kills at many moments, preemption signals, failing ranks, NaN, full disks.

The processes here fail for real: SIGKILL, signals and exceptions come from `LITGPT_FAILPOINT` (litgpt/failpoints.py)
at exact moments, from this test process, or from Slurm. A killed run resumed with `--resume auto` must end with the
same weights, bit for bit, as a run that was never interrupted (fp32 on CPU, same data order).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from litgpt_forkserver import launched_litgpt, run_litgpt
from ports import free_port

from litgpt.checkpoint.store import (
    check_free_space,
    check_writable,
    MANIFEST_FILE,
    prune_checkpoints,
    resolve_resume,
    verify_checkpoint,
    write_manifest,
)
from litgpt.io import load_state_dict
from litgpt.config import Config
from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR
from litgpt.errors import UserError
from litgpt.preemption import StopSignals
from test_slurm import slurm_env

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(
    name="ft-llama", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=2, n_embd=64, n_head=4,
    n_query_groups=2, intermediate_size=128, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", bias=False,
)
TRAIN = [
    "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "64",
    "--train.lr_warmup_steps", "1", "--train.log_interval", "1", "--eval.interval", "1000", "--eval.max_iters", "1",
    "--eval.final_validation", "false", "--optimizer.class_path", "torch.optim.AdamW",
    "--optimizer.init_args.lr", "0.003", "--logger_name", "csv",
]


# ---- manifests, resume choice, pruning (no processes) -------------------------------------------------------------------
def fake_checkpoint(folder: Path, step: int, payload: bytes = b"weights") -> Path:
    folder.mkdir(parents=True)
    (folder / "lit_model.pth").write_bytes(payload * 100)
    (folder / "training_state.pth").write_bytes(b"state")
    write_manifest(folder, {"step": step})
    return folder


def test_manifest_records_sizes_and_checksums_and_detects_damage(tmp_path):
    folder = fake_checkpoint(tmp_path / "step-000001", 1)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["step"] == 1
    assert manifest["files"]["lit_model.pth"]["bytes"] == 700
    import hashlib

    assert manifest["files"]["lit_model.pth"]["sha256"] == hashlib.sha256(b"weights" * 100).hexdigest()
    assert verify_checkpoint(folder) is None

    data = bytearray((folder / "lit_model.pth").read_bytes())
    data[10] ^= 0xFF  # same size, one flipped byte: only the checksum sees it
    (folder / "lit_model.pth").write_bytes(bytes(data))
    assert verify_checkpoint(folder, checksums=False) is None
    assert "SHA-256" in verify_checkpoint(folder)
    os.truncate(folder / "lit_model.pth", 3)
    assert verify_checkpoint(folder, checksums=False) == "lit_model.pth has 3 bytes, the manifest says 700"
    (folder / "lit_model.pth").unlink()
    assert verify_checkpoint(folder) == "lit_model.pth is missing"
    (folder / MANIFEST_FILE).write_text("{not json")
    assert "unreadable" in verify_checkpoint(folder)
    (folder / MANIFEST_FILE).unlink()
    assert "no manifest.json" in verify_checkpoint(folder)


def test_resume_auto_takes_the_newest_complete_checkpoint_and_says_why(tmp_path, capsys):
    fake_checkpoint(tmp_path / "step-000001", 1)
    fake_checkpoint(tmp_path / "step-000002", 2)
    damaged = fake_checkpoint(tmp_path / "step-000003", 3)
    os.truncate(damaged / "lit_model.pth", 10)
    unfinished = tmp_path / "step-000004"
    unfinished.mkdir()
    (unfinished / "training_state.pth").write_bytes(b"half")
    (tmp_path / ".step-000005.partial").mkdir()

    assert resolve_resume(tmp_path, "auto") == tmp_path / "step-000002"
    out = capsys.readouterr().out
    assert "Ignoring .step-000005.partial: a checkpoint save that was interrupted." in out
    assert f"Skipping {unfinished}: it has no manifest.json (its save never finished)." in out
    assert f"Skipping {damaged}: lit_model.pth has 10 bytes, the manifest says 700." in out
    assert f"Resuming from {tmp_path / 'step-000002'} (step 2; manifest verified)." in out


def test_resume_refuses_when_no_checkpoint_is_complete_or_the_named_one_is_damaged(tmp_path):
    damaged = fake_checkpoint(tmp_path / "step-000001", 1)
    (damaged / "lit_model.pth").write_bytes(b"x" * 700)  # same size, other bytes
    with pytest.raises(UserError, match="None of the 1 checkpoints .* does not match its SHA-256"):
        resolve_resume(tmp_path, "auto")
    with pytest.raises(UserError, match="is not a complete checkpoint: lit_model.pth does not match its SHA-256"):
        resolve_resume(tmp_path / "elsewhere", damaged)
    assert resolve_resume(tmp_path / "empty", "auto") is None


def test_keep_last_prunes_older_complete_checkpoints_only(tmp_path):
    for step in range(1, 5):
        fake_checkpoint(tmp_path / f"step-{step:06d}", step)
    incomplete = tmp_path / "step-000002"
    (incomplete / MANIFEST_FILE).unlink()
    deleted = prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in deleted] == ["step-000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003", "step-000004"]
    prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000004"]


def test_unwritable_out_dir_and_too_little_space_are_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        check_writable(blocker / "run")
    check_writable(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()  # checking creates nothing
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(UserError, match=r"it needs about .* GiB, .* are free"):
        check_free_space(tmp_path, 2 * free, "one checkpoint")
    check_free_space(tmp_path, 1024, "one checkpoint")


def test_stop_signals_are_recorded_instead_of_ending_the_process():
    previous = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert signals.received == signal.SIGUSR1  # the first one received names the stop
    assert signal.getsignal(signal.SIGUSR1) == previous


# ---- runs of the real CLI --------------------------------------------------------------------------------------------------
def child_environment(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k == "LITGPT_CPUINFO" or not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_", "LITGPT_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    if "LITGPT_FAILPOINT" in extra:
        env["LITGPT_FAILPOINTS_ARMED"] = "1"  # failpoints act only when armed too (litgpt/failpoints.py)
    return env


def litgpt(*args, failpoint: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m litgpt ARGS` with `failpoint` armed, forked from a server that imported torch and Lightning once
    (tests/litgpt_forkserver.py; the failpoint's variables are read at run time)."""
    environment = child_environment(**({"LITGPT_FAILPOINT": failpoint} if failpoint else {}))
    return run_litgpt(args, cwd=ROOT, env=environment, timeout=timeout)


def processes_using(marker: str) -> list[int]:
    """Processes whose command line mentions `marker` (a run's unique out_dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def wait_until_gone(marker: str, seconds: float = 60) -> float:
    """Seconds until no process of the run is left (ranks started by a killed rank 0 leave on their own)."""
    start = time.monotonic()
    while processes_using(marker):
        assert time.monotonic() - start < seconds, f"processes of {marker} still running: {processes_using(marker)}"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fault")
    Config(**SMALL).save(root / "model.yaml")
    texts = root / "texts"
    texts.mkdir()
    for i, story in enumerate((TINY_DIR / "train.txt").read_text().split("\n\n")[:80]):
        (texts / f"{i:03d}.txt").write_text(story)
    return {"root": root, "config": root / "model.yaml", "texts": texts}


def pretrain_args(data: dict, out_dir: Path, steps: int, *extra) -> list:
    return [
        "pretrain", "--model_config", data["config"], "--out_dir", out_dir, "--data", "TextFiles",
        "--data.train_data_path", data["texts"], "--data.cache_dir", data["root"] / "cache", "--tokenizer_dir",
        TOKENIZER_DIR, *TRAIN,
        "--train.max_steps", steps, "--train.save_interval", "1", "--seed", "3", *extra,
    ]


def final_weights(out_dir: Path) -> dict:
    return {k: v.clone() for k, v in load_state_dict(out_dir / "final" / "lit_model.pth").items()}


def assert_same_weights(run: Path, reference: Path) -> None:
    ours, theirs = final_weights(run), final_weights(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def resumed_from(stdout: str) -> str | None:
    lines = [line for line in stdout.splitlines() if line.startswith("Resuming from ")]
    return lines[0].split()[2] if lines else None


def newest_complete(out_dir: Path) -> str | None:
    """The folder `--resume auto` must take, found without litgpt's code: the newest step folder with a manifest whose
    file sizes hold (the SHA-256 check is exercised by the unit tests above)."""
    complete = [
        folder for folder in sorted(out_dir.glob("step-*")) if (folder / MANIFEST_FILE).is_file() and all(
            (folder / name).is_file() and (folder / name).stat().st_size == entry["bytes"]
            for name, entry in json.loads((folder / MANIFEST_FILE).read_text())["files"].items()
        )
    ]
    return str(complete[-1]) if complete else None


def kill_chain(args: list, out_dir: Path, points: list[str], codes=(-signal.SIGKILL,)) -> int:
    """Run `args --resume auto` once per kill point, killed there, then once to the end; every run must resume from
    the newest complete checkpoint. Returns the number of kills survived."""
    for point in [*points, None]:
        expected = newest_complete(out_dir)
        p = litgpt(*args, "--resume", "auto", failpoint=point)
        if point is None:
            assert p.returncode == 0, p.stdout + p.stderr
        else:
            assert p.returncode in codes, f"{point}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
            assert "Traceback" not in p.stderr, p.stderr
            wait_until_gone(str(out_dir))
        assert resumed_from(p.stdout) == expected, f"{point}: {p.stdout}"
    return len(points)


# Kill points inside training and inside every stage of a save; @N is the N-th time a run passes the point.
SINGLE_PROCESS_KILLS = [
    "step:backward@2",  # mid-step, between backward and the update
    "save:begin@1",  # a save starts: nothing written yet
    "save:weights@1",  # lit_model.pth written in the staging folder
    "save:state@1",  # training_state.pth written too
    "save:manifest@1",  # everything written, not yet renamed into place
    "save:published@1",  # renamed into place, old checkpoints not yet pruned
    "save:pruned@1",  # pruned
    "step:end@2",  # after an update that no checkpoint holds yet
    "final:written@1",  # final/ written, not yet renamed
]


def finished_run(data: dict, name: str, steps: int, *extra) -> Path:
    out_dir = data["root"] / name
    p = litgpt(*pretrain_args(data, out_dir, steps, *extra))
    assert p.returncode == 0, p.stdout + p.stderr
    return out_dir


@pytest.fixture(scope="module")
def uninterrupted(data) -> Path:
    return finished_run(data, "uninterrupted", 6, "--train.keep_last", "2")


@pytest.mark.slow
def test_killed_anywhere_a_single_process_run_resumes_to_the_same_weights(data, uninterrupted, tmp_path):
    out_dir = tmp_path / "killed"
    args = pretrain_args(data, out_dir, 6, "--train.keep_last", "2")
    kills = kill_chain(args, out_dir, SINGLE_PROCESS_KILLS)
    # An external kill at a moment no failpoint names: the instant a staging folder appears.
    p = subprocess.Popen([sys.executable, "-m", "litgpt", *map(str, pretrain_args(data, tmp_path / "watched", 6)),
                          "--resume", "auto"], cwd=ROOT, env=child_environment(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    while p.poll() is None and not list((tmp_path / "watched").glob(".step-*.partial")):
        time.sleep(0.001)
    p.kill()
    p.wait()
    assert p.returncode == -signal.SIGKILL
    kill_chain(pretrain_args(data, tmp_path / "watched", 6), tmp_path / "watched", [])
    kills += 1
    print(f"single process: {kills} kills survived")
    assert_same_weights(out_dir, uninterrupted)
    assert sorted(p.name for p in out_dir.glob("step-*")) == ["step-000005", "step-000006"]  # --train.keep_last 2
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["tokens"] == json.loads((uninterrupted / "metrics.json").read_text())["tokens"]


# Two processes (FULL_SHARD); /R is the rank the failpoint acts on. Killing rank 0 (Fabric's launching process) or rank
# 1 ends the run: exit -9 for the killed rank 0, 1 when rank 0 sees its peer vanish.
SHARDED_KILLS = ["step:backward@2/1", "save:sharded@1/1", "save:sharded@1/0", "save:manifest@1/0"]
FULL_KILLS = ["save:weights@1/0", "step:end@1/1"]


@pytest.fixture(scope="module")
def uninterrupted_two(data) -> Path:
    return finished_run(data, "uninterrupted-two", 4, "--devices", "2")


@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type, points", [("sharded", SHARDED_KILLS), ("full", FULL_KILLS)])
def test_killed_ranks_of_a_sharded_run_resume_to_the_same_weights(state_dict_type, points, data, uninterrupted_two,
                                                                  tmp_path):
    out_dir = tmp_path / state_dict_type
    args = pretrain_args(data, out_dir, 4, "--devices", "2", "--fsdp.state_dict_type", state_dict_type)
    kills = kill_chain(args, out_dir, points, codes=(-signal.SIGKILL, 1))
    print(f"two processes, {state_dict_type}: {kills} kills survived")
    assert_same_weights(out_dir, uninterrupted_two)


# ---- preemption -------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigusr1_saves_the_step_and_the_resumed_run_ends_as_if_never_stopped(data, uninterrupted, tmp_path):
    out_dir = tmp_path / "preempted"
    args = pretrain_args(data, out_dir, 6, "--train.keep_last", "2", "--train.save_interval", "100")
    p = litgpt(*args, failpoint="step:backward@3=SIGUSR1")  # the signal arrives during step 3
    assert p.returncode == 0, p.stderr
    assert f"Stopped by SIGUSR1 after step 3: saved {out_dir / 'step-000003'}; continue it with the same command " \
           "and --resume auto." in p.stdout
    assert sorted(d.name for d in out_dir.iterdir() if d.name.startswith("step")) == ["step-000003"]
    assert verify_checkpoint(out_dir / "step-000003") is None and not (out_dir / "final").exists()
    p = litgpt(*args, "--resume", "auto")
    assert p.returncode == 0, p.stderr
    assert_same_weights(out_dir, uninterrupted)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(data, uninterrupted_two, tmp_path):
    out_dir = tmp_path / "preempted"
    args = pretrain_args(data, out_dir, 4, "--devices", "2", "--train.save_interval", "100")
    p = litgpt(*args, failpoint="step:backward@2/0=SIGTERM")  # rank 0 only: rank 1 learns of it in the step's end
    assert p.returncode == 0, p.stderr
    assert "Stopped by SIGTERM after step 2" in p.stdout
    assert json.loads((out_dir / "step-000002" / MANIFEST_FILE).read_text())["world_size"] == 2
    p = litgpt(*args, "--resume", "auto")
    assert p.returncode == 0, p.stderr
    assert_same_weights(out_dir, uninterrupted_two)


@pytest.mark.slow
def test_sigterm_from_outside_stops_a_run_with_a_checkpoint(data, tmp_path):
    out_dir = tmp_path / "terminated"
    # The shim `litgpt` (forked from a server, `launched_litgpt`) passes the signal on to the command.
    litgpt_command, env = launched_litgpt(child_environment())
    command = [litgpt_command, *map(str, pretrain_args(data, out_dir, 500)), "--train.save_interval", "1000"]
    p = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("step 2/500"):
            p.send_signal(signal.SIGTERM)
            break
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    (stopped,) = [line for line in stdout.splitlines() if line.startswith("Stopped by SIGTERM after step")]
    step = int(stopped.split()[5].rstrip(":"))
    assert 2 <= step < 500
    assert verify_checkpoint(out_dir / f"step-{step:06d}") is None


# ---- a failing rank -----------------------------------------------------------------------------------------------------------
def time_failure(launches: list[subprocess.Popen], marker: str) -> tuple[str, float]:
    """Wait for `launches`, reading their stderr; returns (all stderr, seconds from the moment `marker` appeared until
    every one had exited)."""
    lines, seen = [], []

    def read(stream):
        for line in stream:
            lines.append(line)
            if marker in line and not seen:
                seen.append(time.monotonic())

    readers = [threading.Thread(target=read, args=(launch.stderr,)) for launch in launches]
    for reader in readers:
        reader.start()
    for launch in launches:
        launch.wait(timeout=600)
    for reader in readers:
        reader.join()
    assert seen, "".join(lines)
    return "".join(lines), time.monotonic() - seen[0]


def popen(command: list, env: dict) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def error_lines(stderr: str) -> list[str]:
    """stderr without Lightning's "Seed set to N" note."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("Seed set to")]



@pytest.mark.slow
@pytest.mark.parametrize("action", ["raise", "hang"])
def test_when_one_of_two_ranks_fails_the_other_leaves_soon_and_the_error_is_printed_once(action, data, tmp_path):
    out_dir = tmp_path / action
    # Both ranks must join within it as well: on a loaded 2-core machine the second one's start-up took over 30 s
    # where it imported torch and Lightning itself; forked from a server (`launched_litgpt`) it takes a second or two.
    timeout = 40
    litgpt_command, env = launched_litgpt(child_environment(LITGPT_FAILPOINT=f"step:backward@2/1={action}"))
    command = [litgpt_command, *map(str, pretrain_args(data, out_dir, 4, "--devices", "2", "--fsdp.timeout", timeout))]
    marker = "raised on purpose" if action == "raise" else "another rank died or stopped answering"
    launch = popen(command, env)
    stderr, seconds = time_failure([launch], marker)
    code = launch.returncode
    seconds += wait_until_gone(str(out_dir))
    print(f"two processes, rank 1 {action}s: the run ended {seconds:.1f} s after the failure was printed")
    assert code == 1, stderr
    if action == "raise":
        assert stderr.count("[rank 1] RuntimeError: failpoint step:backward (hit 2) raised on purpose") == 1, stderr
        assert stderr.count("another rank died or stopped answering") == 1, stderr
        assert seconds < 30  # gloo sees the closed connection at once
    else:
        assert stderr.count("[rank 0] litgpt pretrain: error: another rank died or stopped answering") == 1, stderr
        assert seconds < 30  # the hung rank 1 is Fabric's child: rank 0 takes it down as it leaves
    assert stderr.count("Traceback") == (1 if action == "raise" else 0), stderr


@pytest.mark.slow
def test_when_one_of_four_ranks_raises_all_leave_soon(data, tmp_path):
    """2 nodes x 2 processes (two torchrun launches): rank 3 raises at its second step."""
    out_dir = tmp_path / "four"
    port = str(free_port())
    marker = "[rank 3] RuntimeError: failpoint step:backward (hit 2) raised on purpose"
    launches = []
    # Each rank forked from a server that imported torch and Lightning once (`launched_litgpt`).
    litgpt_command, env = launched_litgpt(child_environment(LITGPT_FAILPOINT="step:backward@2/3=raise"))
    for node_rank in ("0", "1"):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2", "--node_rank",
            node_rank, "--master_addr", "127.0.0.1", "--master_port", port, "--no-python", litgpt_command,
            *map(str, pretrain_args(data, out_dir, 4, "--devices", "2", "--num_nodes", "2", "--fsdp.timeout", "60",
                                    "--train.micro_batch_size", "1")),
        ]
        launches.append(popen(command, env))
    stderr, seconds = time_failure(launches, marker)
    seconds += wait_until_gone(str(out_dir))
    print(f"four processes, rank 3 raises: every process gone {seconds:.1f} s after its error was printed")
    assert all(p.returncode != 0 for p in launches), stderr
    assert stderr.count(marker) == 1, stderr
    # Ranks 0-2 each say why they stop, in one line (torchrun's agents add their own report of the failure).
    # Once per launch at most.
    assert stderr.count("litgpt pretrain: error: another rank died or stopped answering") in (1, 2), stderr
    assert seconds < 60


# ---- numerical faults ----------------------------------------------------------------------------------------------------------
# AdamW moves every weight by about the learning rate per step: at 1e20 the second forward overflows to inf/NaN.
EXPLODING = ["--optimizer.init_args.lr", "1e20", "--train.lr_warmup_steps", "0"]


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_last_checkpoint(data, tmp_path):
    out_dir = tmp_path / "nan"
    p = litgpt(*pretrain_args(data, out_dir, 6), *EXPLODING)
    assert p.returncode == 1
    (message,) = error_lines(p.stderr)
    assert message.startswith("litgpt pretrain: error: Step 2: the loss or the gradient norm (here nan) is not finite")
    assert f"the newest checkpoint, {out_dir / 'step-000001'}, is as it was" in message
    assert [d.name for d in out_dir.glob("step-*")] == ["step-000001"]
    assert verify_checkpoint(out_dir / "step-000001") is None
    assert all(torch.isfinite(v).all() for v in load_state_dict(out_dir / "step-000001" / "lit_model.pth").values())


@pytest.mark.slow
def test_with_the_optimizer_in_the_backward_pass_a_non_finite_loss_stops_the_run(data, tmp_path):
    """--train.optimizer_in_backward leaves no gradient norm: the message names the loss, and says the update the
    backward pass applied is not saved (the newest checkpoint is the last finite one)."""
    out_dir = tmp_path / "nan"
    p = litgpt(*pretrain_args(data, out_dir, 6), *EXPLODING, "--train.optimizer_in_backward", "true",
               "--train.micro_batch_size", "4", "--train.max_norm", "null")
    assert p.returncode == 1
    (message,) = [line for line in error_lines(p.stderr) if line.startswith("litgpt")]  # not the tokenizing bar
    assert message.startswith("litgpt pretrain: error: Step 2: the loss is not finite (NaN or inf) on some rank; "
                              "training stopped without saving this step's update")
    assert f"the newest checkpoint, {out_dir / 'step-000001'}, is as it was" in message
    assert [d.name for d in out_dir.glob("step-*")] == ["step-000001"]
    assert all(torch.isfinite(v).all() for v in load_state_dict(out_dir / "step-000001" / "lit_model.pth").values())


@pytest.mark.slow
def test_on_nonfinite_skip_skips_the_updates_and_finishes(data, tmp_path):
    out_dir = tmp_path / "skip"
    p = litgpt(*pretrain_args(data, out_dir, 4), *EXPLODING, "--train.on_nonfinite", "skip")
    assert p.returncode == 0, p.stderr
    assert "step 2: skipped the update" in p.stdout
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["skipped_steps"] == 3  # every update after the first explodes
    first = load_state_dict(out_dir / "step-000001" / "lit_model.pth")
    last = load_state_dict(out_dir / "final" / "lit_model.pth")
    assert all(torch.equal(first[k], last[k]) for k in first)  # no skipped step changed a weight


# ---- disks --------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_model_whose_checkpoint_cannot_fit_is_refused_before_training(data, tmp_path):
    huge = data["root"] / "huge.yaml"
    Config(**{**SMALL, "n_layer": 4096, "n_embd": 8192, "n_head": 64, "n_query_groups": 8,
              "intermediate_size": 28672}).save(huge)  # ~4.4T parameters: about 50 TB with AdamW's state
    args = pretrain_args(data, tmp_path / "out", 2)
    args[args.index("--model_config") + 1] = huge
    p = litgpt(*args)
    assert p.returncode == 1
    (message,) = error_lines(p.stderr)
    assert "Not enough disk space" in message and "GiB are free" in message, message
    assert not (tmp_path / "out" / "step-000001").exists()


def limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_failed_write_at_save_time_is_named_and_the_previous_checkpoint_survives(data, uninterrupted, tmp_path):
    out_dir = tmp_path / "full-disk"
    shutil.copytree(uninterrupted, out_dir)
    shutil.rmtree(out_dir / "final")
    before = {f: f.read_bytes() for f in (out_dir / "step-000006").iterdir()}
    # Files past 1 MB cannot be written: as a full disk does, this fails the first checkpoint write.
    command = [sys.executable, "-m", "litgpt", *map(str, pretrain_args(data, out_dir, 8)), "--resume", "auto"]
    p = subprocess.run(command, cwd=ROOT, env=child_environment(), capture_output=True, text=True, timeout=300,
                       preexec_fn=limit_file_size(1 << 20))
    assert p.returncode == 1
    message = p.stderr.strip().splitlines()[-1]
    assert message.startswith("litgpt pretrain: error: Could not write checkpoint step-000007"), p.stderr
    assert "The earlier checkpoints are as they were" in message
    assert "Traceback" not in p.stderr
    assert {f: f.read_bytes() for f in (out_dir / "step-000006").iterdir()} == before
    assert verify_checkpoint(out_dir / "step-000006") is None
    assert not list(out_dir.glob(".step-*"))  # no staging folder left behind


# ---- Slurm: preemption and requeue ------------------------------------------------------------------------------------------
# Enough steps that USR1, sent once step 2 is logged, arrives mid-run (a step takes ~0.1 s, scancel well under 2 s)
STEPS_TO_REQUEUE = 120


@pytest.mark.slow
def test_slurm_usr1_saves_requeues_and_the_requeued_job_finishes(slurm_cluster, data, tmp_path):
    out_dir = tmp_path / "requeued"
    args = " ".join(f"'{a}'" for a in pretrain_args(data, out_dir, STEPS_TO_REQUEUE, "--devices", "2",
                                                     "--train.save_interval", "1000", "--train.requeue", "true",
                                                     "--resume", "auto"))
    script = tmp_path / "job.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={tmp_path}/job.log
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) OMP_NUM_THREADS=1
srun --kill-on-bad-exit=1 {sys.executable} -m litgpt {args}
""")
    env = slurm_env()
    job = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.strip()
    log = tmp_path / "job.log"

    def wait_for(predicate, seconds=300):
        start = time.monotonic()
        while not predicate():
            assert time.monotonic() - start < seconds, log.read_text() if log.exists() else "no log"
            time.sleep(0.5)

    wait_for(lambda: log.exists() and f"step 2/{STEPS_TO_REQUEUE}" in log.read_text())
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True)  # what --signal=USR1@120 would send
    state = lambda: subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                                   text=True).stdout.strip()
    # Requeued: pending again, or (a scheduler that does not hold it back) already running its next attempt.
    restarted = lambda: "Resuming from" in log.read_text()
    wait_for(lambda: "requeued Slurm job" in log.read_text() and (state() == "PENDING" or restarted()))
    if not restarted():
        # A requeued job waits about two minutes before Slurm starts it again; the test does not. Slurm refuses to
        # launch a job with a credential issued in the same second as the revocation of its killed run ("Job
        # credential revoked"), which is what that wait avoids: start it once the old run has left the node and the
        # clock has moved on. (Not checked: the job may have started on its own meanwhile.)
        node_state = lambda: subprocess.run(["sinfo", "-h", "-n", slurm_cluster, "-o", "%T"], env=env,
                                            capture_output=True, text=True).stdout.strip()
        wait_for(lambda: "completing" not in node_state())
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=False)
    wait_for(lambda: state() == "", seconds=600)
    assert (out_dir / "final").exists(), log.read_text()
    text = log.read_text()
    (stopped,) = [line for line in text.splitlines() if line.startswith("Stopped by SIGUSR1 after step")]
    step = int(stopped.split()[5].rstrip(":"))
    assert f"requeued Slurm job {job}; it continues with --resume auto" in stopped
    assert f"Resuming from {out_dir / f'step-{step:06d}'} (step {step}; manifest verified)." in text
    assert json.loads((out_dir / "metrics.json").read_text())["steps"] == STEPS_TO_REQUEUE
    restarts = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    assert "Restarts=1" in restarts or not restarts  # a finished job may already be purged from slurmctld

"""tests/litgpt_forkserver.py, the stand-in for `subprocess.run([sys.executable, "-m", "litgpt", ...])` that several
modules use, and the `litgpt` it puts on a shell's PATH for the guides: against that real subprocess, the same exit
code, stdout and stderr; a crash prints its traceback and exits 1; a process's changes reach no later one; a command
past its timeout is killed, with the ranks it started, once each has printed where it waited; the shim passes on
streams, signals and exit codes; a server whose starter leaves without closing it ends, with its commands and
folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from litgpt_forkserver import ForkServer, communicate, run_litgpt


# A process that the command starts writes after the command ends; "\r" as a progress bar writes it.
LATE_WRITER = r"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c",
                  "import sys, time; time.sleep(1); print('late', file=sys.stderr); print('a', end='\\r')"])
"""


@pytest.mark.parametrize("args", [["--help"], ["genrate"], ["finetune_lora", "{tmp}/none"]])
def test_the_same_exit_code_and_output_as_a_fresh_interpreter(args, tmp_path):
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    real = subprocess.run([sys.executable, "-m", "litgpt", *args], capture_output=True, text=True, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, timeout=300)
    forked = run_litgpt(args, cwd=tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert forked.args == real.args


def test_a_crash_is_a_traceback_and_exit_code_1_changes_stay_in_their_process_and_a_timeout_kills(tmp_path):
    """A `litgpt` package planted in the working folder stands in for the real one (`python -m` puts the working
    folder first on sys.path, and this server imported nothing of litgpt)."""
    main = tmp_path / "litgpt" / "__main__.py"
    main.parent.mkdir()
    (tmp_path / "litgpt" / "__init__.py").write_text("")
    server = ForkServer(dict(os.environ), cwd=tmp_path, preimports=("torch",))
    try:
        main.write_text("raise RuntimeError('planted crash')\n")
        crashed = server.run(["pretrain"], cwd=tmp_path)
        assert crashed.returncode == 1
        assert "Traceback" in crashed.stderr and "RuntimeError: planted crash" in crashed.stderr, crashed.stderr
        # Had the crashed child's module cache reached the server, this child would find the old __main__.
        main.write_text("import sys; print('planted', sys.argv[1:]); sys.exit(3)\n")
        exited = server.run(["a", "b"], cwd=tmp_path)
        assert (exited.returncode, exited.stdout) == (3, "planted ['a', 'b']\n"), exited.stderr
        main.write_text("import time; time.sleep(120)\n")
        with pytest.raises(subprocess.TimeoutExpired):
            server.run(["sleep"], cwd=tmp_path, timeout=5)
        main.write_text("import sys; sys.exit(4)\n")
        assert server.run([], cwd=tmp_path).returncode == 4  # the server answers after a kill
        # Like subprocess.run, a run reads its output until every process that holds it is done (a rank it started).
        main.write_text(LATE_WRITER)
        late = server.run([], cwd=tmp_path)
        assert (late.returncode, late.stdout, late.stderr) == (0, "a\n", "late\n")
    finally:
        server.close()


PLANTED_MAIN = """
import os, signal, sys, time
if sys.argv[1] == "echo":
    print("planted", sys.argv[2:], sys.stdin.read().strip(), os.environ.get("MASTER_PORT"))
    sys.exit(3)
signal.signal(signal.SIGUSR1, lambda *_: (print("saved on SIGUSR1"), sys.exit(0)))
with open("pid.tmp", "w") as file:
    file.write(str(os.getpid()))
os.rename("pid.tmp", "pid")
time.sleep(120)
"""


def test_the_shim_on_path_forks_from_the_server_and_acts_as_the_command_it_stands_for(tmp_path):
    """Through the server's `litgpt` first on PATH: the shell's pipes and arguments reach the command (a planted
    package, which only the server's `python -m` finds), an exit code and the signal that ended the command come
    back, signals reach the command, a killed shim takes its command along, and an environment that the server was
    not started with runs the real `litgpt` script."""
    (tmp_path / "litgpt").mkdir()
    (tmp_path / "litgpt" / "__init__.py").write_text("")
    (tmp_path / "litgpt" / "__main__.py").write_text(PLANTED_MAIN)
    server = ForkServer(dict(os.environ), cwd=tmp_path, preimports=(), shim_on_path=True)

    def bash(script: str) -> subprocess.CompletedProcess:
        (tmp_path / "pid").unlink(missing_ok=True)
        return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=server.env, capture_output=True, text=True,
                              timeout=120)

    wait_for_pid = "litgpt wait & p=$!; until [ -s pid ]; do sleep 0.05; done; "
    try:
        echoed = bash("echo hi | MASTER_PORT=1234 litgpt echo a 'b c' | cat; echo rc=${PIPESTATUS[1]}")
        assert echoed.stdout == "planted ['a', 'b c'] hi 1234\nrc=3\n", echoed.stderr
        saved = bash(wait_for_pid + "kill -USR1 $p; wait $p; echo rc=$?")
        assert saved.stdout == "saved on SIGUSR1\nrc=0\n", saved.stderr
        terminated = bash(wait_for_pid + "kill -TERM $p; wait $p; echo rc=$?")
        assert terminated.stdout == f"rc={128 + signal.SIGTERM}\n", terminated.stderr
        killed = bash(wait_for_pid + "kill -KILL $p; wait $p; echo rc=$?; cat pid")
        rc, pid = killed.stdout.split()
        assert rc == f"rc={128 + signal.SIGKILL}", killed.stderr
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists():  # the server kills and reaps the command of a shim that is gone
            assert time.monotonic() < deadline, f"the command {pid} of a killed shim still runs"
            time.sleep(0.1)
        real = bash("FOO=other litgpt echo")
        assert real.returncode == 1 and "unknown command 'echo'" in real.stderr, (real.stdout, real.stderr)
    finally:
        server.close()


# A pytest worker that leaves without its exit handlers: a server, a command running on it, then os._exit.
STARTER_THAT_LEAVES = r"""
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from litgpt_forkserver import ForkServer
server = ForkServer(dict(os.environ), cwd=sys.argv[2], preimports=())
threading.Thread(target=server.run, args=(["sleep"],), kwargs=dict(cwd=sys.argv[2], timeout=120), daemon=True).start()
while not os.path.exists(os.path.join(sys.argv[2], "pid")):
    time.sleep(0.05)
print(server.process.pid, server.folder, flush=True)
os._exit(0)
"""


def test_a_server_whose_starter_leaves_without_closing_it_ends_with_its_commands_and_folder(tmp_path):
    (tmp_path / "litgpt").mkdir()
    (tmp_path / "litgpt" / "__init__.py").write_text("")
    (tmp_path / "litgpt" / "__main__.py").write_text(PLANTED_MAIN)
    left = subprocess.run([sys.executable, "-c", STARTER_THAT_LEAVES, str(Path(__file__).parent), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert left.returncode == 0, left.stderr
    server_pid, folder = left.stdout.split()
    command_pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and process_state(pid) != "Z" for pid in (int(server_pid), command_pid)):
        assert time.monotonic() < deadline, "the server or its command outlived the process that started them"
        time.sleep(0.05)
    assert not Path(folder).exists()


def process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


# A command that starts a rank through the shim (as Lightning's launcher does in a forked command), then both wait.
HANGING_MAIN = """
import os, subprocess, sys, time

def rank_waits_here():
    time.sleep(120)

def command_waits_here():
    time.sleep(120)

if sys.argv[1] == "rank":
    with open(f"rank-{os.getpid()}.tmp", "w") as file:
        file.write(str(os.getpid()))
    os.rename(f"rank-{os.getpid()}.tmp", f"rank-{os.getpid()}")
    rank_waits_here()
if sys.argv[1] == "command":  # the shim beside the server's socket
    subprocess.Popen([os.path.join(os.path.dirname(os.environ["LITGPT_TEST_FORKSERVER"]), "bin", "litgpt"), "rank"])
    command_waits_here()
"""
# A launcher that is not forked (torchrun's agent): two ranks through the shim, then it waits for them.
LAUNCHER = "import subprocess, sys; [p.wait() for p in [subprocess.Popen([sys.argv[1], 'rank']) for _ in range(2)]]"


def test_past_its_timeout_each_process_of_a_run_prints_its_stacks_then_all_are_killed(tmp_path):
    """`run_litgpt`'s timeout (a command and the rank it started through the shim) and `communicate`'s (a launcher
    that is not forked, two ranks through the shim): TimeoutExpired's message carries each forked process's Python
    stack, and no rank outlives it. (Timeouts of 10 s: time for the ranks to start on a busy machine.)"""
    (tmp_path / "litgpt").mkdir()
    (tmp_path / "litgpt" / "__init__.py").write_text("")
    (tmp_path / "litgpt" / "__main__.py").write_text(HANGING_MAIN)
    server = ForkServer(dict(os.environ), cwd=tmp_path, preimports=())
    try:
        with pytest.raises(subprocess.TimeoutExpired) as hung:
            server.run(["command"], cwd=tmp_path, timeout=10)
        assert "in command_waits_here" in hung.value.stderr and "in rank_waits_here" in hung.value.stderr
        assert "in rank_waits_here" in "\n".join(hung.value.__notes__)
        assert_ended(ranks_in(tmp_path), "a rank of a command past its timeout")

        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, server.shim_folder / "litgpt"], cwd=tmp_path,
                                    env=server.env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with pytest.raises(subprocess.TimeoutExpired) as hung:
            communicate(launcher, timeout=10)
        assert hung.value.stderr.count("in rank_waits_here") == 2, hung.value.stderr
        assert launcher.poll() is not None
        assert_ended(ranks_in(tmp_path), "a rank of a launcher past its timeout")
    finally:
        server.close()


def ranks_in(folder: Path) -> list[int]:
    return [int(path.read_text()) for path in folder.glob("rank-*") if not path.name.endswith(".tmp")]


def assert_ended(pids: list[int], what: str) -> None:
    assert pids
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and process_state(pid) != "Z" for pid in pids):
        assert time.monotonic() < deadline, f"{what} still runs"
        time.sleep(0.05)

"""Run `python -m litgpt ARGS` many times without paying for Python, torch and Lightning each time.

A `ForkServer` is one Python process, started with a given environment, that imports the libraries and modules the
commands import (torch, Lightning Fabric, jsonargparse, litgpt's) once and then listens on a Unix socket. For each
request (arguments, working folder, environment, and the three file descriptors to use as stdin, stdout and stderr,
passed over the socket) it forks a child that runs the real entry point as `python -m litgpt ARGS` does (`runpy`
with `__main__`, `sys.argv`, the working folder first on `sys.path`): an exception it does not catch is printed by
the interpreter with its traceback and exit code 1, `sys.exit(n)` ends it with code n, and the interpreter ends it
(exit handlers, teardown). The server answers the child's pid, then its exit code (negative: the signal that ended
it); a client that goes away before then (killed, or past its timeout) takes the child with it (SIGKILL). Past its
timeout, a command and the ranks it started first print every thread's Python stack to its stderr, which the
client's `TimeoutExpired` shows (`STACKS_SIGNAL`): a run that hung says where each rank waited. Each
command is a process of its own (nothing it changes reaches the next one); what it shares with the others is only
the state the imports left, the same as in a fresh `python -m litgpt`. The ranks that a command starts itself
(`--devices 2`: Lightning's launcher runs `python -m litgpt.__main__ ARGS` for each) are forked too: in a forked
command the launcher runs the server's shim with the same arguments instead, in the environment it gives the rank.
(Runs that tests start with `subprocess.Popen` or srun show the launcher's own command; a launcher given the shim
as its program, `torchrun --no-python SHIM ARGS` with `launched_litgpt`, has each of its ranks forked.)

Two clients:
- `run_litgpt(args, cwd=..., env=..., input=...)` stands for `subprocess.run([sys.executable, "-m", "litgpt",
  *args], cwd=..., env=..., input=..., capture_output=True, text=True)` (stdin empty without input) and returns the
  same `CompletedProcess`; the environment (this process's by default) picks the server, started on first use.
- the shim, an executable `litgpt` in `ForkServer.shim_folder` (first on the PATH of `ForkServer.env` with
  `shim_on_path`, as tests/test_tutorials.py gives the guides' shell blocks): it hands its arguments, working folder,
  environment and its own stdin, stdout and stderr to the server named by FORKSERVER_VARIABLE, passes on the signals
  it gets (`kill $pid` of a background `litgpt`), and exits as the command did (killed by the same signal, or with its
  exit code). Where the server cannot take it, it runs the real `litgpt` script in its place (exec): no server, or an
  environment that differs from the server's in a variable read at import (under `srun`, for instance; torchrun's
  variables are read at run time only). `launched_litgpt(env)` gives the shim and the environment for a launcher.

Variables read at run time only (RUN_TIME_VARIABLES) may differ between the server and a command; every other one
must be the same, because the server's imports read them.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Imported once by the server: the libraries the commands import (Lightning alone ~7 s of CPU) and the modules of
# the commands the tests run most (~1 s more per process where bytecode is not cached). No module of litgpt changes
# any global state when imported (no torch or warnings settings at module level), so a child that finds them
# imported runs as one that imports them itself; the rest of the commands import their modules in the child.
PREIMPORTS = ("torch", "lightning.fabric", "jsonargparse", "litgpt.pretrain", "litgpt.finetune.lora",
              "litgpt.finetune.full", "litgpt.generate", "litgpt.chat", "litgpt.download",
              "litgpt.convert.hf_to_litgpt", "litgpt.convert.litgpt_to_hf", "litgpt.merge_lora", "litgpt.consolidate",
              "litgpt.plan")

# What torchrun's agent sets for each rank besides the five of torch.distributed (torch.distributed.elastic): read by
# torch and Lightning when a process group or cluster environment is set up, never at import (Lightning's import-time
# guess of the rank from RANK is replaced by the strategy's setup, as for the ranks Lightning's launcher starts).
TORCHRUN_VARIABLES = ("RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                      "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
                      "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")

# The variables that may differ between the server and a command forked from it: no import reads them. pytest names
# the running test in PYTEST_CURRENT_TEST; Lightning's launcher sets the five of torch.distributed for the ranks it
# starts and PL_GLOBAL_SEED; litgpt reads LITGPT_CPUINFO when it picks the default precision, LITGPT_CACHE_DIR when
# it opens a cache (a test's own cache folder needs no server of its own) and the failpoints' two when a process
# first passes one; a shell sets PWD, OLDPWD, SHLVL and _ for the commands it starts; Slurm sets ENVIRONMENT=BATCH
# and HOSTNAME in a batch job, and TMPDIR (a forked command looks it up again: the server's `tempfile.tempdir` is
# reset). Tests that train, compile or log in the pytest worker itself leave in its environment what libraries set
# there and read when they run, never at import: Lightning's PL_SEED_WORKERS (seed_everything), litdata's
# DATA_OPTIMIZER_NUM_WORKERS (optimize), inductor's _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR (set before each
# compiled library loads), the trackers' MLFLOW_TRACKING_URI and WANDB_SERVICE; as run-time variables they no longer
# start a server of their own for the tests that follow.
RUN_TIME_VARIABLES = ("PYTEST_CURRENT_TEST", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE",
                      "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "LITGPT_CPUINFO", "LITGPT_CACHE_DIR", "LITGPT_FAILPOINT",
                      "LITGPT_FAILPOINTS_ARMED", "PWD", "OLDPWD", "SHLVL", "_", "ENVIRONMENT", "HOSTNAME", "TMPDIR",
                      "DATA_OPTIMIZER_NUM_WORKERS", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "MLFLOW_TRACKING_URI",
                      "WANDB_SERVICE", *TORCHRUN_VARIABLES)
# Slurm's variables, set by srun and sbatch for each task (job and step ids, ranks, nodes): read by Lightning's and
# litgpt's cluster detection when a run starts, never at import (as torchrun's, above).
RUN_TIME_PREFIXES = ("SLURM_", "SLURMD_", "SRUN_")
# Where a server listens: set in the server's environment (and so in that of every shell block started with it).
FORKSERVER_VARIABLE = "LITGPT_TEST_FORKSERVER"

SERVER = r"""
import faulthandler, gc, importlib, json, os, runpy, selectors, shutil, socket, sys, tempfile

# The process that started the server (a pytest worker), watched: should it end without closing the server (killed,
# or leaving by os._exit, which skips its exit handlers), the server ends too, with the commands it runs and its folder.
starter = os.pidfd_open(os.getppid())
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1] + ".binding")
listener.listen(64)  # clients that connect while the imports run wait in the backlog
# Only a listening socket gets its name: one that a client finds bound but not listening yet refuses it.
os.rename(sys.argv[1] + ".binding", sys.argv[1])
RUN_TIME_VARIABLES, RUN_TIME_PREFIXES = set(json.loads(sys.argv[2])), tuple(json.loads(sys.argv[3]))
SHIM, STACKS_SIGNAL = sys.argv[4], int(sys.argv[5])
started_with = dict(os.environ)
for name in sys.argv[6:]:
    importlib.import_module(name)
# Variables the imports set (Lightning's PYTORCH_NVML_BASED_CUDA_CHECK, ...): a fresh process has them too, and so
# does the environment a command passes on to the ranks it starts.
set_by_imports = {name: value for name, value in os.environ.items() if started_with.get(name) != value}
# What prefork servers do: the objects the imports made leave the collector's generations, so that no collection
# and no teardown in a child walks them all (copying every page of the heap it shares): 2 s of CPU per child less.
gc.collect()
gc.freeze()


def key(env):
    return {name: value for name, value in env.items() if name not in RUN_TIME_VARIABLES and name not in set_by_imports
            and not name.startswith(RUN_TIME_PREFIXES)}


def read_request(conn):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return json.loads(data), fds


def run_command(request, fds):
    # The child: nothing of the server's stays open, the request's descriptors become 0, 1 and 2.
    for conn, pidfd in clients.values():
        conn.close()
        os.close(pidfd)
    listener.close()
    os.close(starter)
    selector.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)  # onto the command's stderr (fd 2)
    os.environ.clear()
    os.environ.update(request["env"])  # differs from the server's only in variables read at run time
    os.environ.update(set_by_imports)
    tempfile.tempdir = None  # found again from this environment's TMPDIR, which Slurm sets for its tasks
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    sys.modules.pop("litgpt.__main__", None)  # `python -m` runs it before anything imports it
    sys.argv = ["-m", *request["argv"]]  # runpy puts the path of litgpt/__main__.py first, as `python -m` does
    # The ranks Lightning's launcher starts (`--devices 2`) run the shim instead of `python -m litgpt.__main__ ARGS`:
    # forked too, each in the environment the launcher gives it (where the server imported Lightning).
    launcher = sys.modules.get("lightning.fabric.strategies.launchers.subprocess_script")
    if launcher is not None:
        launcher._basic_subprocess_cmd = lambda: [SHIM, *sys.argv[1:]]
    runpy.run_module("litgpt", run_name="__main__", alter_sys=True)
    sys.exit(0)  # the interpreter ends the child, as at the end of `python -m litgpt`


def reply(conn, message):
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the client went away
        pass


selector = selectors.DefaultSelector()
selector.register(listener, selectors.EVENT_READ, ("listener",))
selector.register(starter, selectors.EVENT_READ, ("starter",))
clients = {}  # pid -> (connection, pidfd)
while True:
    for event, _ in selector.select():
        kind = event.data[0]
        if kind == "listener":
            conn, _ = listener.accept()
            request, fds = read_request(conn)
            differing = sorted(set(key(request["env"]).items()) ^ set(key(started_with).items()))
            if differing:
                for fd in fds:
                    os.close(fd)
                names = sorted({name for name, _ in differing})
                print("not forked: the environment differs from the server's in", *names, flush=True)
                reply(conn, {"fallback": f"the environment differs from the server's in {', '.join(names)}"})
                conn.close()
                continue
            sys.stdout.flush(); sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                conn.close()
                run_command(request, fds)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            clients[pid] = (conn, pidfd)
            selector.register(pidfd, selectors.EVENT_READ, ("ended", pid))
            selector.register(conn, selectors.EVENT_READ, ("client", pid))
            reply(conn, {"pid": pid})
        elif kind == "starter":
            for pid in clients:
                os.kill(pid, 9)
            shutil.rmtree(os.path.dirname(sys.argv[1]), ignore_errors=True)
            os._exit(0)
        elif kind == "client":  # a client sends nothing after its request: this is its end
            if event.data[1] in clients and not event.fileobj.recv(1):
                selector.unregister(event.fileobj)
                os.kill(event.data[1], 9)
        else:
            pid = event.data[1]
            conn, pidfd = clients.pop(pid)
            _, status = os.waitpid(pid, 0)
            reply(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            selector.unregister(pidfd)
            os.close(pidfd)
            if conn.fileno() in selector.get_map():
                selector.unregister(conn)
            conn.close()
"""


class ServerGone(RuntimeError):
    """The server ended (or never started) before answering."""


class Fallback(Exception):
    """The server cannot run this command (its reason is the message): run the real `litgpt` instead."""


class Command:
    """`python -m litgpt *argv`, run by the server at `socket_path` with the descriptors `stdio` as its stdin, stdout
    and stderr (the server holds copies once this returns: close them here). Raises `ServerGone`, or `Fallback`
    where the server cannot run it."""

    def __init__(self, socket_path: str, argv: list[str], cwd: str, env: dict[str, str], stdio: tuple[int, ...]):
        self.argv, self.conn, self._pending = argv, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), b""
        request = {"argv": argv, "cwd": cwd, "env": env}
        try:
            self.conn.connect(socket_path)
            socket.send_fds(self.conn, [json.dumps(request).encode() + b"\n"], list(stdio))
        except OSError as error:
            self.conn.close()
            raise ServerGone(f"no fork server at {socket_path}: {error}") from None
        first = self._reply(deadline=None)
        if "fallback" in first:
            self.conn.close()
            raise Fallback(first["fallback"])
        self.pid: int = first["pid"]

    def returncode(self, deadline: float | None = None) -> int:
        """The exit code (negative: the signal that ended it); past `deadline` (time.monotonic) it is killed, with
        the processes it started, and TimeoutError raised."""
        try:
            return self._reply(deadline)["returncode"]
        except TimeoutError:
            self.kill([self.pid, *descendants(self.pid)])
            raise
        finally:
            self.conn.close()

    def kill(self, tree: list[int]) -> None:
        """SIGKILL `tree` (the command and the processes it started; a shim's forked rank goes with its shim's
        connection), and wait until the server has seen the command end."""
        signal_each(tree, signal.SIGKILL)
        self._reply(deadline=None)

    def _reply(self, deadline: float | None) -> dict:
        """The server's next reply (a JSON object a line)."""
        while b"\n" not in self._pending:
            if deadline is not None:
                if deadline <= time.monotonic():
                    raise TimeoutError
                self.conn.settimeout(deadline - time.monotonic())
            try:
                chunk = self.conn.recv(4096)
            except socket.timeout:
                raise TimeoutError from None
            if not chunk:
                raise ServerGone("the fork server ended before answering")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)


def read_until_closed(fds: list[int], deadline: float) -> tuple[list[bytes], bool]:
    """What each pipe in `fds` carries until every writer has closed it (as `subprocess.run` waits for a launched
    run's other processes too), and whether they closed before `deadline`."""
    chunks = {fd: [] for fd in fds}
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            ready = selector.select(deadline - time.monotonic())
            if not ready:
                return [b"".join(chunks[fd]) for fd in fds], False
            for key, _ in ready:
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    chunks[key.fd].append(chunk)
                else:
                    selector.unregister(key.fd)
    return [b"".join(chunks[fd]) for fd in fds], True


# Sent, past its timeout, to a command and to the processes it started, before they are killed: a forked command
# (and a shim, which passes it on) prints every thread's Python stack to its stderr (faulthandler), so that a test
# that timed out shows where each rank of the run waited.
STACKS_SIGNAL = signal.SIGRTMIN + 2
STACKS_SECONDS = 3.0  # how long the stacks take to arrive (the processes keep running meanwhile)
# Between two processes' signals: each writes its stacks in many small writes to the stderr they share, and two
# processes signalled at once interleaved theirs character by character on a loaded machine.
STACKS_PAUSE = 0.25


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, those they started, and so on (Linux: /proc lists each thread's children)."""
    found, parents = [], [pid]
    while parents:
        for path in glob.glob(f"/proc/{parents.pop()}/task/*/children"):
            try:
                children = [int(child) for child in Path(path).read_text().split()]
            except (OSError, ValueError):  # ended meanwhile
                continue
            found += children
            parents += children
    return found


def signal_each(pids: list[int], signum: int, pause: float = 0.0) -> None:
    """Send `signum` to each of `pids` that still runs, `pause` seconds apart."""
    for index, pid in enumerate(pids):
        if index and pause:
            time.sleep(pause)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # ended meanwhile
            pass


def timed_out(command: list, timeout: float, stdout: str, stderr: str) -> subprocess.TimeoutExpired:
    """`subprocess.TimeoutExpired`, with the end of the run's stderr (where the stacks are) in its message."""
    error = subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    error.add_note(f"The end of its stderr, with each process's stacks at the timeout:\n{(stderr or '')[-12000:]}")
    return error


def communicate(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """`process.communicate(timeout=timeout)` for a launcher whose ranks are shims (`launched_litgpt`): past the
    timeout, the ranks print their stacks, the launcher and what it started are killed, and `TimeoutExpired` says
    where each rank waited."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = descendants(process.pid)
        # Not to the launcher, which is not forked: the signal would end it.
        signal_each(tree, STACKS_SIGNAL, STACKS_PAUSE)
        try:
            process.communicate(timeout=STACKS_SECONDS)  # what arrives meanwhile is kept for the next call
        except subprocess.TimeoutExpired:
            pass
        signal_each([process.pid, *tree], signal.SIGKILL)
        raise timed_out(process.args, timeout, *process.communicate()) from None


def as_text(stream: bytes) -> str:
    """As text=True reads a stream: undecodable bytes replaced, "\r\n" and "\r" read as "\n"."""
    return stream.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


class ForkServer:
    """The server (see the module's docstring), with its shim in `shim_folder` (first on the PATH of `env` with
    `shim_on_path`: every `litgpt` that a shell started with `.env` runs is forked then)."""

    def __init__(self, env: dict[str, str], cwd: Path | str, preimports: tuple[str, ...] = PREIMPORTS,
                 shim_on_path: bool = False) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="litgpt-forkserver-"))
        self.socket_path = str(self.folder / "socket")
        self.shim_folder = self.folder / "bin"
        shim = write_shim(self.shim_folder)
        self.env, self.cwd = {**env, FORKSERVER_VARIABLE: self.socket_path}, str(cwd)
        if shim_on_path:
            self.env["PATH"] = os.pathsep.join((str(self.shim_folder), env.get("PATH", os.defpath)))
        self._log = open(self.folder / "server.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, self.socket_path, json.dumps(RUN_TIME_VARIABLES),
             json.dumps(RUN_TIME_PREFIXES), str(shim), str(int(STACKS_SIGNAL)), *preimports],
            cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self._count = 0
        # The socket has its name once it listens, before the imports end: clients that connect earlier wait in
        # its backlog.
        while not os.path.exists(self.socket_path):
            assert self.process.poll() is None, f"the fork server did not start:\n{self.log()}"
            time.sleep(0.01)

    def log(self) -> str:
        return (self.folder / "server.log").read_text()

    def run(self, args: list, cwd: Path | str | None = None, timeout: float = 300, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`python -m litgpt *args` in `cwd` (the server's folder by default), reading `input` on stdin (nothing if
        None); raises `subprocess.TimeoutExpired` after `timeout` seconds, the command killed, as `subprocess.run`
        does."""
        deadline = time.monotonic() + timeout
        self._count += 1
        stdin = self.folder / f"{self._count}.in"
        stdin.write_text(input or "")
        argv = [str(arg) for arg in args]
        env = {**(self.env if env is None else env), FORKSERVER_VARIABLE: self.socket_path}
        (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe()
        stdio = (os.open(stdin, os.O_RDONLY), out_write, err_write)
        try:
            command = Command(self.socket_path, argv, str(cwd or self.cwd), env, stdio)
        except (ServerGone, Fallback) as error:
            raise AssertionError(f"{error}; the server's log:\n{self.log()}") from None
        finally:
            for fd in stdio:
                os.close(fd)
            stdin.unlink()
        args = [sys.executable, "-m", "litgpt", *argv]
        try:
            output, closed = read_until_closed([out_read, err_read], deadline)
            if not closed:  # past the timeout: each process's stacks, then the end of them all
                tree = [command.pid, *descendants(command.pid)]
                signal_each(tree, STACKS_SIGNAL, STACKS_PAUSE)
                stacks, _ = read_until_closed([out_read, err_read], time.monotonic() + STACKS_SECONDS)
                command.kill(tree)
                raise timed_out(args, timeout, *(as_text(head + tail) for head, tail in zip(output, stacks)))
            try:
                returncode = command.returncode(deadline)
            except TimeoutError:  # it closed its output but did not end (killed now)
                raise timed_out(args, timeout, *map(as_text, output)) from None
        finally:
            command.conn.close()
            os.close(out_read)
            os.close(err_read)
        return subprocess.CompletedProcess(args, returncode, *map(as_text, output))

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


MAX_SERVERS = 4  # each holds torch and Lightning (~0.4 GB); the least recently used one goes first. Four: a module's
# own environment, os.environ, and the one with OMP_NUM_THREADS=1 of the modules that launch ranks alternate

_SERVERS: dict[tuple, ForkServer] = {}


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((name, value) for name, value in env.items()
                        if name not in RUN_TIME_VARIABLES and name != FORKSERVER_VARIABLE
                        and not name.startswith(RUN_TIME_PREFIXES)))


def run_litgpt(args, cwd: Path | str, env: dict[str, str] | None = None, timeout: float = 300,
               input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m litgpt *args` in `cwd` with `env` (this process's environment if None), reading `input` (nothing
    if None), forked from the server started with that environment (see the module's docstring)."""
    env = dict(os.environ if env is None else env)
    return server_for(env).run(args, cwd=cwd, timeout=timeout, input=input, env=env)


def launched_litgpt(env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """For a launcher that starts the ranks itself (`torchrun --no-python LITGPT ARGS`): the shim to run as `litgpt`
    and the environment to give the launcher, so that each rank is forked from the server started with `env` (the
    variables the launcher adds for its ranks are read at run time only)."""
    server = server_for(env)
    return str(server.shim_folder / "litgpt"), {**env, FORKSERVER_VARIABLE: server.socket_path}


def server_for(env: dict[str, str]) -> "ForkServer":
    """The running server started with `env` (but its run-time variables), or a new one."""
    key = _key(env)
    server = _SERVERS.pop(key, None)
    if server is not None and server.process.poll() is not None:
        server.close()
        server = None
    if server is None:
        while len(_SERVERS) >= MAX_SERVERS:
            _SERVERS.pop(next(iter(_SERVERS))).close()
        # Started in a folder of its own, so that nothing is imported from a test's folder.
        server = ForkServer(env, cwd=tempfile.gettempdir())
    _SERVERS[key] = server  # now the most recently used
    return server


@atexit.register
def _close_servers() -> None:
    for server in _SERVERS.values():
        server.close()


# ---- the `litgpt` of a shell's PATH ----------------------------------------------------------------------------------
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
                     STACKS_SIGNAL)


def shim_main() -> None:
    """The `litgpt` that `write_shim` writes: the command from the server named in the environment, or the real one."""
    real = os.path.join(os.path.dirname(sys.executable), "litgpt")
    socket_path = os.environ.get(FORKSERVER_VARIABLE)
    pid, pending = None, []

    def forward(signum, frame):
        if pid is None:
            pending.append(signum)
            return
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # it has ended: its exit code is on its way
            pass

    def started(child):
        nonlocal pid
        pid = child
        for signum in pending:
            forward(signum, None)

    # A shell's background job ignores SIGINT and SIGQUIT: the shim leaves those ignored, as Python would.
    forwarded = [signum for signum in FORWARDED_SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]
    for signum in forwarded:
        signal.signal(signum, forward)
    try:
        if socket_path is None:
            raise ServerGone(f"{FORKSERVER_VARIABLE} is not set")
        command = Command(socket_path, sys.argv[1:], os.getcwd(), dict(os.environ), (0, 1, 2))
    except (ServerGone, Fallback):
        for signum in forwarded:
            signal.signal(signum, signal.SIG_DFL)
        os.execv(real, [real, *sys.argv[1:]])
    started(command.pid)
    returncode = command.returncode()
    if returncode < 0:  # end as the command ended: by the same signal
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):  # the two that no handler catches
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode)


def write_shim(folder: Path) -> Path:
    """An executable `litgpt` in `folder` that runs `shim_main` (put `folder` first on PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "litgpt"
    shim.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                    "from litgpt_forkserver import shim_main\nshim_main()\n")
    shim.chmod(0o755)
    return shim

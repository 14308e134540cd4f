"""Run `python -m litgpt ARGS` many times without paying for Python, torch and Lightning each time.

A `ForkServer` is one Python process, started with a given environment, that imports the libraries and modules the
commands import (torch, Lightning Fabric, jsonargparse, litgpt's) once and then, for each command, forks a child that
runs the real entry point as `python -m litgpt ARGS` does (`runpy` with `__main__`, `sys.argv`, the working folder
first on `sys.path`): its stdin is /dev/null or a file holding the given input, its stdout and stderr go to files, an
exception it does not catch is printed by the interpreter with its traceback and exit code 1, `sys.exit(n)` ends it
with code n, and the interpreter ends it (exit handlers, teardown). Each command is a process of its own (nothing it
changes reaches the next one); what it shares with the others is only the state the imports left, the same as in a
fresh `python -m litgpt`.

`run_litgpt(args, cwd=..., env=..., input=...)` stands for `subprocess.run([sys.executable, "-m", "litgpt", *args],
cwd=..., env=..., input=..., capture_output=True, text=True)` (stdin empty without input) and returns the same
`CompletedProcess`; the environment (this process's by default, read at each call) picks the server, started on
first use with that environment (environment variables are read at import), PYTEST_CURRENT_TEST aside (set anew in
each child). Only for commands of one process: a command that starts processes of its own (`--devices 2`) relaunches
`sys.argv`, which is the server's, so such runs use a real subprocess.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
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

SERVER = r"""
import gc, importlib, json, os, runpy, sys
for name in sys.argv[3:]:
    importlib.import_module(name)
# What prefork servers do: the objects the imports made leave the collector's generations, so that no collection
# and no teardown in a child walks them all (copying every page of the heap it shares): 2 s of CPU per child less.
gc.collect()
gc.freeze()
requests, replies = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
replies.write("ready\n"); replies.flush()
for line in requests:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        requests.close(); replies.close()
        os.dup2(os.open(request["stdin"], os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.environ.clear()
        os.environ.update(request["env"])  # differs from the server's only in variables read at run time
        os.chdir(request["cwd"])
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        sys.modules.pop("litgpt.__main__", None)  # `python -m` runs it before anything imports it
        sys.argv = ["-m", *request["argv"]]  # runpy puts the path of litgpt/__main__.py first, as `python -m` does
        runpy.run_module("litgpt", run_name="__main__", alter_sys=True)
        sys.exit(0)  # the interpreter ends the child, as at the end of `python -m litgpt`
    replies.write(json.dumps({"pid": pid}) + "\n"); replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n"); replies.flush()
"""


class ForkServer:
    def __init__(self, env: dict[str, str], cwd: Path | str, preimports: tuple[str, ...] = PREIMPORTS) -> None:
        self.env, self.cwd = dict(env), str(cwd)
        self.folder = Path(tempfile.mkdtemp(prefix="litgpt-forkserver-"))
        request_read, self._request_write = os.pipe()
        self._reply_read, reply_write = os.pipe()
        # The server reads requests and writes replies on pipes of their own; its stdout and stderr go to a log.
        self._log = open(self.folder / "server.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(request_read), str(reply_write), *preimports], cwd=self.cwd,
            env=self.env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            pass_fds=(request_read, reply_write),
        )
        os.close(request_read)
        os.close(reply_write)
        self._requests = os.fdopen(self._request_write, "w")
        self._pending = b""  # reply bytes read but not yet returned
        ready = self._read_reply(timeout=300)
        assert ready == "ready", f"the fork server did not start:\n{(self.folder / 'server.log').read_text()}"
        self._count = 0

    def _read_reply(self, timeout: float) -> str | None:
        """The next line the server wrote, or None if none came within `timeout` seconds (or the server ended)."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self._reply_read, selectors.EVENT_READ)
            while b"\n" not in self._pending:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(self._reply_read, 4096)
                if not chunk:
                    return None
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def run(self, args: list, cwd: Path | str | None = None, timeout: float = 300, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`python -m litgpt *args` in `cwd` (the server's folder by default), reading `input` on stdin (nothing if
        None); raises `subprocess.TimeoutExpired` after `timeout` seconds, the command killed, as `subprocess.run`
        does."""
        assert self.process.poll() is None, f"the fork server ended:\n{(self.folder / 'server.log').read_text()}"
        self._count += 1
        stdout, stderr = self.folder / f"{self._count}.out", self.folder / f"{self._count}.err"
        argv = [str(arg) for arg in args]
        stdin = os.devnull
        if input is not None:
            stdin = self.folder / f"{self._count}.in"
            stdin.write_text(input)
        env = self.env if env is None else env
        assert _key(env) == _key(self.env), "the server was started with another environment"
        request = {"argv": argv, "cwd": str(cwd or self.cwd), "env": env, "stdin": str(stdin), "stdout": str(stdout),
                   "stderr": str(stderr)}
        self._requests.write(json.dumps(request) + "\n")
        self._requests.flush()
        pid = json.loads(self._read_reply(timeout=60))["pid"]
        reply = self._read_reply(timeout)
        if reply is None:
            os.kill(pid, signal.SIGKILL)
            self._read_reply(timeout=60)
            raise subprocess.TimeoutExpired(["litgpt", *argv], timeout)
        returncode = json.loads(reply)["returncode"]
        out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
        for file in (stdout, stderr, self.folder / f"{self._count}.in"):
            file.unlink(missing_ok=True)
        return subprocess.CompletedProcess([sys.executable, "-m", "litgpt", *argv], returncode, out, err)

    def close(self) -> None:
        self._requests.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._reply_read)
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# The variables that may differ between the server and a command forked from it: read at run time only (pytest
# names the running test in PYTEST_CURRENT_TEST; no import reads it).
RUN_TIME_VARIABLES = ("PYTEST_CURRENT_TEST",)
MAX_SERVERS = 2  # each holds torch and Lightning in memory; the least recently used one goes first

_SERVERS: dict[tuple, ForkServer] = {}


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((name, value) for name, value in env.items() if name not in RUN_TIME_VARIABLES))


def run_litgpt(args, cwd: Path | str, env: dict[str, str] | None = None, timeout: float = 300,
               input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m litgpt *args` in `cwd` with `env` (this process's environment if None), reading `input` (nothing
    if None), forked from the server started with that environment (see the module's docstring)."""
    env = dict(os.environ if env is None else env)
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
    return server.run(args, cwd=cwd, timeout=timeout, input=input, env=env)


@atexit.register
def _close_servers() -> None:
    for server in _SERVERS.values():
        server.close()

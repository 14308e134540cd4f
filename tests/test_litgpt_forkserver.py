"""tests/litgpt_forkserver.py, the stand-in for `subprocess.run([sys.executable, "-m", "litgpt", ...])` that several
modules use: against that real subprocess, the same exit code, stdout and stderr; a crash prints its traceback and
exits 1; a process's changes reach no later one; a command past its timeout is killed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from litgpt_forkserver import ForkServer, run_litgpt


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
    finally:
        server.close()

"""Fixtures that several test modules share."""

import socket
import subprocess
from pathlib import Path

import pytest

SLURM_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm-localhost.sh"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A working one-node Slurm on localhost (started, or found running, by scripts/slurm-localhost.sh)."""
    p = subprocess.run(["bash", str(SLURM_SCRIPT), "start"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{SLURM_SCRIPT} start failed:\n{p.stdout}\n{p.stderr}"
    return socket.gethostname().split(".")[0]

"""The `litgpt` command line: command table, per-command help, YAML configs (bad input: tests/test_bad_input.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hf_models import save_hf_model
from litgpt_forkserver import run_litgpt

from litgpt.__main__ import COMMANDS


def run(*args: str) -> subprocess.CompletedProcess:
    """`python -m litgpt ARGS`, forked from a server that imported torch and Lightning once."""
    return run_litgpt(args, cwd=Path.cwd())


def test_help_lists_every_command_without_importing_torch():
    code = (
        "import sys; from litgpt.__main__ import main; main(['--help']); "
        "assert 'torch' not in sys.modules and 'jsonargparse' not in sys.modules, 'heavy import at start-up'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for name in COMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_help(command):
    result = run(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"litgpt {command}" in result.stdout
    assert "--config" in result.stdout


def test_options_from_a_yaml_config(tmp_path):
    save_hf_model("llama", tmp_path / "hf")
    config = tmp_path / "convert.yaml"
    config.write_text(yaml.safe_dump({"checkpoint_dir": str(tmp_path / "hf"), "dtype": "bfloat16"}))
    result = run("convert_to_litgpt", "--config", str(config))
    assert result.returncode == 0, result.stderr
    from litgpt.io import load_state_dict

    state = load_state_dict(tmp_path / "hf" / "lit_model.pth")
    assert next(iter(state.values())).dtype.__repr__() == "torch.bfloat16"


def test_python_dash_m_and_console_script_agree():
    import shutil

    script = shutil.which("litgpt")
    assert script is not None, "the package is not installed with its console script"
    result = subprocess.run([script, "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == run("--help").stdout

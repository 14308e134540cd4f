"""The default precision follows what the CPU reports: bf16 where it is native (AVX512-BF16 or AMX), else float32.

Both answers are tested on real cpuinfo files (tests/fixtures/cpuinfo: this machine's first processor entry, once with
its avx512_bf16 flag and once without), read by the same code that reads /proc/cpuinfo.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from litgpt_forkserver import run_litgpt

from litgpt.precision import cpu_bf16_flags, cpu_has_fast_bf16, default_inference_dtype, default_precision_and_reason

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "cpuinfo"
WITH_BF16, WITHOUT_BF16 = str(FIXTURES / "avx512_bf16.txt"), str(FIXTURES / "no_bf16.txt")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU decides the default, not the CPU")


def test_cpu_bf16_flags_read_from_the_file(tmp_path):
    assert cpu_bf16_flags(WITH_BF16) == ["avx512_bf16"]
    assert cpu_bf16_flags(WITHOUT_BF16) == []
    amx = tmp_path / "cpuinfo"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 amx_bf16 amx_tile\n\n")
    assert cpu_bf16_flags(str(amx)) == ["amx_bf16"]
    assert cpu_bf16_flags(str(tmp_path / "missing")) is None  # not Linux: nothing reported
    assert cpu_has_fast_bf16(WITH_BF16) and not cpu_has_fast_bf16(WITHOUT_BF16)
    assert cpu_has_fast_bf16(str(tmp_path / "missing"))  # nothing known: no warning


@cpu_only
def test_default_precision_per_cpu(tmp_path):
    precision, reason = default_precision_and_reason(WITH_BF16)
    assert precision == "bf16-mixed" and "avx512_bf16" in reason
    precision, reason = default_precision_and_reason(WITHOUT_BF16)
    assert precision == "32-true" and "no native bf16" in reason
    assert default_precision_and_reason(str(tmp_path / "missing"))[0] == "32-true"
    cpu = torch.device("cpu")
    assert default_inference_dtype(cpu, WITH_BF16) == torch.bfloat16
    assert default_inference_dtype(cpu, WITHOUT_BF16) == torch.float32


@cpu_only
@pytest.mark.parametrize(("cpuinfo", "dtype"), [(WITH_BF16, torch.bfloat16), (WITHOUT_BF16, torch.float32)])
def test_generation_dtype_follows_the_cpu(monkeypatch, capsys, cpuinfo, dtype):
    from litgpt.generate import announce_precision, resolve_precision

    monkeypatch.setenv("LITGPT_CPUINFO", cpuinfo)
    assert resolve_precision(None, torch.device("cpu")) == dtype
    announce_precision(None, dtype, torch.device("cpu"))
    assert f"Precision: {dtype}" in capsys.readouterr().err
    assert resolve_precision("32-true", torch.device("cpu")) == torch.float32  # --precision wins


@cpu_only
@pytest.mark.parametrize(("cpuinfo", "precision"), [
    (WITH_BF16, "bf16-mixed"),
    pytest.param(WITHOUT_BF16, "32-true", marks=pytest.mark.slow),  # every other training test runs this default
])
def test_pretrain_says_and_uses_the_default(tmp_path, cpuinfo, precision):
    """A real one-step run: the first lines say the precision and why, and the run records it."""
    env = {**os.environ, "LITGPT_CPUINFO": cpuinfo, "OMP_NUM_THREADS": "1"}
    args = ["pretrain", "--config", "config_hub/pretrain/tiny.yaml", "--out_dir", tmp_path / "out",
            "--train.max_steps", "1", "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
            "--train.max_seq_length", "32", "--eval.max_iters", "1", "--eval.initial_validation", "false",
            "--eval.max_new_tokens", "0", "--compiler", "none"]
    # forked from a server that imported torch and Lightning once: litgpt reads LITGPT_CPUINFO when it runs
    run = run_litgpt(args, cwd=Path(__file__).resolve().parents[1], env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("Precision:"))
    assert line.startswith(f"Precision: {precision} (the default here: ")
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["precision"] == precision

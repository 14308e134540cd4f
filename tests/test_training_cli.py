"""The training commands as users type them: the bundled recipe, finetuning from YAML/flags, bad input, --profile."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import write_random_checkpoint
from litgpt_forkserver import run_litgpt

from litgpt.config import Config
from litgpt.data.tiny import TINY_DIR

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--train.max_steps", "2", "--train.log_interval", "1", "--eval.max_iters", "1", "--eval.max_new_tokens", "4"]


def litgpt(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m litgpt ARGS`, a process of its own forked from one that has imported torch and Lightning."""
    return run_litgpt(args, cwd=cwd, timeout=300)


def assert_clean_failure(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    config = Config(name="cli-test", block_size=128, vocab_size=4096, padded_vocab_size=4096, n_layer=1, n_embd=32,
                    n_head=2, intermediate_size=64, prompt_style="alpaca")
    return write_random_checkpoint(folder, config)


@pytest.fixture(scope="module")
def instructions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sft") / "data.json"
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:20]
    path.write_text(json.dumps([{"instruction": "Tell a story.", "output": s[:150]} for s in stories]))
    return path


def test_bundled_recipe_runs_and_ends_with_a_sample(tmp_path):
    result = litgpt("pretrain", "--config", "config_hub/pretrain/tiny.yaml", "--out_dir", tmp_path / "out",
                    "--data.cache_dir", tmp_path / "cache", *FAST)
    assert result.returncode == 0, result.stderr
    assert "sample:" in result.stdout and "litgpt generate" in result.stdout
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["tokens"] == 2 * 8 * 256
    generated = litgpt("generate", tmp_path / "out" / "final", "--prompt", "Once upon a time", "--max_new_tokens", "5")
    assert generated.returncode == 0, generated.stderr


@pytest.mark.parametrize("command", ["finetune_full", "finetune_lora", "finetune"])
def test_finetune_commands_from_flags(command, tmp_path, base, instructions):
    result = litgpt(command, base, "--out_dir", tmp_path / "out", "--data", "JSON", "--data.json_path", instructions,
                    "--data.val_split_fraction", "0.2", "--train.global_batch_size", "2", "--train.micro_batch_size",
                    "1", "--train.max_seq_length", "128", *FAST)
    assert result.returncode == 0, result.stderr
    final = tmp_path / "out" / "final"
    assert (final / "lit_model.pth").is_file()  # LoRA runs merge into the final checkpoint
    if command != "finetune_full":
        assert (final / "lit_model.pth.lora").is_file()
        assert (final / "hyperparameters.yaml").read_text().count("lora_r: 8") == 1


def test_qlora_from_flags_trains_adapters_over_a_quantized_base(tmp_path, base, instructions):
    result = litgpt("finetune_lora", base, "--quantize", "bnb.nf4", "--out_dir", tmp_path / "out", "--data", "JSON",
                    "--data.json_path", instructions, "--data.val_split_fraction", "0.2", "--train.global_batch_size",
                    "2", "--train.micro_batch_size", "1", "--train.max_seq_length", "128", *FAST)
    assert result.returncode == 0, result.stderr
    adapters = torch.load(tmp_path / "out" / "final" / "lit_model.pth.lora", weights_only=True)
    assert adapters and all(".lora_" in key and value.dtype == torch.float32 for key, value in adapters.items())
    assert all(value.abs().sum() > 0 for key, value in adapters.items() if ".lora_B" in key)  # B starts at zero


def test_profile_writes_a_trace(tmp_path, base, instructions):
    result = litgpt("finetune_full", base, "--out_dir", tmp_path / "out", "--data", "JSON", "--data.json_path",
                    instructions, "--data.val_split_fraction", "0.2", "--train.global_batch_size", "1",
                    "--train.micro_batch_size", "1", "--train.max_steps", "6", "--eval.max_iters", "1",
                    "--eval.max_new_tokens", "0", "--profile", "true")
    assert result.returncode == 0, result.stderr
    trace = tmp_path / "out" / "profile" / "trace-rank0.json"
    assert trace.is_file() and "traceEvents" in trace.read_text()[:2000]


# ---- bad input: one clear line, exit code 1, nothing on disk lost (the catalogue is tests/test_bad_input.py) -----------------
def test_out_dir_holding_a_run_is_refused(tmp_path, base, instructions):
    args = ["finetune_full", base, "--out_dir", tmp_path / "out", "--data", "JSON", "--data.json_path", instructions,
            "--data.val_split_fraction", "0.2", "--train.global_batch_size", "1", "--train.micro_batch_size", "1",
            *FAST]
    assert litgpt(*args).returncode == 0
    weights = (tmp_path / "out" / "final" / "lit_model.pth").read_bytes()
    assert_clean_failure(litgpt(*args), "already holds a run", "--resume auto")
    assert (tmp_path / "out" / "final" / "lit_model.pth").read_bytes() == weights

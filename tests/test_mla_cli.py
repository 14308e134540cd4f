"""Every command on a tiny DeepSeek-V3-shaped model (multi-head latent attention, a dense first layer, then shared and
routed experts with a sigmoid router, correction bias and groups), through the CLI as users type it."""

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
from litgpt.io import load_state_dict

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--train.max_steps", "2", "--train.log_interval", "1", "--eval.max_iters", "1", "--eval.max_new_tokens", "4"]
DEEPSEEK_TINY = dict(name="deepseek-tiny", hf_model_type="deepseek_v3", block_size=128, vocab_size=4096,
                     padded_vocab_size=4096, n_layer=2, n_embd=32, n_head=2, head_size=24, intermediate_size=64,
                     kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                     rope_interleaved=True, norm_eps=1e-6, prompt_style="alpaca", mlp_class_name="LLaMAMoE",
                     n_expert=4, n_expert_per_token=2, moe_intermediate_size=16, moe_n_shared_expert=1,
                     moe_score_function="sigmoid", moe_expert_bias=True, moe_n_group=2, moe_topk_group=1,
                     moe_routed_scaling=2.5, moe_first_dense_layers=1)


def litgpt(*args) -> subprocess.CompletedProcess:
    result = run_litgpt(args, cwd=ROOT, timeout=300)  # a process of its own, forked (tests/litgpt_forkserver.py)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.slow
def test_every_command_on_a_deepseek_shaped_model(tmp_path):
    base = write_random_checkpoint(tmp_path / "base", Config(**DEEPSEEK_TINY))
    data = tmp_path / "data.json"
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:20]
    data.write_text(json.dumps([{"instruction": "Tell a story.", "output": s[:150]} for s in stories]))
    finetune = ["--data", "JSON", "--data.json_path", data, "--data.val_split_fraction", "0.2",
                "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--train.max_seq_length", "128",
                *FAST]

    pretrained = litgpt("pretrain", "--model_config", base / "model_config.yaml", "--data", "Tiny",
                        "--data.cache_dir", tmp_path / "cache", "--out_dir", tmp_path / "pretrain",
                        "--train.max_seq_length", "64", "--train.global_batch_size", "2",
                        "--train.micro_batch_size", "2", *FAST)
    assert "sample:" in pretrained.stdout
    litgpt("finetune_full", base, "--out_dir", tmp_path / "full", *finetune)
    litgpt("finetune_lora", base, "--out_dir", tmp_path / "lora", "--lora_key", "true", "--lora_projection", "true",
           *finetune)
    adapters = load_state_dict(tmp_path / "lora" / "final" / "lit_model.pth.lora")
    for module in ("q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "proj"):
        assert f"transformer.h.0.attn.{module}.lora_A" in adapters, sorted(adapters)
    merged = load_state_dict(tmp_path / "lora" / "final" / "lit_model.pth")
    assert not torch.equal(merged["transformer.h.0.attn.kv_b_proj.weight"],
                           load_state_dict(base / "lit_model.pth")["transformer.h.0.attn.kv_b_proj.weight"])
    step = sorted((tmp_path / "lora").glob("step-*"))[-1]  # adapters alone, merged here
    litgpt("merge_lora", step)
    torch.testing.assert_close(load_state_dict(step / "lit_model.pth"), merged, rtol=0, atol=0)
    generated = litgpt("generate", step, "--prompt", "Once upon a time", "--max_new_tokens", "5")
    assert generated.stdout.strip()
    litgpt("convert_from_litgpt", step, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["kv_lora_rank"] == 16


@pytest.mark.slow
def test_fsdp_with_two_processes_equals_one(tmp_path):
    """finetune_lora (adapters on every latent attention projection and every expert) on the DeepSeek-shaped model:
    two FSDP processes give the losses and adapters of one process on the same global batch."""
    from test_distributed import assert_close_runs, command_args
    from test_distributed import litgpt as run_litgpt

    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:40]
    inputs = {"base": write_random_checkpoint(tmp_path / "base", Config(**DEEPSEEK_TINY)),
              "instructions": tmp_path / "instructions.json", "root": tmp_path}
    inputs["instructions"].write_text(json.dumps([{"instruction": "Go on.", "output": s[:200]} for s in stories]))
    runs = {}
    for devices in ("1", "2"):
        runs[devices] = tmp_path / f"devices-{devices}"
        args = command_args("finetune_lora", inputs, runs[devices])
        result = run_litgpt(*args, "--lora_key", "true", "--lora_projection", "true", "--devices", devices)
        assert result.returncode == 0, result.stderr
    assert_close_runs(runs["2"], runs["1"], "lit_model.pth.lora")

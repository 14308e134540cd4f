"""--train.optimizer_in_backward against the optimizer stepped after the backward pass: the same losses and weights
on one process (pretrain, finetune full and LoRA) and on two FSDP processes, and exact resumes (the distillation
run is in tests/test_distill.py, the refused settings in tests/test_bad_input.py, a non-finite loss in
tests/test_fault_tolerance.py, the plan in tests/test_plan.py)."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import write_random_checkpoint
from data_helpers import write_story_files

from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import JSON, TextFiles
from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR
from litgpt.io import load_state_dict

ROOT = Path(__file__).resolve().parents[1]

SMALL = dict(
    name="oib-llama", block_size=128, vocab_size=4096, padded_vocab_size=4096, n_layer=2, n_embd=64, n_head=4,
    n_query_groups=2, intermediate_size=128,
)
ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "weight_decay": 0.1}}
# One micro-batch per step and no clipping: what the option needs; the schedule warms up and decays on the way.
STEPS = dict(global_batch_size=2, micro_batch_size=2, max_steps=4, lr_warmup_steps=2, save_interval=2,
             log_interval=1, max_seq_length=32, min_lr=1e-4, max_norm=None)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    return write_story_files(tmp_path_factory.mktemp("stories"), 60)


@pytest.fixture(scope="module")
def finetune_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A random base checkpoint and twenty instruction records."""
    root = tmp_path_factory.mktemp("finetune")
    base = write_random_checkpoint(root / "base", Config(**SMALL, prompt_style="alpaca"))
    records = root / "records.jsonl"
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:20]
    records.write_text("".join(json.dumps({"instruction": "Go on.", "output": s[:120]}) + "\n" for s in stories))
    return base, records


def pretrain(out_dir: Path, text_folder: Path, in_backward: bool, resume=False) -> None:
    from litgpt.pretrain import setup

    setup(model_config=Config(**SMALL), out_dir=out_dir,
          data=TextFiles(text_folder, cache_dir=out_dir.parent / "cache"),
          train=TrainArgs(**STEPS, optimizer_in_backward=in_backward), eval=EvalArgs(interval=1000, max_iters=1),
          optimizer=ADAMW, devices=1, tokenizer_dir=TOKENIZER_DIR, resume=resume, seed=7)


def finetune(kind: str, out_dir: Path, inputs: tuple[Path, Path], in_backward: bool) -> None:
    """`finetune_full` or `finetune_lora` (adapters on every linear layer) of the random base on the records."""
    from litgpt.finetune import full, lora

    base, records = inputs
    common = dict(out_dir=out_dir, data=JSON(records, val_split_fraction=0.2, prompt_style="default"),
                  train=TrainArgs(**STEPS, optimizer_in_backward=in_backward),
                  eval=EvalArgs(interval=1000, max_iters=1, max_new_tokens=0), optimizer=ADAMW, devices=1, seed=3)
    if kind == "full":
        full.setup(base, **common)
    else:
        lora.setup(base, **common, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_mlp=True)


def losses(out_dir: Path) -> list[float]:
    (log,) = Path(out_dir).rglob("metrics.csv")
    with open(log) as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row.get("loss")]


def assert_same_run(run: Path, reference: Path, weights_file: str, atol: float) -> None:
    ours, theirs = losses(run), losses(reference)
    assert len(ours) == len(theirs) == STEPS["max_steps"]
    assert min(theirs) > 0.5, f"the runs learn from no token: {theirs}"
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=atol)
    a, b = load_state_dict(run / "final" / weights_file), load_state_dict(reference / "final" / weights_file)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def drop_after_step_2(out_dir: Path) -> None:
    """Make a 4-step run look as if it had stopped right after saving step 2."""
    for folder in (out_dir / "step-000004", out_dir / "final"):
        shutil.rmtree(folder)
    (out_dir / "metrics.json").unlink()


def test_pretrain_equals_the_optimizer_after_backward(tmp_path, text_folder):
    pretrain(tmp_path / "after", text_folder, in_backward=False)
    pretrain(tmp_path / "in_backward", text_folder, in_backward=True)
    assert_same_run(tmp_path / "in_backward", tmp_path / "after", "lit_model.pth", atol=1e-6)


@pytest.mark.parametrize(("kind", "weights_file"), [("full", "lit_model.pth"), ("lora", "lit_model.pth.lora")])
def test_finetune_equals_the_optimizer_after_backward(tmp_path, finetune_inputs, kind, weights_file):
    """With LoRA only the adapters train: only they are stepped, the frozen base stays as loaded."""
    finetune(kind, tmp_path / "after", finetune_inputs, in_backward=False)
    finetune(kind, tmp_path / "in_backward", finetune_inputs, in_backward=True)
    assert_same_run(tmp_path / "in_backward", tmp_path / "after", weights_file, atol=1e-6)


def test_resume_equals_an_uninterrupted_run(tmp_path, text_folder, capsys):
    """Stopped after step 2's checkpoint and resumed: the per-parameter optimizer states come back bit for bit."""
    pretrain(tmp_path / "whole", text_folder, in_backward=True)
    pretrain(tmp_path / "stopped", text_folder, in_backward=True)
    drop_after_step_2(tmp_path / "stopped")
    capsys.readouterr()
    pretrain(tmp_path / "stopped", text_folder, in_backward=True, resume="auto")
    assert "Training 4 steps from step 2" in capsys.readouterr().out
    whole = torch.load(tmp_path / "whole" / "step-000004" / "training_state.pth", weights_only=True)
    resumed = torch.load(tmp_path / "stopped" / "step-000004" / "training_state.pth", weights_only=True)
    assert whole["train_state"]["step"] == resumed["train_state"]["step"] == 4
    for name, state in whole["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(resumed["optimizer"]["state"][name][key], value, rtol=0, atol=0)
    a, b = load_state_dict(tmp_path / "whole" / "final" / "lit_model.pth"), \
        load_state_dict(tmp_path / "stopped" / "final" / "lit_model.pth")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_a_run_resumes_with_the_option_switched_on(tmp_path, text_folder):
    """The checkpoints hold the same name-keyed optimizer state either way: a run of the optimizer after the backward
    pass, resumed from step 2 with the option, ends where it would have ended without it."""
    pretrain(tmp_path / "run", text_folder, in_backward=False)
    uninterrupted = load_state_dict(tmp_path / "run" / "final" / "lit_model.pth")
    drop_after_step_2(tmp_path / "run")
    pretrain(tmp_path / "run", text_folder, in_backward=True, resume="auto")
    resumed = load_state_dict(tmp_path / "run" / "final" / "lit_model.pth")
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=0, atol=1e-7, msg=key)


# ---- FSDP2: two gloo processes ---------------------------------------------------------------------------------------
def litgpt_pretrain(out_dir: Path, text_folder: Path, devices: int, *flags: str):
    """`litgpt pretrain` in its own process(es) on the CPU, a global batch of 2 samples."""
    from litgpt_forkserver import run_litgpt

    config = out_dir.parent / "model.yaml"
    config.write_text(json.dumps({"model_config": SMALL}))
    args = ["pretrain", "--config", config, "--tokenizer_dir", TOKENIZER_DIR, "--data", "TextFiles",
            "--data.train_data_path", text_folder, "--data.cache_dir", out_dir.parent / f"cache-{out_dir.name}",
            "--out_dir", out_dir, "--devices", devices, "--seed", "5", "--train.global_batch_size", "2",
            "--train.micro_batch_size", str(2 // devices), "--train.max_steps", "4", "--train.lr_warmup_steps", "1",
            "--train.max_seq_length", "64", "--train.max_norm", "null", "--train.save_interval", "2",
            "--eval.interval", "1000", "--eval.max_iters", "1", "--optimizer.class_path", "torch.optim.AdamW",
            "--optimizer.init_args.lr", "0.003", "--optimizer.init_args.eps", "1e-6", *flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    result = run_litgpt([str(arg) for arg in args], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.slow  # two real runs of two processes and one of one (~40 s)
def test_two_fsdp_processes_equal_one_process(tmp_path, text_folder):
    """Two FULL_SHARD ranks step their shards in the backward pass, from the reduce-scattered (averaged) gradient:
    the run of one process with the optimizer after the backward pass, to float32 rounding; and its sharded
    checkpoint of step 2 resumes to the same end."""
    litgpt_pretrain(tmp_path / "one", text_folder, 1)
    two = ["--train.optimizer_in_backward", "true", "--fsdp.state_dict_type", "sharded"]
    litgpt_pretrain(tmp_path / "two", text_folder, 2, *two)
    assert_same_run(tmp_path / "two", tmp_path / "one", "lit_model.pth", atol=1e-5)
    shutil.copytree(tmp_path / "two", tmp_path / "resumed", ignore=shutil.ignore_patterns("step-000004", "final"))
    (tmp_path / "resumed" / "metrics.json").unlink()
    result = litgpt_pretrain(tmp_path / "resumed", text_folder, 2, *two, "--resume", "auto")
    assert "Training 4 steps from step 2" in result.stdout
    a, b = (load_state_dict(tmp_path / run / "final" / "lit_model.pth") for run in ("two", "resumed"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-7, msg=key)

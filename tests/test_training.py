"""The training entry points, run for real on tiny models: loss falls, accumulation is exact, resume is exact."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_helpers import write_random_checkpoint

from litgpt.args import EvalArgs, TrainArgs
from litgpt.io import load_state_dict
from litgpt.config import Config
from litgpt.data import JSON, TextFiles
from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR
from litgpt.errors import UserError

SMALL = dict(
    name="test-llama", block_size=128, vocab_size=4096, padded_vocab_size=4096, n_layer=2, n_embd=64, n_head=4,
    n_query_groups=2, intermediate_size=128,
)
OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "weight_decay": 0.1}}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    """About 60 KB of the bundled stories as a folder of .txt files (one story each)."""
    folder = tmp_path_factory.mktemp("stories")
    stories = (TINY_DIR / "train.txt").read_text().split("\n\n")[:120]
    for i, story in enumerate(stories):
        (folder / f"{i:03d}.txt").write_text(story)
    return folder


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> Path:
    """A random small model saved as a litgpt checkpoint with the bundled tokenizer."""
    return write_random_checkpoint(tmp_path_factory.mktemp("base"), Config(**SMALL, prompt_style="alpaca"))


@pytest.fixture(scope="module")
def instructions(tmp_path_factory) -> Path:
    """Forty instruction records made from the stories: continue a story from its first sentence."""
    path = tmp_path_factory.mktemp("sft") / "stories.jsonl"
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:40]
    with open(path, "w") as f:
        for story in stories:
            first, _, rest = story.partition(". ")
            f.write(json.dumps({"instruction": "Continue the story.", "input": first + ".", "output": rest[:200]}) + "\n")
    return path


def pretrain(out_dir: Path, text_folder: Path, **train_overrides):
    from litgpt.pretrain import setup

    train = dict(global_batch_size=4, micro_batch_size=2, max_steps=6, lr_warmup_steps=2, save_interval=3,
                 log_interval=1, max_seq_length=32, min_lr=1e-4)
    train.update(train_overrides)
    resume = train.pop("resume", False)
    optimizer = train.pop("optimizer", OPTIMIZER)
    setup(
        model_config=Config(**SMALL), out_dir=out_dir, data=TextFiles(text_folder, cache_dir=out_dir.parent / "cache"),
        train=TrainArgs(**train), eval=EvalArgs(interval=1000, max_iters=2), optimizer=optimizer, devices=1,
        tokenizer_dir=TOKENIZER_DIR, resume=resume, seed=7,
    )


def weights(folder: Path, name: str = "lit_model.pth") -> dict:
    return {k: v.clone() for k, v in load_state_dict(folder / name).items()}


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def test_matmul_peak_grows_the_matrices_only_while_they_stay_quick():
    """MFU's measured peak: a dtype the device multiplies slowly is measured on smaller matrices (bf16 on this CPU
    would otherwise spend minutes on 2048^3 matmuls at the end of every run); the FLOP/s are those of the side used."""
    from litgpt.train.metrics import measured_matmul_flops

    cpu = torch.device("cpu")
    flops, side = measured_matmul_flops(cpu, torch.float32, size=2048, seconds=1e-9)  # no matmul is quick enough
    assert side == 256 and flops > 0
    # every size is: a 512^3 matmul takes milliseconds, far under 2 s / 8 (and the timing loop runs only 2 s)
    flops, side = measured_matmul_flops(cpu, torch.float32, size=512, seconds=2)
    assert side == 512 and flops > 0


def test_the_matmul_peak_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    """MFU's peak is a hardware limit: measured the first time, then read from the cache folder (per device, dtype,
    thread count and torch version); a cache file that is not one is measured again and replaced."""
    from litgpt.train.metrics import matmul_peak

    monkeypatch.setenv("LITGPT_CACHE_DIR", str(tmp_path))
    cpu, kept = torch.device("cpu"), tmp_path / "matmul-peaks.json"
    flops, source = matmul_peak(cpu, torch.float32, "test cpu")
    (key, entry), = json.loads(kept.read_text()).items()
    assert entry["flops"] == flops > 0 and source.startswith("measured") and str(kept) in source
    assert key.startswith("test cpu | torch.float32 | 1 threads")  # this module runs on one thread
    kept.write_text(json.dumps({key: {"flops": 1.5e9, "side": 64}}))
    flops, source = matmul_peak(cpu, torch.float32, "test cpu")
    assert flops == 1.5e9 and source.startswith("measured: 64^3 torch.float32")
    assert matmul_peak(cpu, torch.bfloat16, "test cpu")[0] != 1.5e9  # another dtype: measured, kept beside
    assert len(json.loads(kept.read_text())) == 2
    kept.write_text("{not json")
    assert matmul_peak(cpu, torch.float32, "test cpu")[0] != 1.5e9
    assert list(json.loads(kept.read_text())) == [key]


def test_loss_falls_and_outputs_are_complete(tmp_path, text_folder):
    pretrain(tmp_path / "run", text_folder, max_steps=40, save_interval=20, lr_warmup_steps=5)
    out = tmp_path / "run"
    metrics = json.loads((out / "metrics.json").read_text())
    # A random 4096-way model starts near ln(4096) = 8.3 nats; 40 small steps bring it near 6.
    assert metrics["val_loss"] < 0.8 * math.log(4096), metrics
    assert metrics["steps"] == 40 and metrics["tokens"] == 40 * 4 * 32
    assert metrics["tokens_per_sec"] > 0 and metrics["world_size"] == 1 and metrics["peak_memory_mb"] > 0
    assert 0 < metrics["mfu"] < 1.5 and metrics["peak_flops_source"].startswith("measured")
    assert metrics["wall_seconds"] >= metrics["train_seconds"] > 0
    for folder in ("step-000020", "step-000040", "final"):
        assert (out / folder / "lit_model.pth").is_file()
        assert (out / folder / "model_config.yaml").is_file()
        assert (out / folder / "tokenizer.json").is_file()
        hparams = yaml.safe_load((out / folder / "hyperparameters.yaml").read_text())
        assert hparams["train"]["max_steps"] == 40 and hparams["data"]["class_path"].endswith("TextFiles")
    assert (out / "step-000020" / "training_state.pth").is_file()
    assert json.loads((out / "run_args.json").read_text())["arguments"]["seed"] == 7
    # The final checkpoint works with generate as it is.
    from litgpt.generate import generate, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(out / "final", device="cpu")
    assert len(list(generate(model, tokenizer.encode("Once upon a time"), 5, temperature=0.0))) <= 5


SGD = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.9}}


@pytest.mark.parametrize(("optimizer", "atol"), [(SGD, 1e-6), (OPTIMIZER, 1e-4)])
def test_gradient_accumulation_equals_a_bigger_micro_batch(tmp_path, text_folder, optimizer, atol):
    """2 micro-batches of 2 give the gradients of one of 4 (to float32 rounding, ~1e-9 here).

    SGD passes that on: weights agree within 1e-6. Adam divides by the gradient's own magnitude, so for elements
    whose gradient is near its eps (1e-8) the rounding difference is amplified: compare at 1e-4 there.
    """
    pretrain(tmp_path / "accumulated", text_folder, micro_batch_size=2, max_steps=3, optimizer=optimizer)
    pretrain(tmp_path / "single", text_folder, micro_batch_size=4, max_steps=3, optimizer=optimizer)
    assert_same_weights(weights(tmp_path / "accumulated" / "final"), weights(tmp_path / "single" / "final"), atol)


def drop_after(out_dir: Path, step: int) -> None:
    """Make the run look as if it had been stopped right after saving `step`."""
    for folder in out_dir.iterdir():
        if folder.name == "final" or (folder.name.startswith("step-") and int(folder.name[5:]) > step):
            shutil.rmtree(folder)
    (out_dir / "metrics.json").unlink()


def test_pretrain_resume_equals_an_uninterrupted_run(tmp_path, text_folder):
    # ~114 training stories of ~170 tokens make ~320 windows of 60 tokens: 8 steps of 60 samples wrap an epoch.
    long_run = dict(max_steps=8, save_interval=4, max_seq_length=60, global_batch_size=60, micro_batch_size=30)
    pretrain(tmp_path / "whole", text_folder, **long_run)
    pretrain(tmp_path / "stopped", text_folder, **long_run)
    drop_after(tmp_path / "stopped", 4)
    pretrain(tmp_path / "stopped", text_folder, **long_run, resume="auto")
    whole = torch.load(tmp_path / "whole" / "step-000008" / "training_state.pth", weights_only=True)
    resumed = torch.load(tmp_path / "stopped" / "step-000008" / "training_state.pth", weights_only=True)
    assert whole["train_state"]["epoch"] >= 1, "the run should cross an epoch boundary"
    for key in ("step", "epoch", "epoch_samples", "tokens"):
        assert whole["train_state"][key] == resumed["train_state"][key], key
    assert_same_weights(weights(tmp_path / "whole" / "final"), weights(tmp_path / "stopped" / "final"), 0)


def finetune(kind: str, out_dir: Path, base: Path, data_path: Path, resume=False, optimizer=OPTIMIZER,
             **train_overrides):
    train = dict(global_batch_size=4, micro_batch_size=2, max_steps=6, lr_warmup_steps=2, save_interval=3,
                 log_interval=1, max_seq_length=128, min_lr=1e-4)
    train.update(train_overrides)
    common = dict(
        out_dir=out_dir, data=JSON(data_path, val_split_fraction=0.2), train=TrainArgs(**train),
        eval=EvalArgs(interval=1000, max_iters=2, max_new_tokens=None), optimizer=optimizer, devices=1,
        resume=resume, seed=3,
    )
    if kind == "full":
        from litgpt.finetune.full import setup

        setup(base, **common)
    else:
        from litgpt.finetune.lora import setup

        setup(base, lora_r=4, lora_alpha=8, lora_dropout=0.1, lora_mlp=True, lora_head=True, **common)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_finetune_resume_equals_an_uninterrupted_run(kind, tmp_path, base_checkpoint, instructions):
    finetune(kind, tmp_path / "whole", base_checkpoint, instructions)
    finetune(kind, tmp_path / "stopped", base_checkpoint, instructions)
    drop_after(tmp_path / "stopped", 3)
    finetune(kind, tmp_path / "stopped", base_checkpoint, instructions, resume="auto")
    name = "lit_model.pth" if kind == "full" else "lit_model.pth.lora"
    assert_same_weights(weights(tmp_path / "whole" / "final", name), weights(tmp_path / "stopped" / "final", name), 0)


def test_finetune_lowers_validation_loss(tmp_path, base_checkpoint, instructions):
    from litgpt.data.base import MicroBatches
    from litgpt.generate import load_model_and_tokenizer
    from litgpt.prompts import PromptStyle
    from litgpt.train.loss import cross_entropy

    def val_loss(checkpoint: Path) -> float:
        model, tokenizer = load_model_and_tokenizer(checkpoint, device="cpu")
        data = JSON(instructions, val_split_fraction=0.2)
        data.connect(tokenizer, 128, PromptStyle.from_config(model.config))
        data.prepare()
        batch = next(MicroBatches(data.val_dataset(), 8, seed=0, shuffle=False).iterate())[2]
        with torch.no_grad():
            return cross_entropy(model(batch["input_ids"]), batch["labels"]).item()

    before = val_loss(base_checkpoint)
    finetune("full", tmp_path / "full", base_checkpoint, instructions, max_steps=30, save_interval=None)
    full = val_loss(tmp_path / "full" / "final")
    finetune("lora", tmp_path / "lora", base_checkpoint, instructions, max_steps=30, save_interval=None,
             optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-2}})
    lora = val_loss(tmp_path / "lora" / "final")
    assert full < before - 2.0 and lora < before - 1.0, (before, full, lora)
    # LoRA checkpoints hold the adapters alone; the final one also has the merged weights.
    adapters = load_state_dict(tmp_path / "lora" / "final" / "lit_model.pth.lora")
    assert all("lora_" in key for key in adapters)
    assert (tmp_path / "lora" / "final" / "lit_model.pth").is_file()


# ---- bad input -------------------------------------------------------------------------------------------------------------
def test_refuses_to_overwrite_a_run(tmp_path, text_folder):
    pretrain(tmp_path / "run", text_folder, max_steps=2, save_interval=None)
    before = (tmp_path / "run" / "final" / "lit_model.pth").read_bytes()
    with pytest.raises(UserError, match="already holds a run.*--resume auto"):
        pretrain(tmp_path / "run", text_folder, max_steps=2, save_interval=None)
    assert (tmp_path / "run" / "final" / "lit_model.pth").read_bytes() == before


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(global_batch_size=6, micro_batch_size=4), "multiple of train.micro_batch_size"),
        (dict(max_seq_length=129), "longer than the model's block size 128"),
        (dict(resume=Path("/nonexistent/step-000003")), "not a checkpoint folder"),
        (dict(max_steps=None, max_tokens=None), "Set how long to train"),
        (dict(max_steps=0), "max_steps must be at least 1"),
    ],
)
def test_bad_training_arguments(tmp_path, text_folder, overrides, match):
    with pytest.raises(UserError, match=match):
        pretrain(tmp_path / "run", text_folder, **overrides)
    assert not (tmp_path / "run" / "final").exists()


def test_tokenizer_larger_than_the_model(tmp_path, text_folder):
    from litgpt.pretrain import setup

    with pytest.raises(UserError, match="4096 tokens but the model has only 1024"):
        setup(model_config=Config(**{**SMALL, "vocab_size": 1024, "padded_vocab_size": 1024}), out_dir=tmp_path,
              data=TextFiles(text_folder, cache_dir=tmp_path / "cache"), tokenizer_dir=TOKENIZER_DIR, devices=1,
              train=TrainArgs(max_steps=1))


def test_every_config_hub_recipe_parses():
    from jsonargparse import ArgumentParser

    from litgpt.__main__ import COMMANDS

    recipes = sorted(Path(__file__).parents[1].joinpath("config_hub").rglob("*.yaml"))
    assert recipes
    for recipe in recipes:
        command = "pretrain" if "pretrain" in recipe.parts else ("finetune_lora" if recipe.stem.startswith(("lora", "qlora")) else "finetune_full")
        module, function = COMMANDS[command][0].split(":")
        import importlib

        parser = ArgumentParser(exit_on_error=False)
        parser.add_function_arguments(getattr(importlib.import_module(module), function), as_positional=True)
        parser.add_argument("--config", action="config")
        parsed = parser.parse_args(["--config", str(recipe)])
        assert parsed is not None, recipe


def test_tensorboard_logger_writes_events(tmp_path, text_folder):
    from litgpt.pretrain import setup

    setup(model_config=Config(**SMALL), out_dir=tmp_path / "run", data=TextFiles(text_folder, cache_dir=tmp_path / "c"),
          train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32, lr_warmup_steps=1),
          eval=EvalArgs(interval=1000, max_iters=1), devices=1, tokenizer_dir=TOKENIZER_DIR, logger_name="tensorboard")
    events = list((tmp_path / "run" / "logs").rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_continued_pretraining_starts_from_the_given_weights(tmp_path, base_checkpoint, text_folder):
    """With a vanishing learning rate, one step from --initial_checkpoint_dir leaves the given weights in place."""
    from litgpt.pretrain import setup

    setup(initial_checkpoint_dir=base_checkpoint, out_dir=tmp_path / "run",
          data=TextFiles(text_folder, cache_dir=tmp_path / "c"), devices=1,
          train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=32, lr_warmup_steps=1,
                          min_lr=0.0),
          eval=EvalArgs(interval=1000, max_iters=1), optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 1e-12}})
    assert_same_weights(weights(base_checkpoint), weights(tmp_path / "run" / "final"), 1e-9)
    assert (tmp_path / "run" / "final" / "tokenizer.json").is_file()  # the tokenizer came from the checkpoint

"""The recipes of config_hub/: each one parses with its command's own parser, builds its arguments, names a model
that exists, has batch arithmetic and sequence lengths the run will accept, and appears in config_hub/README.md.
The debug recipe, and the structure of the finetuning recipes, also run end to end through the CLI."""

from __future__ import annotations

import functools
import importlib
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
import litgpt_forkserver

from litgpt.__main__ import COMMANDS
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.configs import configs_by_name
from litgpt.data.base import DataModule
from litgpt.train.optimizer import build_optimizer
from litgpt.precision import PRECISIONS
from litgpt.quantize import QUANTIZE_MODES

ROOT = Path(__file__).resolve().parents[1]
HUB = ROOT / "config_hub"
RECIPES = sorted(HUB.rglob("*.yaml"))
PRETRAIN = [r for r in RECIPES if "pretrain" in r.relative_to(HUB).parts]
FINETUNE = [r for r in RECIPES if "finetune" in r.relative_to(HUB).parts]


def recipe_id(recipe: Path) -> str:
    return recipe.relative_to(HUB).as_posix()


def command_for(recipe: Path) -> str:
    """The command a recipe is for, decided from its path as test_training.py and the README do."""
    if "pretrain" in recipe.relative_to(HUB).parts:
        return "pretrain"
    return "finetune_lora" if recipe.stem.startswith(("lora", "qlora")) else "finetune_full"


@functools.lru_cache(maxsize=None)
def parser_for(command: str):
    from jsonargparse import ArgumentParser

    module, function = COMMANDS[command][0].split(":")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(getattr(importlib.import_module(module), function), as_positional=True)
    parser.add_argument("--config", action="config")
    return parser


@functools.lru_cache(maxsize=None)
def parsed(recipe: Path):
    """(namespace, instantiated namespace) of a recipe, read by the real parser of its command."""
    parser = parser_for(command_for(recipe))
    namespace = parser.parse_args(["--config", str(recipe)])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    return namespace, instantiate(namespace)


def raw(recipe: Path) -> dict:
    return yaml.safe_load(recipe.read_text())


@functools.lru_cache(maxsize=None)
def registry() -> dict[str, dict]:
    return configs_by_name()


def registered_repos() -> dict[str, str]:
    """"org/name" of each registered model's hub repo -> the registered name."""
    return {f"{v['hf_config']['org']}/{v['hf_config']['name']}": name for name, v in registry().items()}


def model_of(recipe: Path) -> Config:
    """The model a recipe trains: its model_name or model_config, or the registered model its checkpoint_dir holds."""
    args = parsed(recipe)[1]
    if command_for(recipe) == "pretrain":
        if args.model_config is not None:
            return args.model_config
        return Config.from_name(args.model_name)
    repo = "/".join(Path(args.checkpoint_dir).parts[-2:])
    return Config.from_name(registered_repos()[repo])


def test_the_hub_has_the_expected_recipes():
    names = {recipe_id(r) for r in RECIPES}
    for pretrain in ("debug", "tiny", "tinyllama", "pythia-160m", "llama-3.2-1b"):
        assert f"pretrain/{pretrain}.yaml" in names
    models = {r.parent.name for r in FINETUNE}
    assert models == {"tiny-llama-1.1b", "Llama-3.2-1B", "Llama-3.1-8B", "Mistral-7B-v0.1", "Qwen2.5-7B", "phi-4",
                      "gemma-2-2b", "SmolLM2-135M"}
    for model in models:
        assert {"lora.yaml", "qlora.yaml"} <= {r.name for r in FINETUNE if r.parent.name == model}, model
        if model != "phi-4":  # 14.7B: full finetuning needs ~120 GB, more than one GPU holds
            assert (HUB / "finetune" / model / "full.yaml").is_file(), model
    assert all(r.name in ("full.yaml", "lora.yaml", "qlora.yaml") for r in FINETUNE)


# ---- (1) parse with the entry point's parser and build the arguments -------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_recipe_parses_and_builds_its_arguments(recipe):
    namespace, args = parsed(recipe)
    data = raw(recipe).get("data")
    assert data is not None, f"{recipe_id(recipe)} should name its data module"
    named = data if isinstance(data, str) else data["class_path"]
    assert isinstance(args.data, DataModule)
    assert type(args.data).__name__ == named.rpartition(".")[2]
    for key, value in ((data.get("init_args") or {}) if isinstance(data, dict) else {}).items():
        assert str(getattr(args.data, key)) == str(value), (recipe_id(recipe), key)
    assert isinstance(args.train, TrainArgs) and isinstance(args.eval, EvalArgs)
    args.train.check()  # the entry point's own check: positive limits and intervals
    assert any(getattr(args.train, k) is not None for k in ("epochs", "max_steps", "max_tokens")), "no run length"
    assert args.eval.interval >= 1 and args.eval.max_iters >= 1
    assert args.precision is None or args.precision in PRECISIONS
    assert args.logger_name in ("csv", "tensorboard", "wandb")
    # The optimizer spec builds a real optimizer (class found, init_args accepted).
    spec = args.optimizer
    assert isinstance(spec, dict) and spec["class_path"].endswith("AdamW")
    optimizer = build_optimizer(spec, [torch.nn.Parameter(torch.zeros(2))], torch.device("cpu"))
    assert optimizer.param_groups[0]["lr"] == spec["init_args"]["lr"]
    assert 0.0 < args.train.min_lr <= spec["init_args"]["lr"] or args.train.min_lr == 0.0
    # The YAML holds only keys the parser knows, so nothing in it is silently ignored.
    assert set(raw(recipe)) <= set(vars(namespace)) - {"config"}


@pytest.mark.parametrize("recipe", [r for r in FINETUNE if r.stem in ("lora", "qlora")], ids=recipe_id)
def test_lora_recipes(recipe):
    args = parsed(recipe)[1]
    assert args.lora_r >= 1 and args.lora_alpha >= 1 and 0.0 <= args.lora_dropout < 1.0
    assert any((args.lora_query, args.lora_key, args.lora_value, args.lora_projection, args.lora_mlp))
    if args.lora_head:
        assert not model_of(recipe).tie_embeddings, "lora_head cannot adapt a head tied to the embeddings"
    assert args.precision == "bf16-true"
    if recipe.stem == "qlora":
        assert args.quantize == "bnb.nf4" and args.quantize in QUANTIZE_MODES
    else:
        assert args.quantize is None


@pytest.mark.parametrize("recipe", [r for r in FINETUNE if r.stem == "full"], ids=recipe_id)
def test_full_recipes(recipe):
    args = parsed(recipe)[1]
    assert args.precision == "bf16-true"
    from litgpt.model import GPT

    with torch.device("meta"):
        parameters = sum(p.numel() for p in GPT(model_of(recipe)).parameters())
    if parameters > 5e9:  # the 7-8B models (8 bytes per parameter) fit one 80 GB GPU only this way
        assert args.train.activation_checkpointing and args.train.micro_batch_size == 1
    else:
        assert not args.train.activation_checkpointing  # no need to pay ~30% speed for memory on the small ones


# ---- (2) a registered model ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", PRETRAIN, ids=recipe_id)
def test_pretrain_recipe_names_a_model(recipe):
    args = parsed(recipe)[1]
    assert (args.model_name is None) != (args.model_config is None), "give either model_name or model_config"
    if args.model_name is not None:
        assert args.model_name in registry(), args.model_name
    if args.tokenizer_dir is not None:
        # `litgpt download ORG/NAME --tokenizer_only true` puts it there; its vocabulary must fit the model.
        repo = "/".join(Path(args.tokenizer_dir).parts[-2:])
        assert Path(args.tokenizer_dir).parts[0] == "checkpoints"
        assert repo in registered_repos(), repo
        assert registry()[registered_repos()[repo]]["vocab_size"] <= model_of(recipe).padded_vocab_size
    else:
        assert getattr(args.data, "tokenizer_dir", None) is not None, "no tokenizer: set tokenizer_dir"


@pytest.mark.parametrize("recipe", FINETUNE, ids=recipe_id)
def test_finetune_recipe_names_a_model(recipe):
    args = parsed(recipe)[1]
    checkpoint_dir = Path(args.checkpoint_dir)
    # checkpoints/ORG/NAME, where `litgpt download ORG/NAME` puts it, for a registered model's repo...
    assert checkpoint_dir.parts[0] == "checkpoints" and len(checkpoint_dir.parts) == 3, checkpoint_dir
    names = {v["hf_config"]["name"]: name for name, v in registry().items()}
    assert checkpoint_dir.name in names, f"{checkpoint_dir.name} is no registered model's hf_config name"
    repo = "/".join(checkpoint_dir.parts[-2:])
    assert repo in registered_repos(), repo
    # ...and the folder the recipe sits in is that model's registered name.
    assert registered_repos()[repo] == recipe.parent.name
    assert str(args.out_dir).startswith(f"out/finetune/{recipe.parent.name}/")


# ---- (3) batch arithmetic ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_batch_arithmetic_divides(recipe):
    train = parsed(recipe)[1].train
    assert train.micro_batch_size >= 1
    assert train.global_batch_size % train.micro_batch_size == 0
    assert train.gradient_accumulation_iters(1) == train.global_batch_size // train.micro_batch_size
    devices = parsed(recipe)[1].devices
    if isinstance(devices, int):
        train.gradient_accumulation_iters(devices)  # the run's own check: raises when it does not divide


# ---- (4) sequence length, schedule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_sequence_length_fits_the_model(recipe):
    args = parsed(recipe)[1]
    config = model_of(recipe)
    length = args.train.seq_length(config)  # the run's own check
    assert length <= config.block_size
    if command_for(recipe) != "pretrain":
        assert args.train.max_seq_length == 512  # set explicitly: the default (the block size) can be 131,072


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_warmup_is_a_small_part_of_the_run(recipe):
    args = parsed(recipe)[1]
    train = args.train
    length = train.seq_length(model_of(recipe))
    limits = []
    if train.max_steps is not None:
        limits.append(train.max_steps)
    if train.max_tokens is not None:
        limits.append(math.ceil(train.max_tokens / (train.global_batch_size * length)))
    if train.epochs is not None:
        # The finetuning sets: Alpaca has 51,760 records, Alpaca2k 2,000.
        records = {"Alpaca": 51_760, "Alpaca2k": 2_000}[type(args.data).__name__]
        train_records = records - math.ceil(records * args.data.val_split_fraction)
        limits.append(math.floor(train.epochs * train_records / train.global_batch_size))
    total = min(limits)
    assert train.lr_warmup_steps < total * 0.25, (train.lr_warmup_steps, total)
    assert args.eval.interval <= total or args.eval.final_validation
    if train.save_interval is not None:
        assert train.save_interval <= total or command_for(recipe) == "pretrain"


# ---- README --------------------------------------------------------------------------------------------------------
def test_readme_lists_every_recipe_with_its_command():
    readme = (HUB / "README.md").read_text()
    # "litgpt CMD --config config_hub/PATH" -> {PATH: CMD}; the placeholder "<recipe>" is no file.
    commands = {path: command for command, path in re.findall(
        r"litgpt (pretrain|finetune_full|finetune_lora) --config config_hub/(\S+?\.yaml)", readme)
        if "<" not in path}
    linked = set(re.findall(r"\]\(((?:pretrain|finetune)/[^)]+\.yaml)\)", readme))
    for recipe in RECIPES:
        assert recipe_id(recipe) in linked, f"README.md does not link {recipe_id(recipe)}"
    for path in linked:
        assert (HUB / path).is_file(), f"README.md links a missing recipe {path}"
    for path, command in commands.items():
        assert (HUB / path).is_file(), path
        assert command == command_for(HUB / path), (path, command)
    for recipe in FINETUNE:
        assert recipe_id(recipe) in commands, f"README.md gives no command for {recipe_id(recipe)}"
        repo = "/".join(Path(parsed(recipe)[1].checkpoint_dir).parts[-2:])
        assert f"litgpt download {repo}" in readme, repo
    assert "overridden on the command line" in readme


# ---- (5) the debug recipe runs ---------------------------------------------------------------------------------------
def run_litgpt(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m litgpt ARGS`, a process of its own forked from one that has imported torch and Lightning."""
    return litgpt_forkserver.run_litgpt(args, cwd=cwd, timeout=300)


def test_debug_recipe_runs_end_to_end(tmp_path):
    out = tmp_path / "out"
    result = run_litgpt(
        "pretrain", "--config", "config_hub/pretrain/debug.yaml", "--out_dir", out, "--data.cache_dir",
        tmp_path / "cache", "--train.max_steps", "2", "--train.max_seq_length", "64", "--train.global_batch_size", "2",
        "--train.micro_batch_size", "2", "--eval.max_iters", "1", "--eval.interval", "1000",
        "--eval.max_new_tokens", "4",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    final = out / "final"
    assert (final / "lit_model.pth").is_file() and (final / "model_config.yaml").is_file()
    assert (final / "tokenizer.json").is_file()  # the bundled tokenizer, since the recipe names none
    assert yaml.safe_load((final / "model_config.yaml").read_text())["name"] == "pythia-14m"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2


# ---- the finetuning recipes run, on a stand-in checkpoint ------------------------------------------------------------
@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> tuple[Path, Path]:
    """(a 2-layer checkpoint with the bundled tokenizer, a folder with both Alpaca data files as small local JSON).

    The real recipes' weights cannot be downloaded here; this runs each recipe's own arguments (data module, LoRA
    settings, precision, optimizer, schedule) on a small model instead, through `litgpt finetune_*`.
    """
    from litgpt.io import save_state_dict
    from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR
    from litgpt.model import GPT

    folder = tmp_path_factory.mktemp("checkpoint")
    torch.manual_seed(0)
    model = GPT(Config(name="stand-in", block_size=512, vocab_size=4096, padded_vocab_size=4096, n_layer=2,
                       n_embd=32, n_head=2, n_query_groups=1, intermediate_size=64, tie_embeddings=True,
                       mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", hf_model_type="llama"))
    model.init_weights()
    save_state_dict(model.state_dict(), folder / "lit_model.pth")
    model.config.save(folder / "model_config.yaml")
    for file in TOKENIZER_DIR.iterdir():
        shutil.copy2(file, folder / file.name)
    data = tmp_path_factory.mktemp("alpaca")
    stories = [s for s in (TINY_DIR / "val.txt").read_text().split("\n\n") if s.strip()][:40]
    records = [{"instruction": "Tell a short story.", "input": "", "output": s[:200]} for s in stories]
    (data / "alpaca_data_cleaned_archive.json").write_text(json.dumps(records))  # what Alpaca reads
    (data / "alpaca_2000.json").write_text(json.dumps(records))  # what Alpaca2k reads instead of the parquet file
    return folder, data


@pytest.mark.parametrize("recipe", ["finetune/SmolLM2-135M/full.yaml", "finetune/SmolLM2-135M/lora.yaml"])
def test_finetune_recipe_runs_on_a_stand_in_checkpoint(recipe, tmp_path, stand_in):
    checkpoint, data = stand_in
    out = tmp_path / "out"
    result = run_litgpt(
        # checkpoint_dir is positional; given after --config it overrides the recipe's (before, the recipe wins).
        command_for(HUB / recipe), "--config", f"config_hub/{recipe}", checkpoint,
        "--out_dir", out, "--data.download_dir", data, "--data.val_split_fraction", "0.1",
        # 160 tokens: the Alpaca template alone is ~80 with the bundled tokenizer; shorter cuts every response.
        "--train.max_steps", "2", "--train.max_seq_length", "160", "--train.global_batch_size", "4",
        "--train.micro_batch_size", "2", "--train.lr_warmup_steps", "1", "--eval.max_iters", "1",
        "--eval.interval", "1000", "--eval.max_new_tokens", "4", "--precision", "32-true",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+/\d+ \| loss ([0-9.]+)", result.stdout, re.MULTILINE)]
    assert len(losses) == 2 and all(loss > 0.5 for loss in losses), result.stdout  # responses are in the loss
    assert (out / "final" / "lit_model.pth").is_file()
    hyperparameters = yaml.safe_load((out / "final" / "hyperparameters.yaml").read_text())
    assert hyperparameters["data"]["init_args"]["prompt_style"] == "alpaca"  # the recipe's own data settings
    if recipe.endswith("lora.yaml"):
        assert (out / "final" / "lit_model.pth.lora").is_file()
        assert hyperparameters["lora_r"] == 16 and hyperparameters["lora_mlp"] is True

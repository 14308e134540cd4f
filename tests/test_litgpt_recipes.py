"""LitGPT 0.5.13's own recipes and command names (tests/fixtures/litgpt-0.5.13, copied from its repository): every
recipe parses with our command's parser and every key lands in the built arguments as written; a key without effect
here gets its one-line note and one we cannot follow its one-line refusal; a representative set runs end to end with
model, data and step count swapped for tiny ones; every command name resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from test_config_hub import parser_for, run_litgpt, stand_in  # noqa: F401 (stand_in is a fixture)
from test_merge_lora import base, make_run, snapshot  # noqa: F401 (base is a fixture)

from litgpt.__main__ import COMMANDS, LITGPT_ALIASES, NOT_CARRIED
from litgpt.__main__ import main as cli_main
from litgpt.args import LogArgs, TrainArgs
from litgpt.compat import check_litgpt_arguments, litgpt_notes, tie_embeddings, untie_for_lora_head
from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.io import load_state_dict
from litgpt.merge_lora import merge_lora
from litgpt.model import GPT
from litgpt.pretrain import resolve_inputs

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "litgpt-0.5.13"
HUB = FIXTURES / "config_hub"
RECIPES = sorted(HUB.rglob("*.yaml"))
TINY_TOKENIZER = ROOT / "litgpt" / "data" / "tiny" / "tokenizer"


def recipe_id(recipe: Path) -> str:
    return recipe.relative_to(HUB).as_posix()


def command_for(recipe: Path) -> str:
    """LitGPT's command for a recipe: pretrain, finetune_full, or finetune_lora for lora.yaml and qlora.yaml."""
    if recipe.parent.name == "pretrain":
        return "pretrain"
    return "finetune_full" if recipe.stem == "full" else "finetune_lora"


def build(recipe: Path, *overrides: str):
    """The instantiated arguments of `--config RECIPE OVERRIDES...`, read by the command's real parser."""
    parser = parser_for(command_for(recipe))
    return parser.instantiate(parser.parse_args(["--config", str(recipe), *overrides]))


def flatten(mapping: dict, prefix: str = "") -> dict:
    """{"train.max_steps": 100, ...}; model_config and a data module's class_path/init_args stay whole."""
    result = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and key not in ("model_config", "data", "optimizer"):
            result.update(flatten(value, f"{prefix}{key}."))
        else:
            result[f"{prefix}{key}"] = value
    return result


def same(built, written) -> bool:
    """A built value equals what the YAML says (`6e-4` without a dot is a string to PyYAML, a float to the parser)."""
    if isinstance(written, str) and isinstance(built, float):
        return built == float(written)
    if isinstance(built, Path):
        return str(built) == str(written)
    if isinstance(built, tuple):
        built = list(built)
    return built == written


def test_the_fixtures_hold_litgpts_46_recipes():
    assert len(RECIPES) == 46
    assert sum(command_for(r) == "pretrain" for r in RECIPES) == 4
    assert sum(command_for(r) == "finetune_full" for r in RECIPES) == 10


# ---- every recipe parses, and every key reaches the arguments --------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_recipe_parses_and_every_key_is_built_as_written(recipe):
    written = flatten(yaml.safe_load(recipe.read_text()))
    args = build(recipe)
    for key, value in written.items():
        built = args
        for part in key.split("."):
            built = getattr(built, part)
        if key == "model_config":
            assert value is None or all(getattr(built, k) == v for k, v in value.items()), key
        elif key == "data":
            data = {"class_path": value} if isinstance(value, str) else value
            assert type(built).__name__ == data["class_path"].rpartition(".")[2]
            for name, arg in (data.get("init_args") or {}).items():
                assert same(getattr(built, name), arg), (name, getattr(built, name), arg)
        elif key == "optimizer":
            assert built["class_path"] == value["class_path"]
            assert all(same(built["init_args"][k], v) for k, v in value["init_args"].items())
        else:
            assert same(built, value), (key, built, value)
    # LitGPT's keys without effect here are named, and only those: data.num_workers is set by every finetuning recipe.
    notes = litgpt_notes(vars(args))
    assert [n.split()[0] for n in notes] == (["data.num_workers"] if command_for(recipe) != "pretrain" else [])


@pytest.mark.parametrize("recipe", [r for r in RECIPES if command_for(r) == "pretrain"], ids=recipe_id)
def test_pretrain_recipes_resolve_their_model(recipe, capsys):
    args = build(recipe, "--data", "Tiny")
    config, _, _ = resolve_inputs(args.model_name, args.model_config, None, args.data, TINY_TOKENIZER)
    config = tie_embeddings(config, args.train, finetuning=False)
    if args.model_config is not None:  # tinystories.yaml gives both: the config wins, as in LitGPT, with a note
        assert config.name == "stories15M" and config.n_embd == 288
        assert "--model_config (name 'stories15M') is used; --model_name 'stories15M' is not" in capsys.readouterr().out
        assert config.tie_embeddings is True  # train.tie_embeddings: true
    else:
        assert config == Config.from_name(args.model_name)  # tie_embeddings left empty: the model's own


# ---- keys without effect: one note each; keys we cannot follow: one refusal each -------------------------------------
def lora_arguments(recipe: str = "llama-3.2-1B/lora.yaml", *overrides: str) -> dict:
    return vars(build(HUB / "finetune" / recipe, *overrides))


def test_keys_without_effect_are_noted_once_each(capsys):
    arguments = lora_arguments("llama-3.2-1B/lora.yaml", "--log.project", "p", "--log.run", "r",
                               "--eval.evaluate_example", "random", "--access_token", "hf_secret")
    checked = check_litgpt_arguments(arguments)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[1] for line in lines] == ["data.num_workers", "eval.evaluate_example", "log.project,",
                                                   "access_token"]
    assert "log.project, log.run have no effect" in lines[2] and "there are no loader workers" in lines[0]
    assert checked["access_token"] is None  # never recorded in hyperparameters.yaml
    stories = vars(build(HUB / "pretrain" / "debug.yaml", "--data.seed", "7", "--data.num_workers", "8"))
    assert [note.split()[0] for note in litgpt_notes(stories)] == ["data.num_workers", "data.seed"]
    assert litgpt_notes({**arguments, "data": None, "log": LogArgs(), "access_token": None,
                         "eval": build(HUB / "pretrain" / "debug.yaml", "--data", "Tiny").eval}) == []


@pytest.mark.parametrize("flag, value, message", [
    ("--train.max_time", "3600", "--train.max_time 3600.0: there is no time limit here; bound the run with "
                                 "--train.max_steps"),
    ("--train.lr_warmup_fraction", "0.1", "--train.lr_warmup_fraction 0.1: give the warm-up in optimizer steps "
                                          "with --train.lr_warmup_steps"),
])
def test_keys_we_cannot_follow_are_refused_in_one_line(flag, value, message, tmp_path, capsys):
    recipe = HUB / "finetune" / "llama-3.2-1B" / "lora.yaml"
    with pytest.raises(SystemExit) as info:
        cli_main(["finetune_lora", "--config", str(recipe), str(tmp_path), flag, value,
                  "--out_dir", str(tmp_path / "o")])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"litgpt finetune_lora: error: {message}") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


@pytest.mark.parametrize("name", ["Deita", "FLAN", "LongForm"])
def test_litgpt_data_modules_we_do_not_carry_say_which_of_ours_to_use(name, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "pythia-14m", "--data", f"litgpt.data.{name}", "--out_dir", str(tmp_path / "o")])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"litgpt pretrain: error: --data {name} is LitGPT's and is not carried here: ")
    assert err.count("\n") == 1 and re.search(r"--data (TextFiles|JSON)", err)
    assert not (tmp_path / "o").exists()


def test_tie_embeddings_ties_when_pretraining_and_keeps_the_checkpoint_when_finetuning(capsys):
    untied = Config.from_name("pythia-14m")
    tied = tie_embeddings(untied, TrainArgs(tie_embeddings=True), finetuning=False)
    with torch.device("meta"):
        model = GPT(tied)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert tie_embeddings(untied, TrainArgs(tie_embeddings=None), finetuning=False) is untied
    assert tie_embeddings(untied, TrainArgs(tie_embeddings=True), finetuning=True) is untied
    assert "train.tie_embeddings True has no effect when finetuning" in capsys.readouterr().out


def test_lora_head_on_a_tied_head_unties_it_with_a_note(capsys):
    from litgpt.lora import LoRASettings

    tied = Config.from_name("pythia-14m", tie_embeddings=True)
    assert untie_for_lora_head(tied, LoRASettings(head=False)) is tied
    assert untie_for_lora_head(tied, None) is tied
    untied = untie_for_lora_head(tied, LoRASettings(head=True))
    assert untied.tie_embeddings is False and untied == Config.from_name("pythia-14m", tie_embeddings=False)
    assert "the head becomes a copy of the embeddings" in capsys.readouterr().out


# ---- command names ---------------------------------------------------------------------------------------------------
LITGPT_COMMANDS = (FIXTURES / "commands.txt").read_text().split()


@pytest.mark.parametrize("name", LITGPT_COMMANDS)
def test_every_litgpt_command_name_resolves(name, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main([name, "--help"])
    output = capsys.readouterr()
    if name in NOT_CARRIED:
        assert info.value.code == 1
        assert output.err.startswith(f"litgpt {name}: ") and output.err.count("\n") == 1
        assert re.search(r"`litgpt (finetune_lora|generate|plan)", output.err)
    else:
        assert name in COMMANDS or name in LITGPT_ALIASES
        assert info.value.code == 0 and f"usage: litgpt {name}" in output.out


def test_every_name_we_add_is_litgpts():
    assert set(LITGPT_ALIASES) | set(NOT_CARRIED) <= set(LITGPT_COMMANDS)
    assert not set(LITGPT_ALIASES) & set(COMMANDS) and not set(NOT_CARRIED) & set(COMMANDS)
    # The guide quotes one of the lines as the command prints it.
    guide = (ROOT / "tutorials" / "coming_from_litgpt.md").read_text()
    assert f"litgpt finetune_adapter: {NOT_CARRIED['finetune_adapter']}" in guide


# ---- merge_lora on a merged folder -----------------------------------------------------------------------------------
def test_merge_lora_on_a_merged_folder_says_so_and_changes_nothing(tmp_path, base, capsys):  # noqa: F811
    run = tmp_path / "run"
    make_run(run, base)
    merge_lora(run)
    before = snapshot(run, base)
    capsys.readouterr()
    cli_main(["merge_lora", str(run)])  # returns: exit code 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "already holds lit_model.pth merged from its lit_model.pth.lora: nothing to do" in out
    assert snapshot(run, base) == before


def test_convert_pretrained_checkpoint_copies_a_model_folder_and_refuses_a_full_output(tmp_path, capsys):
    checkpoint = tmp_path / "final"
    checkpoint.mkdir()
    files = {"lit_model.pth": b"weights", "model_config.yaml": b"name: x\n", "tokenizer.json": b"{}",
             "training_state.pth": b"optimizer"}
    for name, content in files.items():
        (checkpoint / name).write_bytes(content)
    cli_main(["convert_pretrained_checkpoint", str(checkpoint), str(tmp_path / "model")])
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()} == {
        name: content for name, content in files.items() if name != "training_state.pth"}
    before = snapshot(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(["convert_pretrained_checkpoint", str(checkpoint), str(tmp_path / "model")])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.count("\n") == 1 and "exists and is not an empty folder" in err
    assert snapshot(tmp_path) == before


# ---- end to end: a representative set, model, data and step count swapped for tiny ones ------------------------------
FINETUNE_RUNS = (
    "phi-2/full.yaml",  # finetune_full; devices: 2 in the recipe
    "gemma-2b/lora.yaml",  # every lora_* switch on, lora_head too: the stand-in's head is tied, as our Gemma's
    "llama-2-7b/qlora.yaml",  # quantize: bnb.nf4, data.download_dir in the recipe
)


@pytest.mark.slow
def test_pretrain_recipe_runs_end_to_end(tmp_path):
    """tinystories.yaml: model_config and model_name, train.tie_embeddings, optimizer as class path; the data swapped
    for the bundled corpus (TinyStories is 2 GB) and the tokenizer for its own."""
    out = tmp_path / "out"
    result = run_litgpt(
        "pretrain", "--config", HUB / "pretrain" / "tinystories.yaml", "--data", "Tiny", "--data.cache_dir",
        tmp_path / "cache", "--tokenizer_dir", TINY_TOKENIZER, "--out_dir", out, "--train.max_tokens", "null",
        "--train.max_steps", "1", "--train.global_batch_size", "2", "--train.micro_batch_size", "2",
        "--train.max_seq_length", "64", "--eval.max_iters", "1",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Note: --model_config (name 'stories15M') is used" in result.stdout
    config = Config.from_checkpoint(out / "final")
    assert config.tie_embeddings and config.n_embd == 288 and config.n_layer == 6
    with torch.device("meta"):
        parameters = sum(p.numel() for p in GPT(config).parameters())  # a tied head is counted once
    assert f"{parameters:,} trainable parameters" in result.stdout
    hyperparameters = yaml.safe_load((out / "final" / "hyperparameters.yaml").read_text())
    assert hyperparameters["optimizer"]["init_args"]["lr"] == 0.0005 and hyperparameters["train"]["tie_embeddings"]

    converted = tmp_path / "converted"
    cli_main(["convert_pretrained_checkpoint", str(out / "final"), str(converted)])
    for name in ("lit_model.pth", "model_config.yaml", "tokenizer.json"):
        assert (converted / name).read_bytes() == (out / "final" / name).read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", FINETUNE_RUNS)
def test_finetune_recipe_runs_end_to_end(recipe, tmp_path, stand_in, capsys):  # noqa: F811
    checkpoint, data = stand_in
    out = tmp_path / "out"
    result = run_litgpt(
        command_for(HUB / "finetune" / recipe), "--config", HUB / "finetune" / recipe, checkpoint, "--out_dir", out,
        "--data.download_dir", data, "--devices", "1", "--train.epochs", "null", "--train.max_steps", "1",
        "--eval.max_iters", "1", "--eval.max_new_tokens", "4",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Note: data.num_workers 4 has no effect here" in result.stdout
    assert re.search(r"^step 1/1 \| loss [0-9.]+", result.stdout, re.MULTILINE)
    hyperparameters = yaml.safe_load((out / "final" / "hyperparameters.yaml").read_text())
    written = yaml.safe_load((HUB / "finetune" / recipe).read_text())
    assert hyperparameters["data"]["init_args"]["num_workers"] == 4
    assert hyperparameters["train"]["max_seq_length"] == written["train"]["max_seq_length"]
    assert hyperparameters["precision"] == written["precision"]
    if "lora" in recipe:
        assert hyperparameters["lora_r"] == written["lora_r"] and hyperparameters["quantize"] == written["quantize"]
        # The step every LitGPT LoRA guide runs next: final/ is merged already, which is no failure.
        before = snapshot(out / "final")
        capsys.readouterr()
        cli_main(["merge_lora", str(out / "final")])
        assert "nothing to do" in capsys.readouterr().out and snapshot(out / "final") == before
    assert json.loads((out / "run_args.json").read_text())["arguments"]["access_token"] is None
    if written.get("lora_head"):
        check_untied_head(out / "final", checkpoint, written["lora_alpha"] / written["lora_r"])


def check_untied_head(final: Path, base: Path, scale: float) -> None:
    """LitGPT's lora_head on a tied head: the embeddings stay the base's, the head is their copy plus the adapter."""
    assert Config.from_checkpoint(final).tie_embeddings is False
    merged, base_weights = load_state_dict(final / "lit_model.pth"), load_state_dict(base / "lit_model.pth")
    adapters = load_state_dict(final / "lit_model.pth.lora")
    embeddings = base_weights["transformer.wte.weight"]
    assert torch.equal(merged["transformer.wte.weight"], embeddings)
    update = scale * adapters["lm_head.lora_B"] @ adapters["lm_head.lora_A"]
    assert update.abs().max() > 0
    torch.testing.assert_close(merged["lm_head.weight"], embeddings + update, rtol=0, atol=1e-6)

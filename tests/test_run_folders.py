"""Runs that work from anywhere (issue 33, point 4) and LitGPT 0.5.13's LoRA runs, `ORG/NAME` and pre-0.5 weights
(point 5).

The base model is written by LitGPT 0.5.13's own code (tests/litgpt_reference.py) as `checkpoints/org/tiny` of a
project folder, with LitGPT's greedy tokens; our runs and LitGPT's run in that project by the shorthand `org/tiny`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from litgpt_forkserver import run_litgpt as litgpt_process
from litgpt_reference import READ_FOLDERS, WRITE_FOLDERS, litgpt_reference_dir, run_litgpt

from litgpt.checkpoint.model_files import find_checkpoint_dir
from litgpt.config import Config
from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint
from litgpt.data.tiny import TOKENIZER_DIR
from litgpt.errors import UserError
from litgpt.io import load_state_dict, save_state_dict
from litgpt.merge_lora import BASE_RECORD_FILE, merge_lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(name="tiny", block_size=128, n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=4096,
            padded_vocab_size=4096, norm_class_name="RMSNorm", bias=False, parallel_residual=False,
            rotary_percentage=1.0, mlp_class_name="LLaMAMLP", intermediate_size=48)
PROMPT = [1, 306, 465, 278, 3186]
NEW_TOKENS = 8
# One sample again and again: every batch is the same.
RECORDS = [{"instruction": "Name the color.", "output": "The answer is blue."}] * 8
TRAIN_ARGS = ["--data", "JSON", "--data.json_path", "data.json", "--data.val_split_fraction", "0.25",
              "--train.global_batch_size", "1", "--train.micro_batch_size", "1", "--train.save_interval", "1",
              "--eval.max_iters", "1", "--eval.max_new_tokens", "2", "--precision", "32-true"]
LORA_ARGS = ["--lora_r", "4", "--lora_key", "true", "--lora_mlp", "true"]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> tuple[Path, list[int]]:
    """(a project folder holding checkpoints/org/tiny, written by LitGPT 0.5.13, and data.json; LitGPT's greedy
    tokens of the base)."""
    root = tmp_path_factory.mktemp("project")
    base = root / "checkpoints" / "org" / "tiny"
    found = run_litgpt(WRITE_FOLDERS, [dict(folder=str(base), config=TINY, prompt=PROMPT, max_new_tokens=NEW_TOKENS,
                                            tokenizer_dir=str(TOKENIZER_DIR))])
    (root / "data.json").write_text(json.dumps(RECORDS))
    return root, found[0]["tokens"]


@pytest.fixture(scope="module")
def our_run(project) -> Path:
    """Two steps of our finetune_lora on `org/tiny` (the shorthand), typed in the project folder: out/lora."""
    root, _ = project
    result = litgpt_process(["finetune_lora", "org/tiny", "--out_dir", "out/lora", "--train.max_steps", "2",
                             *TRAIN_ARGS, *LORA_ARGS, "--lora_dropout", "0"], cwd=root, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "out" / "lora"


def our_greedy(folder: Path) -> list[int]:
    from litgpt.generate import generate, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(folder, precision="32-true", device="cpu")
    return [int(t) for t in generate(model, PROMPT, NEW_TOKENS, temperature=0.0, top_k=None, top_p=1.0)]


def adapters_only(run_folder: Path, destination: Path) -> Path:
    """A copy of a LoRA checkpoint folder without merged weights (what a step-XXXXXX folder holds)."""
    shutil.copytree(run_folder, destination)
    (destination / "lit_model.pth").unlink(missing_ok=True)
    return destination


def assert_same_weights(path: Path, reference: Path, atol: float = 0.0) -> None:
    ours, theirs = load_state_dict(path), load_state_dict(reference)
    theirs = theirs.get("model", theirs)
    assert set(ours) == set(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key].float(), theirs[key].float(), atol=atol, rtol=0, msg=key)


# ---- ORG/NAME and pre-0.5 weights ----------------------------------------------------------------------------------
def test_org_name_resolves_under_checkpoints(project, monkeypatch):
    root, litgpt_tokens = project
    monkeypatch.chdir(root)
    assert find_checkpoint_dir(Path("org/tiny")) == Path("checkpoints/org/tiny")
    assert our_greedy(Path("org/tiny")) == litgpt_tokens
    with pytest.raises(UserError, match="'org/other' does not exist"):
        find_checkpoint_dir(Path("org/other"))


def interleaved_per_group(qkv: torch.Tensor, config: Config) -> torch.Tensor:
    """Pre-0.5 LitGPT's layout of the fused q/k/v rows, by hand: per query group its q heads, its k, its v."""
    q_rows, kv_rows = config.n_head * config.head_size, config.n_query_groups * config.head_size
    q, k, v = qkv[:q_rows], qkv[q_rows:q_rows + kv_rows], qkv[q_rows + kv_rows:]
    per_group = q_rows // config.n_query_groups
    rows = []
    for group in range(config.n_query_groups):
        rows += [q[group * per_group:(group + 1) * per_group], k[group * config.head_size:(group + 1) * config.head_size],
                 v[group * config.head_size:(group + 1) * config.head_size]]
    return torch.cat(rows)


def test_pre_05_attn_attn_weights_load(project, tmp_path):
    """A checkpoint in pre-0.5 key names and q/k/v layout generates the base's tokens of LitGPT 0.5.13."""
    root, litgpt_tokens = project
    legacy = tmp_path / "legacy"
    shutil.copytree(root / "checkpoints" / "org" / "tiny", legacy)
    config = Config.from_checkpoint(legacy)
    state = load_state_dict(legacy / "lit_model.pth")
    state = {key.replace(".attn.qkv.", ".attn.attn."): interleaved_per_group(value, config) if ".attn.qkv." in key
             else value for key, value in state.items()}
    save_state_dict(state, legacy / "lit_model.pth")
    assert our_greedy(legacy) == litgpt_tokens

    wrong = {**state, "transformer.h.0.attn.attn.weight": state["transformer.h.0.attn.attn.weight"][:-1]}
    save_state_dict(wrong, legacy / "lit_model.pth")
    with pytest.raises(UserError, match="has 63 rows") as error:
        our_greedy(legacy)
    assert "\n" not in str(error.value)


def test_pre_05_lora_adapters_are_refused_in_one_line(project, tmp_path):
    root, _ = project
    run = tmp_path / "old_run"
    run.mkdir()
    save_state_dict({"transformer.h.0.attn.attn.lora_A": torch.zeros(8, 32),
                     "transformer.h.0.attn.attn.lora_B": torch.zeros(128, 4)}, run / "lit_model.pth.lora")
    (run / "hyperparameters.yaml").write_text(yaml.safe_dump(
        {"checkpoint_dir": str(root / "checkpoints" / "org" / "tiny"), "lora_r": 4, "lora_alpha": 8}))
    with pytest.raises(UserError, match="pre-0.5 LitGPT adapters.*merge_lora") as error:
        merge_lora(run)
    assert "\n" not in str(error.value)


# ---- our runs from anywhere -----------------------------------------------------------------------------------------
def test_a_run_records_its_base_three_ways(project, our_run):
    root, _ = project
    record = yaml.safe_load((our_run / "step-000001" / BASE_RECORD_FILE).read_text())
    assert record == {"as_typed": "org/tiny", "absolute": str((root / "checkpoints/org/tiny").resolve()),
                      "from_this_folder": os.path.join("..", "..", "..", "checkpoints", "org", "tiny")}
    assert yaml.safe_load((our_run / "final" / "hyperparameters.yaml").read_text())["checkpoint_dir"] == "org/tiny"


def test_merge_and_export_from_another_working_directory(our_run, tmp_path, monkeypatch):
    """From a folder where neither `org/tiny` nor `checkpoints/org/tiny` exists, the recorded absolute path finds
    the base: the merge equals what the run merged into final/, and the PEFT export works."""
    step = adapters_only(our_run / "step-000002", our_run / "step-copy")
    try:
        monkeypatch.chdir(tmp_path)
        merge_lora(step)
        assert_same_weights(step / "lit_model.pth", our_run / "final" / "lit_model.pth", atol=1e-6)
        (step / "lit_model.pth").unlink()
        convert_lit_checkpoint(step, tmp_path / "hf", peft=True)
        assert (tmp_path / "hf" / "adapter" / "adapter_config.json").is_file()
    finally:
        shutil.rmtree(step)


def test_a_moved_run_tree_finds_its_base_relative_to_the_run(project, our_run, tmp_path, monkeypatch):
    """The project moved whole (its old absolute path gone): the base is found relative to the run folder; with the
    base gone too, one line lists every place tried."""
    root, _ = project
    moved = tmp_path / "moved"
    shutil.copytree(root, moved, ignore=shutil.ignore_patterns("hf", "continued*"))
    step = adapters_only(moved / "out/lora/step-000002", moved / "out/lora/step-moved")
    record = yaml.safe_load((step / BASE_RECORD_FILE).read_text())
    record["absolute"] = str(tmp_path / "where-it-was" / "checkpoints/org/tiny")  # as recorded before the move
    (step / BASE_RECORD_FILE).write_text(yaml.safe_dump(record))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    merge_lora(step)
    assert_same_weights(step / "lit_model.pth", our_run / "final" / "lit_model.pth", atol=1e-6)

    (step / "lit_model.pth").unlink()
    shutil.rmtree(moved / "checkpoints")
    with pytest.raises(UserError, match="does not exist at") as error:
        merge_lora(step)
    message = str(error.value)
    assert "\n" not in message and "'org/tiny'" in message and "where-it-was" in message
    assert "../../../checkpoints/org/tiny" in message and "--pretrained_checkpoint_dir" in message


def test_finetune_continues_from_an_exported_peft_adapter(project, our_run, tmp_path):
    """`finetune_lora --initial_adapter_dir` on the PEFT export of our run: at a negligible learning rate its merged
    final weights are the run's own (the adapter was loaded exactly); its rank is the adapter's."""
    root, _ = project
    convert_lit_checkpoint(adapters_only(our_run / "final", tmp_path / "run_final"), tmp_path / "hf", peft=True)
    result = litgpt_process(["finetune_lora", "org/tiny", "--out_dir", "out/continued", "--train.max_steps", "1",
                             "--initial_adapter_dir", str(tmp_path / "hf" / "adapter"), "--optimizer.lr", "1e-12",
                             *TRAIN_ARGS, "--lora_r", "16", "--lora_dropout", "0"], cwd=root, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replace the --lora_* options" in result.stdout
    continued = root / "out" / "continued" / "final"
    hyperparameters = yaml.safe_load((continued / "hyperparameters.yaml").read_text())
    assert (hyperparameters["lora_r"], hyperparameters["lora_key"], hyperparameters["lora_mlp"]) == (4, True, True)
    adapters = load_state_dict(continued / "lit_model.pth.lora")
    assert adapters["transformer.h.0.attn.qkv.lora_A_k"].shape[0] == 4  # the adapter's rank
    assert_same_weights(continued / "lit_model.pth", our_run / "final" / "lit_model.pth", atol=1e-6)


# ---- LitGPT 0.5.13's own LoRA run -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_litgpt_lora_run_merges_generates_and_exports_here(project, tmp_path, monkeypatch):
    """LitGPT's `finetune_lora org/tiny` run: its step folder (adapters only) merges here into LitGPT's own merged
    weights, generates LitGPT's greedy tokens of its merged model, exports as PEFT, and starts a run of ours."""
    import subprocess
    import sys

    root, _ = project
    env = {**os.environ, "PYTHONPATH": str(litgpt_reference_dir()), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "litgpt_out"
    result = subprocess.run(
        [sys.executable, "-m", "litgpt", "finetune_lora", "org/tiny", "--out_dir", str(out), "--train.max_steps",
         "2", "--devices", "1", "--lora_projection", "true", "--lora_head", "true", *TRAIN_ARGS, *LORA_ARGS],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    litgpt_final = out / "final"
    litgpt_tokens = run_litgpt(READ_FOLDERS, [dict(folder=str(litgpt_final), prompt=PROMPT,
                                                   max_new_tokens=NEW_TOKENS)])[0]["tokens"]

    step = adapters_only(out / "step-000002", tmp_path / "step")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="does not exist at 'org/tiny'"):  # LitGPT records the shorthand only
        merge_lora(step)
    monkeypatch.chdir(root)
    merge_lora(step)
    assert_same_weights(step / "lit_model.pth", litgpt_final / "lit_model.pth", atol=1e-6)
    assert our_greedy(step) == litgpt_tokens

    (step / "lit_model.pth").unlink()
    convert_lit_checkpoint(step, tmp_path / "hf", peft=True)
    assert (tmp_path / "hf" / "adapter" / "adapter_model.safetensors").is_file()

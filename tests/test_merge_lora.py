"""`litgpt merge_lora`: a LoRA run folder becomes a plain checkpoint whose logits equal the adapted model's."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tokenizer_helpers import make_tokenizer_folder

from litgpt.__main__ import main as cli_main
from litgpt.checkpoint.model_files import find_checkpoint_dir, load_model_weights
from litgpt.io import load_state_dict, save_state_dict
from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.lora import LoRASettings, add_lora, load_base_weights, lora_state_dict
from litgpt.merge_lora import merge_lora
from litgpt.model import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


CONFIG = dict(
    name="tiny-lora", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, vocab_size=100, block_size=32,
    padding_multiple=64, bias=True,
)
SETTINGS = LoRASettings(r=4, alpha=16, dropout=0.05, query=True, key=True, value=True, projection=True, mlp=True, head=True)


def make_base(folder: Path, **overrides) -> Path:
    config = Config(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    folder.mkdir(parents=True)
    save_state_dict(model.state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    make_tokenizer_folder(folder, "gpt2")
    return folder


def make_run(folder: Path, base: Path, settings: LoRASettings = SETTINGS, scale: float = 0.05,
             **hparams_overrides) -> GPT:
    """A LoRA finetuning output folder with 'trained' (random non-zero, std `scale`) adapters; returns the adapted
    model."""
    config = Config.from_checkpoint(base)
    model = GPT(config)
    add_lora(model, settings)
    load_base_weights(model, load_state_dict(base / "lit_model.pth"), source="base")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    folder.mkdir(parents=True)
    save_state_dict(lora_state_dict(model), folder / "lit_model.pth.lora")
    hparams = {"checkpoint_dir": str(base), "out_dir": str(folder), "learning_rate": 3e-4, **settings.to_hparams()}
    hparams.update(hparams_overrides)
    (folder / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))
    config.save(folder / "model_config.yaml")
    make_tokenizer_folder(folder, "gpt2")
    return model.eval()


def load_plain(folder: Path) -> GPT:
    find_checkpoint_dir(folder)  # what `litgpt generate` and `convert_from_litgpt` check first
    model = GPT(Config.from_checkpoint(folder))
    load_model_weights(model, load_state_dict(folder / "lit_model.pth"), source=str(folder))
    return model.eval()


def snapshot(*folders: Path) -> dict:
    return {
        str(path): hashlib.sha256(path.read_bytes()).hexdigest()
        for folder in folders
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


TOKENS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
# Merged float32 logits equal the adapted model's up to float32 rounding: measured max abs difference 4.5e-7 (logits
# up to ~0.7); the bound is ~4x that. The adapters move the logits by ~0.77, so a merge that did nothing would fail.
FP32_ATOL = 2e-6
# Merged bfloat16 weights (computed in float32 after the cast) against the float32 adapted model: measured max abs
# logit difference 1.7e-3 (the bf16 rounding of the weights alone gives 1.7e-3 too; logits up to ~1.3); the bound is
# ~3x that. These adapters move the logits by ~0.21, 40x the bound.
BF16_ATOL = 5e-3


@pytest.fixture
def base(tmp_path) -> Path:
    return make_base(tmp_path / "base")


def test_merge_gives_a_plain_checkpoint_with_the_adapted_logits(tmp_path, base):
    run = tmp_path / "run"
    adapted = make_run(run, base)
    merge_lora(run)
    merged = load_plain(run)
    expected = adapted(TOKENS)
    torch.testing.assert_close(merged(TOKENS), expected, atol=FP32_ATOL, rtol=0)
    assert (expected - load_plain(base)(TOKENS)).abs().max() > 1e-2  # the adapters changed the model
    state = load_state_dict(run / "lit_model.pth")
    assert not any("lora" in key for key in state) and state["lm_head.weight"].dtype == torch.float32
    assert not list(run.glob(".lit_model.pth.*"))  # no temporary file left behind


def test_merge_through_the_cli_in_a_subprocess(tmp_path, base):
    run = tmp_path / "run"
    adapted = make_run(run, base)
    result = subprocess.run(
        [sys.executable, "-m", "litgpt", "merge_lora", str(run)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "lit_model.pth" in result.stdout
    torch.testing.assert_close(load_plain(run)(TOKENS), adapted(TOKENS), atol=FP32_ATOL, rtol=0)



def test_pretrained_checkpoint_dir_precision_and_tied_embeddings(tmp_path):
    base = make_base(tmp_path / "moved_base", tie_embeddings=True)
    run = tmp_path / "run"
    settings = LoRASettings(r=2, alpha=4, query=True, value=True, mlp=True)
    adapted = make_run(run, base, settings, checkpoint_dir=str(tmp_path / "where_it_was_during_training"))
    merge_lora(run, pretrained_checkpoint_dir=base, precision="bf16-true")
    state = load_state_dict(run / "lit_model.pth")
    assert all(value.dtype == torch.bfloat16 for value in state.values())
    # The tie survives: one tensor under both names.
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    merged = load_plain(run).float()
    expected = adapted(TOKENS)
    torch.testing.assert_close(merged(TOKENS), expected, atol=BF16_ATOL, rtol=0)
    # The merge did something: the base's logits are far outside that bound.
    assert (expected - load_plain(base)(TOKENS)).abs().max() > 20 * BF16_ATOL


def test_missing_config_and_tokenizer_are_taken_from_the_base(tmp_path, base):
    run = tmp_path / "run"
    adapted = make_run(run, base)
    for name in ("model_config.yaml", "tokenizer.json", "tokenizer_config.json"):
        (run / name).unlink()
    merge_lora(run)
    assert (run / "model_config.yaml").is_file() and (run / "tokenizer.json").is_file()
    torch.testing.assert_close(load_plain(run)(TOKENS), adapted(TOKENS), atol=FP32_ATOL, rtol=0)


def hand_merged(base_state: dict, adapters: dict, config: Config, settings: LoRASettings) -> dict:
    """W + (alpha / r) B A in float64 for every adapted weight, written from the LoRA definition: a plain adapter
    `<layer>.lora_A`/`lora_B` updates all rows of `<layer>.weight`; the fused attn.qkv weight stacks the query rows
    (n_head * head_size), then the key rows and the value rows (n_query_groups * head_size each), and
    `lora_A_q`/`_k`/`_v` with their B update only their own block of rows."""
    scaling = settings.alpha / settings.r
    q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
    blocks = {"": None, "_q": (0, q), "_k": (q, q + kv), "_v": (q + kv, q + 2 * kv)}
    merged = {}
    for key, a in adapters.items():
        layer, _, name = key.rpartition(".")
        if not name.startswith("lora_A"):
            continue
        suffix = name[len("lora_A"):]
        b = adapters[f"{layer}.lora_B{suffix}"]
        weight = merged.setdefault(f"{layer}.weight", base_state[f"{layer}.weight"].double().clone())
        delta = scaling * (b.double() @ a.double())
        rows = blocks[suffix]
        if rows is None:
            weight += delta
        else:
            assert delta.shape[0] == rows[1] - rows[0], key
            weight[rows[0]:rows[1]] += delta
    return merged


@pytest.mark.parametrize("precision", [None, "bf16-true"])
@pytest.mark.parametrize("settings", [SETTINGS, LoRASettings(r=2, alpha=4, query=True, key=False, value=True)],
                         ids=["all-layers", "query-value"])
def test_merged_weights_equal_the_hand_merge(tmp_path, base, precision, settings):
    """The written weights are W + alpha/r B A on the adapted rows (grouped-query qkv: 4 heads, 2 groups) and the
    base weights everywhere else, in float32 up to rounding, in bfloat16 up to the cast of that result."""
    run = tmp_path / "run"
    make_run(run, base, settings)
    merge_lora(run, precision=precision)
    config = Config.from_checkpoint(run)
    assert config.n_query_groups < config.n_head
    base_state = load_state_dict(base / "lit_model.pth")
    adapters = load_state_dict(run / "lit_model.pth.lora")
    state = load_state_dict(run / "lit_model.pth")
    expected = hand_merged(base_state, adapters, config, settings)
    assert set(state) == set(base_state)
    q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
    for key, value in state.items():
        if key not in expected:  # not adapted: the base weight as it was (cast)
            assert torch.equal(value, base_state[key].to(value.dtype)), key
            continue
        if precision is None:
            # float32 W + delta against float64: measured max abs difference 1.4e-8 (weights up to ~0.16); bound ~3.5x.
            assert value.dtype == torch.float32
            torch.testing.assert_close(value.double(), expected[key], atol=5e-8, rtol=0, msg=key)
        else:
            # The float32 result rounded to bfloat16 (8 significant bits): half a bf16 ulp, at most 2^-8 relative, plus
            # the float32 rounding before it (2^-24): measured max relative difference 3.89e-3 (2^-8 = 3.906e-3).
            assert value.dtype == torch.bfloat16
            torch.testing.assert_close(value.double(), expected[key], atol=0, rtol=2 ** -8 + 2 ** -22, msg=key)
        # A merge that does nothing fails: every adapted weight moved, by far more than the tolerance.
        moved = (expected[key] - base_state[key].double()).abs()
        if key.endswith("attn.qkv.weight") and not settings.key:
            assert moved[:q].min() > 0 and moved[q:q + kv].max() == 0 and moved[q + kv:].min() > 0, key
        assert moved.max() > 1e-2, key
        assert (value.double() - base_state[key].double()).abs().max() > 1e-2, key


# ---- errors: one line, exit code 1, nothing on disk changed ----------------------------------------------------------
def break_no_adapters(run: Path, base: Path) -> None:
    (run / "lit_model.pth.lora").unlink()


def break_no_hparams(run: Path, base: Path) -> None:
    (run / "hyperparameters.yaml").unlink()


def break_no_base_dir_recorded(run: Path, base: Path) -> None:
    hparams = yaml.safe_load((run / "hyperparameters.yaml").read_text())
    del hparams["checkpoint_dir"]
    (run / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))


def break_base_gone(run: Path, base: Path) -> None:
    shutil.rmtree(base)


def break_base_without_weights(run: Path, base: Path) -> None:
    (base / "lit_model.pth").unlink()


def break_adapter_rank(run: Path, base: Path) -> None:
    hparams = yaml.safe_load((run / "hyperparameters.yaml").read_text())
    hparams["lora_r"] = 8
    (run / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))


def break_adapter_targets(run: Path, base: Path) -> None:
    hparams = yaml.safe_load((run / "hyperparameters.yaml").read_text())
    hparams["lora_head"] = False
    (run / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))


def break_base_shape(run: Path, base: Path) -> None:
    """A base (and run config) 32 wide; the adapters were trained on a 64-wide base."""
    narrow = Config(**{**CONFIG, "n_embd": 32})
    save_state_dict(GPT(narrow).state_dict(), base / "lit_model.pth")
    narrow.save(base / "model_config.yaml")
    narrow.save(run / "model_config.yaml")


def break_run_config(run: Path, base: Path) -> None:
    Config(**{**CONFIG, "n_layer": 3}).save(run / "model_config.yaml")


def break_hparams_not_a_mapping(run: Path, base: Path) -> None:
    (run / "hyperparameters.yaml").write_text("- just\n- a list\n")


BREAKS = {
    "no_adapters": (break_no_adapters, "no lit_model.pth.lora"),
    "no_hparams": (break_no_hparams, "no hyperparameters.yaml"),
    "no_base_dir_recorded": (break_no_base_dir_recorded, "--pretrained_checkpoint_dir"),
    "base_gone": (break_base_gone, "does not exist"),
    "base_without_weights": (break_base_without_weights, "has no lit_model.pth"),
    "adapter_rank": (break_adapter_rank, "has shape"),
    "adapter_targets": (break_adapter_targets, "unexpected"),
    "base_shape": (break_base_shape, r"LoRA adapters in .* do not match the model config: lm_head.lora_A has shape"),
    "run_config": (break_run_config, r"weights in .* do not match the model config: \d+ missing \(first: transformer\.h\.2\."),
    "hparams_not_a_mapping": (break_hparams_not_a_mapping, "mapping"),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_errors_are_one_line_and_touch_nothing(tmp_path, base, case, capsys):
    breaker, message = BREAKS[case]
    run = tmp_path / "run"
    make_run(run, base)
    breaker(run, base)
    folders = [f for f in (run, base) if f.exists()]
    before = snapshot(*folders)

    with pytest.raises(UserError, match=message) as info:
        merge_lora(run)
    assert "\n" not in str(info.value)
    assert snapshot(*folders) == before

    # The command line: exit code 1, the message on one line, no traceback.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["merge_lora", str(run)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("litgpt merge_lora: error:") and err.count("\n") == 1 and "Traceback" not in err
    assert snapshot(*folders) == before


def test_unknown_precision_and_missing_folder(tmp_path, base):
    run = tmp_path / "run"
    make_run(run, base)
    with pytest.raises(UserError, match="Unknown precision"):
        merge_lora(run, precision="int3")
    with pytest.raises(UserError, match="does not exist"):
        merge_lora(tmp_path / "nowhere")
    assert not (run / "lit_model.pth").exists()


def test_help_describes_the_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["merge_lora", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("litgpt merge_lora", "checkpoint_dir", "--pretrained_checkpoint_dir", "--precision", "lit_model.pth.lora"):
        assert text in out

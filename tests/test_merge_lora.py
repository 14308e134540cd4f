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

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: intra-op threads only cost time, a lot of it on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def make_run(folder: Path, base: Path, settings: LoRASettings = SETTINGS, **hparams_overrides) -> GPT:
    """A LoRA finetuning output folder with 'trained' (random non-zero) adapters; returns the adapted model."""
    config = Config.from_checkpoint(base)
    model = GPT(config)
    add_lora(model, settings)
    load_base_weights(model, load_state_dict(base / "lit_model.pth"), source="base")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
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


@pytest.fixture
def base(tmp_path) -> Path:
    return make_base(tmp_path / "base")


def test_merge_gives_a_plain_checkpoint_with_the_adapted_logits(tmp_path, base):
    run = tmp_path / "run"
    adapted = make_run(run, base)
    merge_lora(run)
    merged = load_plain(run)
    expected = adapted(TOKENS)
    torch.testing.assert_close(merged(TOKENS), expected, atol=1e-5, rtol=0)
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
    torch.testing.assert_close(load_plain(run)(TOKENS), adapted(TOKENS), atol=1e-5, rtol=0)



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
    torch.testing.assert_close(merged(TOKENS), adapted(TOKENS), atol=0.1, rtol=0.05)


def test_missing_config_and_tokenizer_are_taken_from_the_base(tmp_path, base):
    run = tmp_path / "run"
    adapted = make_run(run, base)
    for name in ("model_config.yaml", "tokenizer.json", "tokenizer_config.json"):
        (run / name).unlink()
    merge_lora(run)
    assert (run / "model_config.yaml").is_file() and (run / "tokenizer.json").is_file()
    torch.testing.assert_close(load_plain(run)(TOKENS), adapted(TOKENS), atol=1e-5, rtol=0)


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


def break_already_merged(run: Path, base: Path) -> None:
    shutil.copy(base / "lit_model.pth", run / "lit_model.pth")


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
    "already_merged": (break_already_merged, "already holds a merged lit_model.pth"),
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

"""LoRA adapters to and from Hugging Face PEFT, checked to the logit against `peft.PeftModel` itself."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from hf_models import save_hf_model
from test_merge_lora import make_run

from litgpt.__main__ import main as cli_main
from litgpt.checkpoint.model_files import load_model_weights
from litgpt.config import Config
from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint
from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint
from litgpt.errors import UserError
from litgpt.io import load_state_dict
from litgpt.lora import LoRASettings, lora_state_dict
from litgpt.merge_lora import merge_lora
from litgpt.model import GPT

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKENS = torch.randint(0, 211, (2, 13), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny random Hugging Face Llama (GQA: 4 query heads over 2 groups, 3 layers, untied head) converted into a
    litgpt checkpoint in the same folder; tests only read it."""
    folder = tmp_path_factory.mktemp("peft") / "base"
    save_hf_model("llama", folder)
    convert_hf_checkpoint(folder)
    return folder


def make_lora_run(folder: Path, base: Path, settings: LoRASettings) -> GPT:
    """A LoRA run's step folder (adapters, hyperparameters, config; no merged weights) with random non-zero
    adapters; returns the adapted model."""
    return make_run(folder, base, settings, scale=0.1)


def load_plain(folder: Path) -> GPT:
    model = GPT(Config.from_checkpoint(folder))
    load_model_weights(model, load_state_dict(folder / "lit_model.pth"), str(folder))
    return model.eval()


@torch.no_grad()
def max_diff(lit: GPT, hf) -> float:
    ours = lit(TOKENS)[..., : hf.config.vocab_size]
    return (ours - hf(TOKENS).logits).abs().max().item()


def snapshot(*folders: Path) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for f in folders for p in sorted(f.rglob("*")) if p.is_file()}


# ---- export ---------------------------------------------------------------------------------------------------------
EXPORT_CASES = {
    "query-value": (LoRASettings(r=4, alpha=8, query=True, key=False, value=True),
                    {"q_proj", "v_proj"}),
    "all-with-mlp-and-head": (LoRASettings(r=3, alpha=7, query=True, key=True, value=True, projection=True, mlp=True,
                                           head=True),
                              {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}),
}


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_exported_adapter_on_exported_base_equals_our_merged_model(tmp_path, base, case):
    from transformers import AutoModelForCausalLM

    settings, targets = EXPORT_CASES[case]
    ours = make_lora_run(tmp_path / "run" / "step-000002", base, settings)
    out = tmp_path / "hf"
    convert_lit_checkpoint(tmp_path / "run" / "step-000002", out)  # adapters without merged weights: PEFT export

    values = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert values["peft_type"] == "LORA" and values["r"] == settings.r and values["lora_alpha"] == settings.alpha
    assert set(values["target_modules"]) == targets and values["rank_pattern"] == {}
    plain_hf = AutoModelForCausalLM.from_pretrained(out).eval()
    hf_base = AutoModelForCausalLM.from_pretrained(base).eval()  # the folder the litgpt base was converted from
    for name, tensor in hf_base.state_dict().items():
        torch.testing.assert_close(plain_hf.state_dict()[name], tensor, rtol=0, atol=0)  # the base, unmerged

    adapted = peft.PeftModel.from_pretrained(plain_hf, out / "adapter").eval()
    assert max_diff(ours, adapted) <= 1e-4
    assert max_diff(ours, hf_base) > 1e-2  # the adapters change the logits: the check above is not vacuous


def test_final_folder_converts_merged_unless_peft_is_asked(tmp_path, base, capsys):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "final"
    ours = make_lora_run(run, base, LoRASettings(r=2, alpha=4, mlp=True))
    merge_lora(run)  # what the run's final/ holds
    convert_lit_checkpoint(run, tmp_path / "merged")
    assert "--peft true" in capsys.readouterr().out
    assert not (tmp_path / "merged" / "adapter").exists()
    assert max_diff(ours, AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()) <= 1e-4

    cli_main(["convert_from_litgpt", str(run), str(tmp_path / "peft"), "--peft", "true"])
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "peft"),
                                             tmp_path / "peft" / "adapter").eval()
    assert max_diff(ours, adapted) <= 1e-4


# ---- import ---------------------------------------------------------------------------------------------------------
IMPORT_CASES = {
    # Independent A for q, k and v; part of the MLP only (up_proj gets zeros in ours).
    "qkv-and-part-of-the-mlp": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "down_proj"]),
    # Per-module ranks and scales (folded into B, padded), rsLoRA, two of three layers, the head.
    "patterns-rslora-some-layers": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"],
                                        rank_pattern={"v_proj": 2}, alpha_pattern={"lm_head": 3}, use_rslora=True,
                                        layers_to_transform=[0, 2]),
}


def make_peft_adapter(tmp_path: Path, base: Path, **lora_kwargs):
    """A PEFT LoRA adapter over the Hugging Face model in `base`, with random non-zero factors, saved to a folder."""
    from transformers import AutoModelForCausalLM

    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(**lora_kwargs))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    folder = tmp_path / "adapter"
    model.save_pretrained(folder)
    return model.eval(), folder


@pytest.mark.parametrize("case", IMPORT_CASES)
def test_peft_adapter_converts_into_ours_with_equal_logits(tmp_path, base, case):
    adapted, folder = make_peft_adapter(tmp_path, base, **IMPORT_CASES[case])
    # base_model_name_or_path names the Hugging Face folder, which convert_to_litgpt made a litgpt checkpoint too.
    cli_main(["convert_to_litgpt", str(folder)])
    hparams = yaml.safe_load((folder / "hyperparameters.yaml").read_text())
    assert Path(hparams["checkpoint_dir"]) == base.resolve()
    merge_lora(folder)
    ours = load_plain(folder)
    assert max_diff(ours, adapted) <= 1e-4
    with pytest.raises(UserError, match="merged from an earlier conversion"):  # it would go stale
        convert_hf_checkpoint(folder, overwrite=True)
    with adapted.disable_adapter():
        assert max_diff(ours, adapted) > 1e-2  # the adapter matters


def test_round_trip_ours_to_peft_and_back(tmp_path, base):
    settings = LoRASettings(r=3, alpha=6, dropout=0.0, query=True, key=True, value=False, projection=True, mlp=True)
    ours = make_lora_run(tmp_path / "run", base, settings)
    convert_lit_checkpoint(tmp_path / "run", tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf" / "adapter", pretrained_checkpoint_dir=base)
    back = load_state_dict(tmp_path / "hf" / "adapter" / "lit_model.pth.lora")
    assert LoRASettings.from_hparams(yaml.safe_load((tmp_path / "hf" / "adapter" / "hyperparameters.yaml").read_text())) == settings
    for name, tensor in lora_state_dict(ours).items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["phi3", "gpt_neox", "falcon_gqa", "phi"])
def test_fused_hugging_face_modules_both_ways(tmp_path, case):
    """Phi-3 fuses q/k/v and gate/up, GPT-NeoX interleaves q/k/v per head, Falcon groups them per KV head: our parts
    become one adapter of stacked rank there, and a PEFT adapter on the fused module gives each of our parts the
    shared A and its rows of B. (phi-2 keeps q, k and v apart.)"""
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    save_hf_model(case, base)
    convert_hf_checkpoint(base)
    settings = LoRASettings(r=2, alpha=5, query=True, key=False, value=True, projection=True, mlp=True, head=True)
    ours = make_lora_run(tmp_path / "run", base, settings)
    convert_lit_checkpoint(tmp_path / "run", tmp_path / "hf")
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"),
                                             tmp_path / "hf" / "adapter").eval()
    assert max_diff(ours, adapted) <= 1e-4

    targets = {"phi3": ["qkv_proj", "gate_up_proj", "o_proj"], "gpt_neox": ["query_key_value", "dense_h_to_4h"],
               "falcon_gqa": ["query_key_value", "dense_h_to_4h", "dense"], "phi": ["q_proj", "v_proj", "fc1", "dense"]}
    adapted, folder = make_peft_adapter(tmp_path, base, r=3, lora_alpha=4, target_modules=targets[case])
    convert_hf_checkpoint(folder, pretrained_checkpoint_dir=base)
    merge_lora(folder)
    assert max_diff(load_plain(folder), adapted) <= 1e-4


# ---- bad input --------------------------------------------------------------------------------------------------------
def _set_config(folder: Path, **values) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def _rename_keys(folder: Path, old: str, new: str) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file({key.replace(old, new): value for key, value in load_file(path).items()}, path)


BAD_ADAPTERS = {
    "ia3": (lambda folder: _set_config(folder, peft_type="IA3"), "PEFT IA3 adapter"),
    "dora": (lambda folder: _set_config(folder, use_dora=True), "DoRA"),
    "sequence-classification": (lambda folder: _set_config(folder, task_type="SEQ_CLS"), "CAUSAL_LM"),
    "embedding-target": (None, "embed_tokens"),
    "unknown-module": (lambda folder: _rename_keys(folder, "q_proj", "qq_proj"), "not a linear layer"),
    "other-base": (lambda folder: _set_config(folder, base_model_name_or_path=str(folder / "nowhere")),
                   "--pretrained_checkpoint_dir"),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_bad_adapter_is_one_line_and_touches_nothing(tmp_path, base, case, capsys):
    edit, expected = BAD_ADAPTERS[case]
    targets = ["q_proj", "embed_tokens"] if case == "embedding-target" else ["q_proj"]
    _, folder = make_peft_adapter(tmp_path, base, r=2, lora_alpha=4, target_modules=targets)
    if edit is not None:
        edit(folder)
    before = snapshot(folder, base)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert_to_litgpt", str(folder)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and len(err.strip().splitlines()) == 1 and expected in err, err
    assert snapshot(folder, base) == before


def test_peft_export_of_a_folder_without_adapters_is_refused(tmp_path, base, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert_from_litgpt", str(base), str(tmp_path / "out"), "--peft", "true"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "lit_model.pth.lora" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()

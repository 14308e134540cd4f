"""Conversion both ways, checked to the logit against `transformers` for every supported family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hf_models import FAMILY_CASES, build_hf_model, save_hf_model
from litgpt_forkserver import run_litgpt

from litgpt.checkpoint.model_files import load_model_weights
from litgpt.io import load_state_dict
from litgpt.config import Config
from litgpt.convert.families.configs import config_from_hf
from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint
from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint
from litgpt.errors import UserError
from litgpt.model import GPT

ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 211, (2, 19), generator=torch.Generator().manual_seed(0))


def load_lit(folder) -> GPT:
    model = GPT(Config.from_checkpoint(folder))
    load_model_weights(model, load_state_dict(folder / "lit_model.pth"), str(folder))
    return model.eval()


@torch.no_grad()
def max_logit_diff(lit: GPT, hf) -> float:
    ours = lit(TOKENS)[..., : hf.config.vocab_size]
    theirs = hf(TOKENS).logits
    return (ours - theirs).abs().max().item()


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_hf_to_litgpt_to_hf_logits(case, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir, out_dir = tmp_path / "hf", tmp_path / "back"
    hf = save_hf_model(case, hf_dir)
    convert_hf_checkpoint(hf_dir)
    lit = load_lit(hf_dir)
    assert max_logit_diff(lit, hf) <= 1e-4

    convert_lit_checkpoint(hf_dir, out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert type(reloaded) is type(hf)
    assert max_logit_diff(lit, reloaded) <= 1e-4
    # Weights survive the round trip bit for bit.
    original, back = hf.state_dict(), reloaded.state_dict()
    for name, tensor in original.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0, msg=name)


def test_config_from_older_layout_equals_new_layout(tmp_path):
    """config.json with rope_theta/rope_scaling (transformers 4) and rope_parameters (5) give one Config."""
    hf_dir = tmp_path / "hf"
    save_hf_model("llama3_rope", hf_dir)
    convert_hf_checkpoint(hf_dir)
    new_layout = Config.from_checkpoint(hf_dir)

    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (hf_dir / "config.json").write_text(json.dumps(config))
    convert_hf_checkpoint(hf_dir, overwrite=True)
    assert Config.from_checkpoint(hf_dir) == new_layout
    assert new_layout.rope_scaling["type"] == "llama3" and new_layout.rope_base == 500000.0


def test_sharded_safetensors_both_ways(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir, out_dir = tmp_path / "hf", tmp_path / "back"
    hf = build_hf_model("qwen3")
    hf.save_pretrained(hf_dir, max_shard_size="100KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    convert_hf_checkpoint(hf_dir)
    lit = load_lit(hf_dir)
    assert max_logit_diff(lit, hf) <= 1e-4

    convert_lit_checkpoint(hf_dir, out_dir, max_shard_size="100KB")
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) > 1 and all((out_dir / name).is_file() for name in shard_files)
    assert max_logit_diff(lit, AutoModelForCausalLM.from_pretrained(out_dir).eval()) <= 1e-4


def test_pytorch_bin_checkpoint(tmp_path):
    hf = build_hf_model("llama")
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    convert_hf_checkpoint(tmp_path)
    assert max_logit_diff(load_lit(tmp_path), hf) <= 1e-4


def test_dtype_option_and_registered_name(tmp_path):
    save_hf_model("llama", tmp_path)
    convert_hf_checkpoint(tmp_path, dtype="bfloat16")
    state = load_state_dict(tmp_path / "lit_model.pth")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    with pytest.raises(UserError, match="does not match"):
        convert_hf_checkpoint(tmp_path, model_name="pythia-14m")
    with pytest.raises(UserError, match="dtype"):
        convert_hf_checkpoint(tmp_path, dtype="float8")


def test_convert_from_litgpt_casts_dtype(tmp_path):
    from safetensors import safe_open

    save_hf_model("gemma2", tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf")
    convert_lit_checkpoint(tmp_path / "hf", tmp_path / "out", dtype="bfloat16")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ---- bad input ---------------------------------------------------------------------------------------------------------
def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(UserError, match="model_type 'bert'.*Supported"):
        convert_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("hf, named", [
    ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}, "Qwen3NextForCausalLM (model_type 'qwen3_next'), which"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]}, "Qwen2ForSequenceClassification (model_type 'qwen2'), not a causal"),
])
def test_unsupported_architecture_is_named_with_the_supported_ones(hf, named):
    with pytest.raises(UserError) as info:
        config_from_hf(hf)
    message = str(info.value)
    assert named in message and "\n" not in message
    for model_type in ("llama", "deepseek_v3", "gpt_oss", "glm4_moe", "olmo2", "smollm3", "falcon", "phi3"):
        assert model_type in message.split("Supported model_type values: ")[1]


def test_not_a_hf_folder(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        convert_hf_checkpoint(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        convert_hf_checkpoint(tmp_path / "nope")


def test_weights_that_do_not_fit_config_json(tmp_path):
    save_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"mlp\.gate_proj\.weight has shape \(96, 64\).*\(80, 64\)"):
        convert_hf_checkpoint(tmp_path)
    assert not (tmp_path / "lit_model.pth").exists()

    config["intermediate_size"] = 96
    config["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"lacks 'model\.layers\.3\."):
        convert_hf_checkpoint(tmp_path)


def test_litgpt_checkpoint_that_does_not_match_its_config(tmp_path):
    save_hf_model("llama", tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf")
    config_path = tmp_path / "hf" / "model_config.yaml"
    values = yaml.safe_load(config_path.read_text())
    values["n_layer"] = 2
    config_path.write_text(yaml.safe_dump(values))
    with pytest.raises(UserError, match="does not match its model_config.yaml"):
        convert_lit_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_folder_is_untouched(tmp_path):
    save_hf_model("llama", tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        convert_lit_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_config_that_hf_cannot_express(tmp_path):
    from litgpt.convert.families.configs import config_to_hf

    config = Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, norm_qk=True, hf_model_type="llama")
    with pytest.raises(UserError, match="norm_qk=True"):
        config_to_hf(config)


def test_cli_errors_are_one_line_with_exit_code_1(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    for args in (["convert_to_litgpt", str(tmp_path)], ["convert_from_litgpt", str(tmp_path), str(tmp_path / "o")]):
        result = run_litgpt(args, cwd=ROOT)
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert "error:" in result.stderr


def test_cli_converts(tmp_path):
    hf = save_hf_model("qwen2", tmp_path / "hf")
    result = run_litgpt(["convert_to_litgpt", tmp_path / "hf", "--dtype", "float32"], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert max_logit_diff(load_lit(tmp_path / "hf"), hf) <= 1e-4


def test_gemma3_image_text_checkpoint_converts_its_language_model(tmp_path):
    """Gemma 3 4B+ ship as Gemma3ForConditionalGeneration: the text model converts, the vision tower is left out."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(0)
    text = Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=211, sliding_window=5)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=210,
                          boi_token_index=208, eoi_token_index=209)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.5)
    hf.save_pretrained(tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf")
    lit = load_lit(tmp_path / "hf")
    assert lit.config.hf_model_type == "gemma3_text" and lit.config.sliding_window_pattern == 6
    with torch.no_grad():
        ours, theirs = lit(TOKENS), hf(input_ids=TOKENS).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_round_trip_folder_loads_with_auto_tokenizer(tmp_path):
    from tokenizer_helpers import make_tokenizer_folder
    from transformers import AutoTokenizer

    save_hf_model("llama", tmp_path / "hf")
    make_tokenizer_folder(tmp_path / "hf", "llama")
    convert_hf_checkpoint(tmp_path / "hf")
    convert_lit_checkpoint(tmp_path / "hf", tmp_path / "back")
    original, reloaded = AutoTokenizer.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(tmp_path / "back")
    text = "Hello there, wörld! 123"
    assert reloaded.encode(text) == original.encode(text) and reloaded.decode(original.encode(text)) == original.decode(original.encode(text))
    generation = json.loads((tmp_path / "back" / "generation_config.json").read_text())
    assert generation.get("eos_token_id") == original.eos_token_id


# ---- existing outputs ------------------------------------------------------------------------------------------------
def litgpt_cli(*args, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "litgpt", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, preexec_fn=preexec_fn)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if ": error: " in line]
    return line


def test_convert_to_litgpt_replaces_weights_only_when_told(tmp_path):
    hf = save_hf_model("llama", tmp_path)
    convert_hf_checkpoint(tmp_path)
    before = (tmp_path / "lit_model.pth").read_bytes()
    error = one_error_line(litgpt_cli("convert_to_litgpt", tmp_path, "--dtype", "bfloat16"))
    assert "lit_model.pth' exists already: pass --overwrite true" in error, error
    assert (tmp_path / "lit_model.pth").read_bytes() == before
    convert_hf_checkpoint(tmp_path, dtype="bfloat16", overwrite=True)
    assert {t.dtype for t in load_state_dict(tmp_path / "lit_model.pth").values()} == {torch.bfloat16}
    assert max_logit_diff(load_lit(tmp_path).float(), hf) <= 0.1  # bf16 weights of the same model


def test_consolidate_replaces_only_when_told_and_never_with_a_partial_file(tmp_path):
    """An existing lit_model.pth stays as it was when consolidate is not told to replace it, and when the write of
    its replacement fails (a file-size limit below the new file's size); with room, --overwrite replaces it."""
    import resource
    import signal

    import torch.distributed.checkpoint as dcp

    weights = {"a.weight": torch.randn(256, 256), "b.bias": torch.randn(256)}
    dcp.save({"model": weights}, checkpoint_id=tmp_path / "step" / "sharded", no_dist=True)
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"old": torch.zeros(4)}, out / "lit_model.pth")
    old = (out / "lit_model.pth").read_bytes()
    error = one_error_line(litgpt_cli("consolidate", tmp_path / "step", "--out_dir", out))
    assert "exists already: pass --overwrite true" in error, error

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    result = litgpt_cli("consolidate", tmp_path / "step", "--out_dir", out, "--overwrite", "true",
                        preexec_fn=small_files)
    assert "File too large. No file there was replaced" in one_error_line(result)
    assert (out / "lit_model.pth").read_bytes() == old and sorted(p.name for p in out.iterdir()) == ["lit_model.pth"]

    from litgpt.consolidate import main as consolidate

    consolidate(tmp_path / "step", out_dir=out, overwrite=True)
    consolidated = load_state_dict(out / "lit_model.pth")
    assert consolidated.keys() == weights.keys()
    assert all(torch.equal(consolidated[key], weights[key]) for key in weights)

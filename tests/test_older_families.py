"""Falcon, StableLM, phi-1.5/2 and OLMo 1 through the commands: greedy KV-cache generation equal to transformers',
finetune_lora and merge, generate, the converted result in transformers, `litgpt plan`, and bad config.json input.

(Conversion both ways, logit for logit, is tests/test_convert.py's, over tests/hf_models.py's cases; the named configs
are in tests/test_config_registry.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import write_random_checkpoint
from hf_models import build_hf_model
from test_plan import autograd_saved_bytes, planned_saved

from litgpt.__main__ import main as cli_main
from litgpt.checkpoint.model_files import load_model_weights
from litgpt.config import Config
from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint
from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint
from litgpt.data.tiny import TINY_DIR
from litgpt.errors import UserError
from litgpt.generate import generate
from litgpt.io import load_state_dict
from litgpt.lora import LoRASettings, add_lora, load_base_weights
from litgpt.model import GPT

NEW_TOKENS = 20


def load_lit(folder: Path) -> GPT:
    model = GPT(Config.from_checkpoint(folder))
    load_model_weights(model, load_state_dict(folder / "lit_model.pth"), str(folder))
    return model.eval()


@pytest.mark.slow
# (stablelm_parallel, with its tied head, repeats one token: no test of the cache)
@pytest.mark.parametrize("case", ["falcon_mqa", "falcon_gqa", "stablelm_qk_norm", "phi", "olmo"])
def test_kv_cache_greedy_tokens_equal_transformers(case, tmp_path):
    from transformers import GenerationConfig

    hf = build_hf_model(case)
    with torch.no_grad():  # larger weights: logits far apart, so greedy choices are not near ties
        for param in hf.parameters():
            if param.dim() > 1:
                param.mul_(4)
    hf.save_pretrained(tmp_path)
    convert_hf_checkpoint(tmp_path)
    model = load_lit(tmp_path)
    prompt = torch.tensor([3, 17, 100, 42, 7, 150, 9])
    with torch.no_grad():
        ours = list(generate(model, prompt, NEW_TOKENS, temperature=0))
        greedy = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        theirs = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], generation_config=greedy)
    theirs = theirs[0, len(prompt):].tolist()
    assert len(theirs) == NEW_TOKENS and len(set(theirs)) > 3  # a continuation, not one token repeated
    assert ours == theirs


# Tiny models from the named configs (their family's switches), sized for the bundled 4096-token tokenizer.
TINY = dict(n_layer=2, n_embd=64, n_head=4, intermediate_size=96, vocab_size=4096, padded_vocab_size=4096,
            block_size=128)
FINETUNED = {
    "falcon-40b": dict(TINY, n_query_groups=2, bias=True),  # new_decoder_architecture: ln_attn, ln_mlp, grouped KV
    "falcon-7b": dict(TINY, n_query_groups=1),  # multi-query, one shared LayerNorm
    "phi-2": TINY,  # rotary on 0.4 of a 16-element head: 6 elements
}
FAST = ["--train.max_steps", "3", "--train.log_interval", "1", "--eval.max_iters", "1", "--eval.max_new_tokens", "4",
        "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--train.max_seq_length", "96"]


@pytest.fixture(scope="module")
def instructions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sft") / "data.json"
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:20]
    path.write_text(json.dumps([{"instruction": "Tell a story.", "output": s[:150]} for s in stories]))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FINETUNED))
def test_finetune_lora_merge_generate_and_convert(name, tmp_path, instructions, capsys):
    """finetune_lora trains adapters on every linear layer; its merged final checkpoint computes what base + adapters
    compute, generates, and converts to a transformers model with the same logits."""
    from transformers import AutoModelForCausalLM

    config = Config.from_name(name, **FINETUNED[name])
    base = write_random_checkpoint(tmp_path / "base", config)
    out, head = tmp_path / "out", not config.tie_embeddings  # a tied head (Falcon's) takes no adapter
    cli_main(["finetune_lora", str(base), "--out_dir", str(out), "--data", "JSON", "--data.json_path",
              str(instructions), "--data.val_split_fraction", "0.2", "--lora_key", "true", "--lora_projection", "true",
              "--lora_mlp", "true", "--lora_head", str(head).lower(), "--train.lr_warmup_steps", "0", *FAST])
    final = out / "final"
    adapters = load_state_dict(final / "lit_model.pth.lora")
    assert all(value.abs().sum() > 0 for key, value in adapters.items() if ".lora_B" in key)  # B starts at zero
    assert any(".mlp.fc.lora_B" in key for key in adapters) and any("lm_head.lora_B" in key for key in adapters) == head

    cli_main(["merge_lora", str(final)])
    adapted = GPT(config)
    add_lora(adapted, LoRASettings(key=True, projection=True, mlp=True, head=head))
    load_base_weights(adapted, load_state_dict(base / "lit_model.pth"), source="base")
    adapted.load_state_dict(adapters, strict=False)
    merged, plain = load_lit(final), load_lit(base)
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted.eval()(tokens)
        torch.testing.assert_close(merged(tokens), expected, atol=2e-5, rtol=0)
        assert (expected - plain(tokens)).abs().max() > 1e-4  # training moved the model

    capsys.readouterr()
    cli_main(["generate", str(final), "--prompt", "Once upon a time", "--max_new_tokens", "5", "--device", "cpu"])
    assert "Once upon a time" in capsys.readouterr().out

    convert_lit_checkpoint(final, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.model_type == config.hf_model_type
    with torch.no_grad():
        assert (hf(tokens).logits - merged(tokens)).abs().max() <= 1e-4


# `litgpt plan` counts the activations autograd keeps, tensor for tensor, on these layouts too.
PLANNED = {
    "falcon-7b": dict(TINY, n_query_groups=1),
    "falcon-40b": dict(TINY, n_query_groups=2),
    "stablelm-3b-4e1t": dict(TINY, norm_qk=True, norm_qk_per_head=True, attn_bias=True, n_query_groups=2),
    "phi-2": TINY,
    "OLMo-1B-hf": dict(TINY, clip_qkv=0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, LoRASettings(key=True, projection=True, mlp=True, dropout=0.05)])
@pytest.mark.parametrize("name", list(PLANNED))
def test_plan_counts_saved_activations_as_autograd(name, lora):
    config = Config.from_name(name, **PLANNED[name])
    measured_layers, measured_root = autograd_saved_bytes(config, "32-true", lora, "cpu")
    planned = planned_saved(config, "32-true", "cpu", lora)
    assert planned.per_layer == measured_layers and planned.root == measured_root


@pytest.mark.slow
def test_plan_command_on_a_named_falcon(capsys):
    cli_main(["plan", "--model_name", "falcon-7b", "--json", "true", "--devices", "8"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["model_name"] == "falcon-7b"


# ---- bad input -------------------------------------------------------------------------------------------------------
def _falcon_config(tmp_path: Path, **changes) -> Path:
    hf = build_hf_model("falcon_gqa").config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**hf, **changes}))
    return tmp_path


@pytest.mark.parametrize("changes, named", [
    (dict(alibi=True), "alibi=true"),
    (dict(new_decoder_architecture=True, parallel_attn=False), "parallel_attn=true"),
    (dict(new_decoder_architecture=False, multi_query=True, num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn=1"),
    (dict(activation="relu"), "activation 'relu'"),
])
def test_unsupported_falcon_switches_are_named(tmp_path, changes, named):
    from litgpt.convert.families.configs import config_from_hf
    from litgpt.convert.hf_to_litgpt import read_hf_config

    folder = _falcon_config(tmp_path, **changes)
    with pytest.raises(UserError) as error:
        config_from_hf(read_hf_config(folder), "config.json")
    assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("changes, named", [
    (dict(norm_affine=False, norm_class_name="RMSNorm"), "norm_affine=False"),
    (dict(clip_qkv=0.0), "clip_qkv must be a positive number"),
    (dict(norm_qk_per_head=True), "norm_qk_per_head=True needs norm_qk=True"),
])
def test_contradicting_fields_are_named(changes, named):
    with pytest.raises(UserError, match=named):
        Config(**{**TINY, **changes})


@pytest.mark.parametrize("name, changes, named", [
    ("falcon-40b", dict(parallel_residual=False, n_query_groups=2),
     "grouped-query attention only with parallel_residual=True"),
    ("falcon-7b", dict(shared_attention_norm=False, parallel_residual=False, n_query_groups=1, bias=True,
                       rotary_percentage=0.5), "rotary_percentage=0.5 (needs 1.0)"),
    ("stablelm-3b-4e1t", dict(parallel_residual=True), "shared_attention_norm equal to parallel_residual"),
    ("OLMo-1B-hf", dict(norm_affine=True), "norm_affine=True (needs False)"),
])
def test_configs_hugging_face_cannot_hold_are_named(name, changes, named):
    from litgpt.convert.families.configs import config_to_hf

    with pytest.raises(UserError, match=re.escape(named)) as error:
        config_to_hf(Config.from_name(name, **dict(TINY, **changes)))
    assert "\n" not in str(error.value)


def test_fields_survive_model_config_yaml(tmp_path):
    """Our fields that LitGPT lacks ride in model_config.yaml and come back; OLMo's weightless LayerNorm is also
    spelled LitGPT's way (a name with "OLMo")."""
    config = Config(**TINY, name="my-model", norm_class_name="LayerNorm", norm_affine=False, clip_qkv=2.5,
                    hf_model_type="olmo")
    config.save(tmp_path / "model_config.yaml")
    assert "(OLMo)" in (tmp_path / "model_config.yaml").read_text()
    assert Config.from_file(tmp_path / "model_config.yaml") == config
    qk = Config(**TINY, norm_class_name="LayerNorm", norm_qk=True, norm_qk_per_head=True, hf_model_type="stablelm")
    qk.save(tmp_path / "model_config.yaml")
    assert Config.from_file(tmp_path / "model_config.yaml") == qk


# The published config.json files (their architecture keys, written out by hand): `litgpt download NAME` converts with
# what they derive and names the result after the registered model only when the two agree.
PUBLISHED_JSON = {
    "falcon-7b": dict(model_type="falcon", alibi=False, bias=False, hidden_size=4544, layer_norm_epsilon=1e-5,
                      multi_query=True, new_decoder_architecture=False, num_attention_heads=71, num_hidden_layers=32,
                      parallel_attn=True, vocab_size=65024),
    "falcon-40b": dict(model_type="falcon", alibi=False, bias=False, hidden_size=8192, layer_norm_epsilon=1e-5,
                       multi_query=True, new_decoder_architecture=True, num_attention_heads=128, num_hidden_layers=60,
                       num_kv_heads=8, parallel_attn=True, vocab_size=65024),
    "phi-2": dict(model_type="phi", hidden_act="gelu_new", hidden_size=2560, intermediate_size=10240,
                  layer_norm_eps=1e-5, max_position_embeddings=2048, num_attention_heads=32, num_hidden_layers=32,
                  num_key_value_heads=32, partial_rotary_factor=0.4, qk_layernorm=False, rope_scaling=None,
                  rope_theta=10000.0, tie_word_embeddings=False, vocab_size=51200),
    "OLMo-1B-hf": dict(model_type="olmo", attention_bias=False, clip_qkv=None, hidden_act="silu", hidden_size=2048,
                       intermediate_size=8192, max_position_embeddings=2048, num_attention_heads=16,
                       num_hidden_layers=16, num_key_value_heads=16, rope_scaling=None, rope_theta=10000.0,
                       tie_word_embeddings=True, vocab_size=50304),
    "stablelm-3b-4e1t": dict(model_type="stablelm", hidden_act="silu", hidden_size=2560, intermediate_size=6912,
                             layer_norm_eps=1e-5, max_position_embeddings=4096, num_attention_heads=32,
                             num_hidden_layers=32, num_key_value_heads=32, partial_rotary_factor=0.25,
                             rope_theta=10000, tie_word_embeddings=False, use_qkv_bias=False, vocab_size=50304),
    "stablelm-base-alpha-3b": dict(model_type="gpt_neox", hidden_act="gelu", hidden_size=4096, intermediate_size=16384,
                                   layer_norm_eps=1e-5, max_position_embeddings=4096, num_attention_heads=32,
                                   num_hidden_layers=16, rotary_emb_base=10000, rotary_pct=0.25,
                                   tie_word_embeddings=False, use_parallel_residual=True, vocab_size=50688),
}


@pytest.mark.parametrize("name", list(PUBLISHED_JSON))
def test_published_config_json_derives_the_named_config(name):
    from litgpt.convert.families.configs import config_from_hf
    from litgpt.convert.hf_to_litgpt import architecture_differences

    derived = config_from_hf(PUBLISHED_JSON[name], f"{name}/config.json")
    assert architecture_differences(Config.from_name(name), derived) == ""

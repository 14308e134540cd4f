"""gpt-oss: attention sinks, the clamped SwiGLU, biased experts and router, MXFP4 checkpoints, every command at tiny
scale. Conversion and logits against transformers are in tests/test_convert.py (case "gpt_oss")."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from checkpoint_helpers import write_random_checkpoint
from hf_models import build_hf_model, save_hf_model

from litgpt.config import Config
from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint, dequantize_mxfp4
from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR
from litgpt.errors import UserError
from litgpt.io import load_state_dict
from litgpt.mlp import GatedProduct
from litgpt.model import GPT

# A gpt-oss-shaped model: every feature of the family, windows shorter than the test sequences.
TINY = dict(
    name="tiny-gpt-oss", hf_model_type="gpt_oss", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=2,
    n_embd=64, n_head=4, head_size=16, n_query_groups=2, bias=True, mlp_class_name="LLaMAMoE", intermediate_size=32,
    moe_intermediate_size=32, n_expert=4, n_expert_per_token=2, rope_base=150000.0,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                      truncate=False),
    sliding_window_size=6, sliding_window_pattern=2, attention_sinks=True, router_bias=True, swiglu_alpha=1.702,
    swiglu_limit=0.3, prompt_style="harmony",
)


def tiny_model(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    model = GPT(Config(**{**TINY, **changes}))
    model.init_weights()
    with torch.no_grad():  # non-zero sinks and biases, so that a dropped one shows
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                param.normal_(0, 0.5)
    return model.eval()


def test_fields_round_trip_through_model_config_yaml(tmp_path):
    config = Config(**TINY)
    config.save(tmp_path / "model_config.yaml")
    assert Config.from_file(tmp_path / "model_config.yaml") == config


# ---- the layers ------------------------------------------------------------------------------------------------------
def test_sinks_attention_equals_a_softmax_with_an_extra_column():
    model = tiny_model()
    attn = model.transformer.h[0].attn
    q, k, v = (torch.randn(2, n, 9, 16) for n in (4, 2, 2))
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    ours = attn.attend(q, k, v, mask)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-2, -1) / 4).masked_fill(~mask, -math.inf)
    exp = scores.exp()
    weights = exp / (exp.sum(-1, keepdim=True) + attn.sinks.exp().view(1, 4, 1, 1))  # the sink only in the sum
    torch.testing.assert_close(ours, weights @ v)


@pytest.mark.parametrize("per_row", [False, True])
def test_kv_cache_decoding_equals_the_full_forward(per_row):
    """Windows of 6 over 14 tokens: the prompt and each decoded token through the cache give the logits of one pass;
    with per-row positions, each row its own prompt length."""
    model = tiny_model()
    tokens = torch.randint(0, 4096, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        model.set_kv_cache(batch_size=2, max_seq_length=32)
        if not per_row:
            steps = [model(tokens[:, :5], torch.arange(5))]
            steps += [model(tokens[:, t : t + 1], torch.tensor([t])) for t in range(5, 14)]
            torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
            return
        model(tokens[:, :8], torch.arange(8))  # row 0 then decodes at 3: the mask hides what it cached past that
        positions = torch.tensor([[3], [8]])
        out = model(tokens.gather(1, positions), positions)
    torch.testing.assert_close(out[0, 0], full[0, 3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 0], full[1, 8], atol=1e-5, rtol=1e-5)


def test_clamped_swiglu_and_its_gradient_equal_autograd_on_the_formula():
    gate = (torch.randn(64, 8, dtype=torch.float64) * 0.5).requires_grad_()
    up = (torch.randn(64, 8, dtype=torch.float64) * 0.5).requires_grad_()
    ours = GatedProduct.apply(gate, up, "clamped_swiglu", 1.702, 0.3)
    g = gate.clamp(max=0.3)
    reference = g * torch.sigmoid(1.702 * g) * (up.clamp(-0.3, 0.3) + 1)  # transformers' GptOssExperts
    grad = torch.randn_like(ours)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(ours, (gate, up), grad), torch.autograd.grad(reference, (gate, up), grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kernel", ["grouped", "blocks"])
def test_biased_experts_run_without_modules_and_equal_them(kernel):
    """The grouped and blocked kernels add each row's expert bias: outputs and every gradient equal the expert
    modules' (the "modules" path, one host read per layer, is left to quantized experts)."""
    moe = tiny_model().transformer.h[0].mlp
    assert moe._kernel(torch.zeros(1, 64), torch.float32) == "grouped"
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(1))
    results = {}
    for name in ("modules", kernel):
        moe._kernel = lambda *args, name=name: name
        moe.zero_grad()
        out = moe(x)
        out.square().sum().backward()
        results[name] = (out, {n: p.grad.clone() for n, p in moe.named_parameters()})
    torch.testing.assert_close(results[kernel][0], results["modules"][0], atol=1e-6, rtol=1e-5)
    for name, grad in results["modules"][1].items():
        torch.testing.assert_close(results[kernel][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_router_top_k_softmax_equals_renormalized_softmax():
    """gpt-oss takes the softmax of the top-k logits; litgpt the full softmax's top k renormalized: the same."""
    logits = torch.randn(50, 8, dtype=torch.float64)
    top, chosen = logits.topk(3, dim=-1)
    probs = logits.softmax(-1).gather(1, chosen)
    torch.testing.assert_close(top.softmax(-1), probs / probs.sum(-1, keepdim=True))


# ---- MXFP4 checkpoints ----------------------------------------------------------------------------------------------
def e2m1(code: int) -> float:
    """A 4-bit float from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def test_mxfp4_dequantization_equals_a_hand_computation():
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), dtype=torch.uint8, generator=generator)  # 2 experts, out 3, in 64
    scales = torch.randint(120, 134, (2, 3, 2), dtype=torch.uint8, generator=generator)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (2, 64, 3) and ours.dtype == torch.bfloat16
    for e in range(2):
        for o in range(3):
            for i in range(64):
                byte = int(blocks[e, o, i // 32, (i % 32) // 2])
                code = byte & 0x0F if i % 2 == 0 else byte >> 4
                expected = e2m1(code) * 2.0 ** (int(scales[e, o, i // 32]) - 127)
                assert ours[e, i, o].item() == expected, (e, o, i)


def quantize_experts(hf, folder):
    """Give `hf`'s experts random MXFP4 weights, save it as published gpt-oss folders are (blocks and scales, a
    quantization_config), and load transformers' own dequantization of them into `hf`."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for name, param in hf.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")):
            n_expert, n_in, n_out = param.shape
            blocks = torch.randint(0, 256, (n_expert, n_out, n_in // 32, 16), dtype=torch.uint8, generator=generator)
            scales = torch.randint(118, 124, (n_expert, n_out, n_in // 32), dtype=torch.uint8, generator=generator)
            del tensors[name]
            tensors.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_checkpoint_converts_to_transformers_dequantized_weights(tmp_path):
    from test_convert import load_lit, max_logit_diff

    hf = build_hf_model("gpt_oss")
    quantize_experts(hf, tmp_path)
    convert_hf_checkpoint(tmp_path, dtype="float32")
    lit = load_lit(tmp_path)
    experts = hf.model.layers[1].mlp.experts
    ours = lit.transformer.h[1].mlp.experts[2]
    assert torch.equal(ours.fc_1.weight, experts.gate_up_proj[2][:, ::2].t())
    assert torch.equal(ours.proj.weight, experts.down_proj[2].t())
    assert max_logit_diff(lit, hf) <= 1e-4


def test_a_contradicting_config_json_is_one_line(tmp_path):
    save_hf_model("gpt_oss", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(experts_per_token=3, initial_context_length=4096)  # num_experts_per_tok 2, original 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as error:
        convert_hf_checkpoint(tmp_path)
    message = str(error.value)
    assert "\n" not in message and "num_experts_per_tok=2 but experts_per_token=3" in message
    assert "original_max_position_embeddings=32 but initial_context_length=4096" in message
    with pytest.raises(UserError, match="swiglu_alpha .* and swiglu_limit .* go together"):
        Config(**{**TINY, "swiglu_alpha": None})


# The published config.json of openai/gpt-oss-20b, written out by hand (gpt-oss-120b: 36 layers, 128 experts).
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999, "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_the_published_config_json_converts_to_the_named_config(name):
    from litgpt.convert.families.configs import config_from_hf

    published = dict(PUBLISHED_20B)
    if name == "gpt-oss-120b":
        published.update(num_hidden_layers=36, num_local_experts=128)
        published["layer_types"] = ["sliding_attention", "full_attention"] * 18
    converted = config_from_hf(published)
    named = Config.from_name(name)
    for field in ("name", "hf_config", "prompt_style"):
        setattr(converted, field, getattr(named, field))
    assert converted == named


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_local_experts=32, num_experts=16), "num_local_experts=32 but num_experts=16"),
        (dict(attention_bias=False), "attention_bias=false"),
        (dict(quantization_config={"quant_method": "bitsandbytes"}), "'bitsandbytes'"),
        (dict(layer_types=["full_attention", "sliding_attention"] * 12), "arrangement of sliding-window layers"),
    ],
)
def test_bad_gpt_oss_config_json_is_one_line(change, message):
    from litgpt.convert.families.configs import config_from_hf

    with pytest.raises(UserError) as error:
        config_from_hf({**PUBLISHED_20B, **change})
    assert message in str(error.value) and "\n" not in str(error.value)


# ---- commands ----------------------------------------------------------------------------------------------------------
def test_greedy_generation_equals_transformers(tmp_path):
    from test_convert import load_lit

    from litgpt.generate import generate

    hf = save_hf_model("gpt_oss", tmp_path)
    convert_hf_checkpoint(tmp_path)
    lit = load_lit(tmp_path)
    prompt = torch.randint(0, 211, (4,), generator=torch.Generator().manual_seed(2))
    ours = list(generate(lit, prompt, max_new_tokens=12, temperature=0.0))  # past the window of 5
    theirs = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 4:].tolist()
    assert ours == theirs


def test_plan_counts_sinks_biases_and_experts():
    from litgpt.plan import recipe_for
    from litgpt.plan.layout import parameter_layout

    config = Config(**TINY)
    layout = parameter_layout(recipe_for(config))
    counted = sum(math.prod(p.shape) for p in layout.root) + sum(math.prod(p.shape) for b in layout.blocks for p in b)
    per_expert = 3 * 64 * 32 + 2 * 32 + 64
    attention = 64 * (4 + 2 + 2) * 16 + (4 + 2 + 2) * 16 + 64 * 64 + 64 + 4  # q/k/v, their biases, proj, sinks
    router = 64 * 4 + 4
    per_block = attention + 4 * per_expert + router + 2 * 64
    assert counted == 2 * per_block + 2 * 4096 * 64 + 64


@pytest.mark.slow  # five commands in turn: with the whole suite (CI)
def test_every_command_runs_on_a_tiny_gpt_oss(tmp_path):
    """pretrain -> finetune_lora (adapters on attention and experts), finetune_full -> merge_lora -> generate,
    compress_moe and distill (the compressed model as the student of the pretrained one), in-process as a user types
    them."""
    from litgpt.__main__ import main

    Config(**TINY).save(tmp_path / "model.yaml")
    data = ["--data", "Tiny", "--data.cache_dir", str(tmp_path / "cache")]
    fast = ["--train.max_steps", "2", "--train.log_interval", "1", "--train.max_seq_length", "32",
            "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--eval.max_iters", "1",
            "--eval.interval", "1000", "--compiler", "none"]
    main(["pretrain", "--model_config", str(tmp_path / "model.yaml"), "--tokenizer_dir", str(TOKENIZER_DIR),
          "--out_dir", str(tmp_path / "pretrained"), *data, *fast])
    base = tmp_path / "pretrained" / "final"
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.json").write_text(json.dumps([{"instruction": "Tell a story.", "output": s[:100]}
                                              for s in (TINY_DIR / "val.txt").read_text().split("\n\n")[:8]]))
    main(["finetune_lora", str(base), "--out_dir", str(tmp_path / "lora"), "--lora_mlp", "true", "--lora_r", "4",
          "--data", "JSON", "--data.json_path", str(texts / "a.json"), "--data.val_split_fraction", "0.25", *fast[:-2]])
    adapters = load_state_dict(tmp_path / "lora" / "final" / "lit_model.pth.lora")
    assert any(".mlp.experts.3.fc_1.lora_A" in k for k in adapters) and any(".attn.qkv.lora_A" in k for k in adapters)
    main(["finetune_full", str(base), "--out_dir", str(tmp_path / "full"), "--data", "JSON", "--data.json_path",
          str(texts / "a.json"), "--data.val_split_fraction", "0.25", *fast[:-2]])
    assert (tmp_path / "full" / "final" / "lit_model.pth").is_file()
    main(["merge_lora", str(tmp_path / "lora" / "final")])
    main(["generate", str(tmp_path / "lora" / "final"), "--prompt", "Once", "--max_new_tokens", "12"])
    main(["compress_moe", str(base), "--out_dir", str(tmp_path / "compressed"), "--num_experts", "3",
          "--calibration.samples", "2", "--calibration.max_seq_length", "16"])
    compressed = load_state_dict(tmp_path / "compressed" / "lit_model.pth")
    original = load_state_dict(base / "lit_model.pth")
    report = json.loads((tmp_path / "compressed" / "compress_moe.json").read_text())
    kept = [entry["expert"] for entry in report["layers"][0]["kept"]]
    assert torch.equal(compressed["transformer.h.0.mlp.gate.bias"], original["transformer.h.0.mlp.gate.bias"][kept])
    main(["distill", str(tmp_path / "compressed"), "--teacher_dir", str(base), "--out_dir", str(tmp_path / "distilled"),
          *data, *fast])
    assert (tmp_path / "distilled" / "final" / "lit_model.pth").is_file()


@pytest.mark.slow  # three training processes
def test_two_fully_sharded_processes_equal_one(tmp_path):
    """litgpt pretrain of the tiny gpt-oss on 2 FSDP processes (gloo) against 1: the same losses and final weights
    (sinks, biases and every expert)."""
    from test_distributed import TRAIN, assert_close_runs, litgpt

    Config(**TINY).save(tmp_path / "model.yaml")
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, story in enumerate((TINY_DIR / "train.txt").read_text().split("\n\n")[:60]):
        (texts / f"{i:03d}.txt").write_text(story)
    runs = {}
    for devices in (1, 2):
        out_dir = runs[devices] = tmp_path / f"devices-{devices}"
        result = litgpt("pretrain", "--model_config", tmp_path / "model.yaml", "--tokenizer_dir", TOKENIZER_DIR,
                        "--data", "TextFiles", "--data.train_data_path", texts, "--data.cache_dir",
                        tmp_path / f"cache-{devices}", "--out_dir", out_dir, *TRAIN, "--seed", "5", "--devices",
                        devices, "--fsdp.sharding_strategy", "FULL_SHARD")
        assert result.returncode == 0, result.stderr
    assert_close_runs(runs[2], runs[1], "lit_model.pth")

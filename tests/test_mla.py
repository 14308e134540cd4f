"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): config checks, both KV caches, greedy decoding against
transformers, FP8 checkpoints with a multi-token prediction layer, LoRA on its projections."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from hf_models import build_hf_model, save_hf_model

from litgpt.config import Config
from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint, dequantize_fp8_blocks
from litgpt.errors import UserError
from litgpt.generate import generate
from litgpt.io import load_state_dict
from litgpt.lora import LoRALinear, LoRASettings, add_lora, merge_lora_weights
from litgpt.model import GPT, MultiheadLatentAttention

MLA = dict(block_size=64, vocab_size=97, padded_vocab_size=97, n_layer=2, n_embd=48, n_head=4, head_size=20,
           intermediate_size=64, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=12, qk_rope_head_dim=8,
           v_head_dim=10, rope_interleaved=True, hf_model_type="deepseek_v3", norm_eps=1e-6,
           rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def tiny_model(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    model = GPT(Config(**{**MLA, **changes}))
    model.init_weights()
    with torch.no_grad():  # weights large enough that a wrong cache or rotation shows in the logits
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(10)
    return model.eval()


def test_mla_fields_survive_model_config_yaml(tmp_path):
    config = Config(**MLA)
    config.save(tmp_path / "model_config.yaml")
    assert Config.from_file(tmp_path / "model_config.yaml") == config
    plain_query = Config(**{**MLA, "q_lora_rank": None, "rope_interleaved": False})
    plain_query.save(tmp_path / "model_config.yaml")
    assert Config.from_file(tmp_path / "model_config.yaml") == plain_query


@pytest.mark.parametrize(
    "changes, fields",
    [
        (dict(head_size=16), ["head_size=16", "qk_nope_head_dim", "qk_rope_head_dim"]),
        (dict(n_query_groups=2), ["n_query_groups=2", "n_head=4"]),
        (dict(v_head_dim=None), ["kv_lora_rank=16", "v_head_dim"]),
        (dict(kv_lora_rank=None), ["q_lora_rank", "kv_lora_rank"]),
        (dict(qk_rope_head_dim=7, head_size=19), ["qk_rope_head_dim=7"]),
        (dict(q_lora_rank=0), ["q_lora_rank=0"]),
        (dict(rotary_percentage=0.5), ["rotary_percentage=0.5", "qk_rope_head_dim"]),
    ],
)
def test_latent_sizes_that_do_not_fit_name_the_fields(changes, fields):
    with pytest.raises(UserError) as error:
        Config(**{**MLA, **changes})
    message = str(error.value)
    assert "\n" not in message
    for field in fields:
        assert field in message, message


def test_yarn_mscale_tempers_the_softmax_scale():
    attn = GPT(Config(**MLA)).transformer.h[0].attn
    mscale = 0.1 * 1.0 * math.log(4.0) + 1.0
    assert attn.scale == pytest.approx(mscale**2 / 20**0.5, rel=1e-12)
    assert GPT(Config(**{**MLA, "rope_scaling": None})).transformer.h[0].attn.scale == pytest.approx(20**-0.5)


@torch.no_grad()
def decode_logits(model: GPT, tokens: torch.Tensor, prefill: int, latent: bool) -> torch.Tensor:
    """Logits of `tokens` (B, T): a prefill of `prefill` tokens, then one token at a time through the cache."""
    B, T = tokens.shape
    for block in model.transformer.h:
        block.attn.kv_cache = block.attn.new_kv_cache(B, 40, latent=latent)
    outs = [model(tokens[:, :prefill], input_pos=torch.arange(prefill))]
    outs += [model(tokens[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(prefill, T)]
    model.clear_kv_cache()
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("latent", [True, False])
def test_kv_cache_decoding_equals_the_full_forward(latent):
    model = tiny_model()
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
    cached = decode_logits(model, tokens, prefill=5, latent=latent)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    assert full.abs().max() > 1  # logits large enough to tell a wrong cache from rounding


def test_latent_cache_holds_the_compressed_latent():
    attn = tiny_model().transformer.h[0].attn
    latent, full = attn.new_kv_cache(3, 40), attn.new_kv_cache(3, 40, latent=False)
    assert (latent.k.shape, latent.v.shape) == ((3, 1, 40, 16), (3, 1, 40, 8))  # kv_lora_rank, qk_rope_head_dim
    assert (full.k.shape, full.v.shape) == ((3, 4, 40, 20), (3, 4, 40, 10))  # every head's key and value


@torch.no_grad()
@pytest.mark.parametrize("latent", [True, False])
def test_per_row_positions_of_a_serving_batch(latent):
    """input_pos (B, T): each row decodes at its own position, as the server's batch does."""
    model = tiny_model()
    a = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    b = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    reference = [model(a)[0, -1], model(b)[0, -1]]
    for block in model.transformer.h:
        block.attn.kv_cache = block.attn.new_kv_cache(2, 16, latent=latent)
    # Row 1's prompt is 5 tokens: its last 3 prefill slots hold filler that its later positions never see.
    prompts = torch.cat([a[:, :8], torch.cat([b[:, :5], a[:, :3]], dim=1)])
    model(prompts, input_pos=torch.arange(8).repeat(2, 1))
    logits = model(torch.cat([a[:, 8:9], b[:, 5:6]]), input_pos=torch.tensor([[8], [5]]))[:, -1]
    torch.testing.assert_close(logits[0], reference[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], reference[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v2_lite"])
def test_greedy_generation_equals_transformers(case, tmp_path):
    hf = save_hf_model(case, tmp_path)
    convert_hf_checkpoint(tmp_path)
    model = GPT(Config.from_checkpoint(tmp_path))
    model.load_state_dict(load_state_dict(tmp_path / "lit_model.pth"))
    model.eval()
    prompt = torch.randint(0, 211, (7,), generator=torch.Generator().manual_seed(4))
    ours = list(generate(model, prompt, max_new_tokens=12, temperature=0.0))
    theirs = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 7:].tolist()
    assert ours == theirs


def test_dequantize_fp8_blocks_by_hand():
    weight = (torch.arange(15, dtype=torch.float32).view(5, 3) / 4 - 1).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 3.0], [0.5, 4.0], [10.0, -1.0]])
    out = dequantize_fp8_blocks(weight, scale, (2, 2))
    for i in range(5):
        for j in range(3):
            assert out[i, j].item() == weight[i, j].float().item() * scale[i // 2, j // 2].item()
    with pytest.raises(UserError, match="do not tile"):
        dequantize_fp8_blocks(weight, scale[:2], (2, 2))


def test_fp8_checkpoint_with_a_prediction_layer(tmp_path, capsys):
    """A DeepSeek-V3-style folder: FP8 block-scaled weights and one multi-token prediction layer after the model's."""
    from safetensors.torch import load_file, save_file

    hf = build_hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    expected = {}
    for key in list(tensors):
        if key.endswith("_proj.weight") and ("layers.0." in key or "layers.1.mlp.experts.1." in key):
            fp8 = tensors[key].to(torch.float8_e4m3fn)
            scale = torch.rand(-(-fp8.size(0) // 16), -(-fp8.size(1) // 16)) + 0.5
            tensors[key], tensors[key + "_scale_inv"] = fp8, scale
            expected[key] = fp8.float() * scale.repeat_interleave(16, 0)[: fp8.size(0)].repeat_interleave(16, 1)[
                :, : fp8.size(1)]
    for key in [k for k in tensors if k.startswith("model.layers.2.")]:
        tensors[key.replace("layers.2.", "layers.3.")] = tensors[key].clone()  # the prediction layer
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(num_nextn_predict_layers=1, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]})
    (tmp_path / "config.json").write_text(json.dumps(config))

    convert_hf_checkpoint(tmp_path, dtype="float32")
    assert re.search(r"Skipped the 1 multi-token prediction layer\(s\) \(\d+ tensors, model.layers.3\)",
                     capsys.readouterr().out)
    state = load_state_dict(tmp_path / "lit_model.pth")
    assert not any(key.startswith("transformer.h.3.") for key in state)
    torch.testing.assert_close(state["transformer.h.0.attn.kv_b_proj.weight"],
                               expected["model.layers.0.self_attn.kv_b_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(state["transformer.h.0.mlp.fc_1.weight"],
                               expected["model.layers.0.mlp.gate_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(state["transformer.h.1.mlp.experts.1.proj.weight"],
                               expected["model.layers.1.mlp.experts.1.down_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(state["transformer.h.1.attn.kv_b_proj.weight"],
                               hf.state_dict()["model.layers.1.self_attn.kv_b_proj.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_lora_switches_cover_the_latent_projections(q_lora_rank):
    model = tiny_model(q_lora_rank=q_lora_rank)
    tokens = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = model(tokens)
    add_lora(model, LoRASettings(r=2, alpha=4, dropout=0.0, query=True, key=True, value=False, projection=True))
    attn = model.transformer.h[0].attn
    adapted = {name for name, m in attn.named_children() if isinstance(m, LoRALinear)}
    query = {"q_proj"} if q_lora_rank is None else {"q_a_proj", "q_b_proj"}
    assert adapted == query | {"kv_a_proj", "proj"}
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            torch.nn.init.normal_(module.lora_B, std=0.5)
    with torch.no_grad():
        tuned = model(tokens)
        assert (tuned - base).abs().max() > 1e-2  # the adapters change the output
        merge_lora_weights(model)
        torch.testing.assert_close(model(tokens), tuned, rtol=1e-4, atol=1e-4)
    value_only = tiny_model(q_lora_rank=q_lora_rank)
    add_lora(value_only, LoRASettings(query=False, value=True))
    assert isinstance(value_only.transformer.h[1].attn.kv_b_proj, LoRALinear)


def test_mla_block_is_built_from_config_alone():
    assert isinstance(GPT(Config(**MLA)).transformer.h[0].attn, MultiheadLatentAttention)


def test_serving_engine_pages_latent_caches_and_batches_as_each_sequence_alone():
    """The server's paged engine keeps each token's compressed latent and rotary key (kv_lora_rank +
    qk_rope_head_dim elements per layer), prefills the prompts together and decodes them at their own positions
    (the latent path of one token included): each sequence gets the tokens it gets alone."""
    from litgpt.serving.paged_cache import CacheShape
    from serving_helpers import run_engine

    model = tiny_model()
    assert CacheShape.of(model, torch.float32).layers[0] == (1, MLA["kv_lora_rank"], MLA["qk_rope_head_dim"], True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12]]
    alone = [list(generate(model, p, 10, temperature=0.0)) for p in prompts]
    tokens, engine = run_engine(model, prompts, 10, max_batch_size=3, prefill_tokens=4)
    assert tokens == alone and engine.plan.num_blocks - 1 == len(engine.pool.free)
    assert len(set(map(tuple, alone))) == 3  # the prompts lead to different continuations

"""The DeepSeek / Kimi K2 named configs against their published config.json, written out here by hand, and their
active parameter counts."""

from __future__ import annotations

import pytest
import torch

from litgpt.config import Config
from litgpt.configs import configs_by_name
from litgpt.convert.families.configs import config_from_hf
from litgpt.convert.hf_to_litgpt import architecture_differences
from litgpt.model import GPT

# The architecture keys of each published config.json (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct,
# deepseek-ai/DeepSeek-V2-Lite), as published.
_V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
}
_K2_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 131072, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 163840,
}
_V2_LITE_JSON = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
}
PUBLISHED_JSON = {
    "DeepSeek-V3": _V3_JSON, "DeepSeek-V3-Base": _V3_JSON, "DeepSeek-V3-0324": _V3_JSON, "DeepSeek-R1": _V3_JSON,
    "DeepSeek-R1-0528": _V3_JSON, "Kimi-K2-Instruct": _K2_JSON, "Kimi-K2-Base": _K2_JSON,
    "DeepSeek-V2-Lite": _V2_LITE_JSON, "DeepSeek-V2-Lite-Chat": _V2_LITE_JSON,
}
# Active parameters per token as DeepSeek and Moonshot count them: every weight a token goes through, the output
# head included, the input embedding (a lookup) not. Published rounded ("37B", "2.4B"), hence 2.5%.
PUBLISHED_ACTIVE = {"DeepSeek-V3": 37e9, "Kimi-K2-Instruct": 32e9, "DeepSeek-V2-Lite": 2.4e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED_JSON))
def test_named_config_equals_its_published_config_json(name):
    registered = Config(**configs_by_name()[name])
    derived = config_from_hf(PUBLISHED_JSON[name], f"{name}/config.json")
    assert architecture_differences(registered, derived) == ""
    assert registered.hf_model_type == derived.hf_model_type


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_active_parameters(monkeypatch, name):
    """The dense first layers plus one MoE layer are built on the meta device and the rest extrapolated (the MoE
    layers are identical); the experts a token does not go through are taken off."""
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", lambda self: None)
    monkeypatch.setattr(torch.nn.Embedding, "reset_parameters", lambda self: None)
    values = configs_by_name()[name]
    config = Config(**values)
    dense = config.moe_first_dense_layers
    counts = []
    for n_layer in (dense + 1, dense + 2):
        with torch.device("meta"):
            model = GPT(Config(**{**values, "n_layer": n_layer}))
        counts.append(sum(p.numel() for p in model.parameters()))
    total = counts[0] + (config.n_layer - dense - 1) * (counts[1] - counts[0])
    per_expert = sum(p.numel() for p in model.transformer.h[-1].mlp.experts[0].parameters())
    idle = (config.n_expert - config.n_expert_per_token) * (config.n_layer - dense) * per_expert
    active = total - idle - model.transformer.wte.weight.numel()
    assert active == pytest.approx(PUBLISHED_ACTIVE[name], rel=0.025)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_key_value_heads=16), "num_key_value_heads must equal num_attention_heads (128)"),
        (dict(qk_rope_head_dim=63), "qk_rope_head_dim even"),
        (dict(v_head_dim=None), "needs v_head_dim"),
        (dict(kv_lora_rank=0), "kv_lora_rank=0"),
    ],
)
def test_contradicting_latent_attention_fields_are_one_line(changes, message):
    from litgpt.errors import UserError

    with pytest.raises(UserError) as error:
        config_from_hf({**_V3_JSON, **changes}, "config.json")
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["DeepSeek-V3", "Kimi-K2-Instruct", "DeepSeek-V2-Lite-Chat"])
def test_named_configs_survive_model_config_yaml(name, tmp_path):
    config = Config.from_name(name)
    config.save(tmp_path / "model_config.yaml")
    assert Config.from_file(tmp_path / "model_config.yaml") == config

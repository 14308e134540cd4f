"""Tiny random `transformers` models of every supported family, saved as real Hugging Face folders."""

from __future__ import annotations

from pathlib import Path

import torch

# Shapes small enough to be quick, large enough to exercise GQA (4 query heads over 2 groups) and head_dim != n/h.
_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, vocab_size=211)

# Multi-head latent attention: 4 heads with 12 unrotated + 8 rotated query/key elements and 16-element values.
_MLA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, vocab_size=211,
            intermediate_size=96, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16)

_DEEPSEEK_MOE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


def _family_configs():
    import transformers as tf

    rope_llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500000.0,
    }
    # DeepSeek's published YaRN: mscale and mscale_all_dim also temper the softmax scale of latent attention.
    mla_yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    # gpt-oss' own YaRN settings (no truncation), shrunk; a limit that the gates and ups cross
    yarn_oss = dict(yarn, beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0)

    def longrope(n: int) -> dict:  # n factors each, the short ones near 1 and the long ones growing
        return {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(n)], "long_factor": [1.0 + 1.5 * i for i in range(n)]}

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(_ATTN, intermediate_size=96, head_dim=24, max_position_embeddings=128, tie_word_embeddings=False)),
        "llama3_rope": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(_ATTN, intermediate_size=96, max_position_embeddings=256, rope_parameters=rope_llama3)),
        "llama_tied_mqa": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(_ATTN, num_key_value_heads=1, intermediate_size=96, tie_word_embeddings=True)),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(_ATTN, intermediate_size=96, sliding_window=5, max_position_embeddings=128)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(_ATTN, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(_ATTN, intermediate_size=96, tie_word_embeddings=True)),
        "qwen2_yarn": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(_ATTN, intermediate_size=96, max_position_embeddings=128, rope_parameters=yarn)),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(_ATTN, intermediate_size=96, head_dim=32, tie_word_embeddings=True)),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(_ATTN, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16, norm_topk_prob=True)),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(_ATTN, intermediate_size=96, sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(_ATTN, intermediate_size=96, head_dim=32)),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(_ATTN, intermediate_size=96, head_dim=32, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(_ATTN, num_hidden_layers=4, intermediate_size=96, head_dim=32, sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=24, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
        # DeepSeek-style MoE: a dense first layer, 4 groups of 2 experts of which 2 are chosen, 3 experts per token
        # among them, 2 shared experts, sigmoid scores with a random correction bias, scaled weights; partial rotary,
        # QK-norm and q/k/v biases.
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, dict(_ATTN, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True, head_dim=32, partial_rotary_factor=0.5)),
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, vocab_size=211, intermediate_size=128, rotary_pct=0.25)),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, dict(_ATTN, num_hidden_layers=4, intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, max_position_embeddings=128, rope_parameters=yarn_oss, swiglu_alpha=1.5, swiglu_limit=0.2)),
        # Multi-head latent attention. V3-shaped: query low-rank, a dense first layer, then 4 groups of 2 experts of
        # which 2 are chosen, 2 experts per token, a shared expert, sigmoid scores with a correction bias, scaled.
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(_MLA, q_lora_rank=24, **_DEEPSEEK_MOE, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
        "deepseek_v3_no_q_lora_yarn": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(_MLA, q_lora_rank=None, first_k_dense_replace=3, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, rope_interleave=False, max_position_embeddings=128, rope_parameters=mla_yarn)),
        # V2-Lite-shaped: a plain query projection, softmax scores, greedy top-k over all experts, 2 shared experts.
        "deepseek_v2_lite": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, dict(_MLA, q_lora_rank=None, **_DEEPSEEK_MOE, n_shared_experts=2, topk_method="greedy")),
        "deepseek_v2_yarn": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, dict(_MLA, q_lora_rank=16, **_DEEPSEEK_MOE, n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0, max_position_embeddings=128, rope_parameters=mla_yarn)),
        "gpt_neox_serial": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=211, intermediate_size=128, rotary_pct=0.5, use_parallel_residual=False)),
        "falcon_mqa": (tf.FalconConfig, tf.FalconForCausalLM, dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, vocab_size=211, multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False)),
        "falcon_gqa": (tf.FalconConfig, tf.FalconForCausalLM, dict(hidden_size=64, num_attention_heads=4, num_kv_heads=2, num_hidden_layers=3, vocab_size=211, ffn_hidden_size=96, new_decoder_architecture=True, bias=True, tie_word_embeddings=False)),
        "stablelm_qk_norm": (tf.StableLmConfig, tf.StableLmForCausalLM, dict(_ATTN, intermediate_size=96, qk_layernorm=True, use_qkv_bias=True)),
        "stablelm_parallel": (tf.StableLmConfig, tf.StableLmForCausalLM, dict(_ATTN, intermediate_size=96, use_parallel_residual=True, partial_rotary_factor=0.5, tie_word_embeddings=True)),
        "phi": (tf.PhiConfig, tf.PhiForCausalLM, dict(_ATTN, intermediate_size=128, partial_rotary_factor=0.5)),
        "olmo": (tf.OlmoConfig, tf.OlmoForCausalLM, dict(_ATTN, intermediate_size=96, clip_qkv=0.1, pad_token_id=0, eos_token_id=2)),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, dict(_ATTN, intermediate_size=96, pad_token_id=0)),
        "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM, dict(_ATTN, num_hidden_layers=4, intermediate_size=96, pad_token_id=0, sliding_window=5, max_position_embeddings=128, layer_types=["sliding_attention"] * 3 + ["full_attention"], rope_parameters={"full_attention": dict(yarn, rope_theta=50000.0), "sliding_attention": {"rope_type": "default", "rope_theta": 50000.0}})),
        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM, dict(_ATTN, num_hidden_layers=4, intermediate_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        # LongRoPE with a context of 64 over an original 16: TOKENS (19 long) rotate with the long factors.
        "phi3_longrope": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(_ATTN, intermediate_size=96, max_position_embeddings=64, original_max_position_embeddings=16, rope_scaling=longrope(8), pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        # Phi-4-mini's layout: LongRoPE over 3/4 of each head, tied embeddings.
        "phi4_mini": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(_ATTN, intermediate_size=96, max_position_embeddings=64, original_max_position_embeddings=16, partial_rotary_factor=0.75, rope_scaling=longrope(6), tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    }


FAMILY_CASES = list(_family_configs())


def build_hf_model(case: str, seed: int = 0, **overrides):
    """A random model of the named case with perturbed norms (so that a wrong norm mapping shows); `overrides`
    change its config's values (e.g. vocab_size)."""
    config_cls, model_cls, kwargs = _family_configs()[case]
    kwargs = dict(kwargs, **overrides)
    if "rope_parameters" in kwargs and case == "gemma3":
        kwargs.pop("sliding_window_pattern", None)
        kwargs["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(kwargs["num_hidden_layers"])]
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    model = model_cls(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name:  # Falcon's norms are ln_attn, ln_mlp and ln_f
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith((".bias", "_bias", ".sinks")):  # gpt-oss: expert biases and attention sinks
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
    return model


def save_hf_model(case: str, folder: Path, seed: int = 0):
    model = build_hf_model(case, seed)
    model.save_pretrained(folder)
    return model

"""Every family litgpt converts, by config.json's model_type."""

from __future__ import annotations

from typing import Optional

from litgpt.convert.families.deepseek import NOAUX_TC_ROUTING
from litgpt.convert.families.family import Family, define_family
from litgpt.convert.families.legacy import LEGACY_FAMILIES
from litgpt.errors import UserError

# The expert counts of a mixture of experts, which config.json sets (free in each MoE family).
_EXPERT_COUNTS = ("n_expert", "n_expert_per_token")
# Gemma's logit soft-capping and attention-score scale, which config.json sets.
_GEMMA_SOFTCAPS_AND_SCALE = ("attention_logit_softcapping", "final_logit_softcapping", "attention_scores_scalar")
# Gemma's architecture: norms that scale by (1 + weight), scaled embeddings, a GeGLU MLP with tanh GELU.
_GEMMA_ARCHITECTURE = dict(
    norm_unit_offset=True, scale_embeddings=True, mlp_class_name="GemmaMLP", gelu_approximate="tanh"
)
# OLMo 2 and 3: no norm before attention or the MLP, norms on their outputs, q/k norms over the whole projections.
_OLMO_POST_NORMS = dict(
    norm_1=False, norm_2=False, post_attention_norm=True, post_mlp_norm=True, norm_qk=True, norm_qk_type="olmo2"
)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        define_family("llama", "LlamaForCausalLM"),
        define_family("mistral", "MistralForCausalLM", sliding=True),
        define_family("qwen2", "Qwen2ForCausalLM", sliding=True, fixed=dict(attn_bias=True)),
        define_family("qwen3", "Qwen3ForCausalLM", sliding=True, fixed=dict(norm_qk=True)),
        define_family("mixtral", "MixtralForCausalLM", sliding=True, free=_EXPERT_COUNTS, fixed=dict(mlp_class_name="LLaMAMoE", moe_renormalize=True)),
        define_family("qwen3_moe", "Qwen3MoeForCausalLM", sliding=True, free=_EXPERT_COUNTS, fixed=dict(mlp_class_name="LLaMAMoE", norm_qk=True)),
        define_family("phi3", "Phi3ForCausalLM", sliding=True, fused_qkv=True, fused_gate_up=True, head_dim_key=False),
        define_family(
            "gemma", "GemmaForCausalLM", default_tie=True, free=_GEMMA_SOFTCAPS_AND_SCALE, fixed=_GEMMA_ARCHITECTURE
        ),
        define_family(
            "gemma2",
            "Gemma2ForCausalLM",
            sliding=True,
            free=_GEMMA_SOFTCAPS_AND_SCALE,
            default_tie=True,
            fixed=dict(_GEMMA_ARCHITECTURE, post_attention_norm=True, post_mlp_norm=True),
        ),
        define_family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            sliding=True,
            free=_GEMMA_SOFTCAPS_AND_SCALE + ("rope_local_base",),
            default_tie=True,
            fixed=dict(_GEMMA_ARCHITECTURE, post_attention_norm=True, post_mlp_norm=True, norm_qk=True),
        ),
        define_family(
            "glm4_moe",
            "Glm4MoeForCausalLM",
            free=_EXPERT_COUNTS + ("attn_bias", "norm_qk"),
            fixed=dict(mlp_class_name="LLaMAMoE", **NOAUX_TC_ROUTING),
        ),
        define_family(
            "gpt_neox",
            "GPTNeoXForCausalLM",
            head_dim_key=False,
            free=("parallel_residual",),
            fixed=dict(norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", bias=True),
        ),
        # gpt-oss: biases on attention and experts, attention sinks, a biased router, clamped SwiGLU experts.
        define_family(
            "gpt_oss",
            "GptOssForCausalLM",
            sliding=True,
            free=_EXPERT_COUNTS + ("swiglu_alpha", "swiglu_limit"),
            fixed=dict(
                mlp_class_name="LLaMAMoE", moe_renormalize=True, bias=True, attention_sinks=True, router_bias=True
            ),
        ),
        define_family("olmo2", "Olmo2ForCausalLM", head_dim_key=False, fixed=_OLMO_POST_NORMS),
        define_family("olmo3", "Olmo3ForCausalLM", sliding=True, head_dim_key=False, free=("rope_local_base",),
                      fixed=_OLMO_POST_NORMS),
        define_family("smollm3", "SmolLM3ForCausalLM", head_dim_key=False, default_tie=True, free=("no_rope_layers",)),
        # config.json's head_dim is the rotary size (transformers sets it so); head_size is derived from the MLA sizes.
        define_family("deepseek_v3", "DeepseekV3ForCausalLM", head_dim_key=False, latent=True, free=_EXPERT_COUNTS,
                      fixed=dict(mlp_class_name="LLaMAMoE", **NOAUX_TC_ROUTING)),
        # DeepSeek-V2's router: softmax scores, no correction bias; config.json's topk_method picks the group score.
        define_family("deepseek_v2", "DeepseekV2ForCausalLM", head_dim_key=False, latent=True, free=_EXPERT_COUNTS,
                      fixed=dict(mlp_class_name="LLaMAMoE", moe_score_function="softmax", moe_expert_bias=False,
                                 rope_interleaved=True)),
    ]
}
# The older architectures are families too (`legacy`).
FAMILIES.update(LEGACY_FAMILIES)
# Other model types whose config.json describes one of the families above (Kimi K2 ships DeepSeek-V3's classes).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def family_of(model_type: str, where: str, architectures: Optional[list] = None) -> Family:
    """The family of `model_type`; with config.json's `architectures`, also refuses a known model_type whose class
    is not a causal LM (a classifier's or an encoder's weights are no language model's)."""
    model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
    supported = f"Supported model_type values: {', '.join(sorted(FAMILIES))} (causal LMs)."
    named = f"{architectures[0]} (model_type {model_type!r})" if architectures else f"model_type {model_type!r}"
    if model_type not in FAMILIES:
        raise UserError(f"{where} describes {named}, which litgpt does not support. {supported}")
    if architectures and not any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise UserError(f"{where} describes {named}, not a causal language model, which litgpt does not convert. "
                        f"{supported}")
    return FAMILIES[model_type]

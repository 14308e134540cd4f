"""gpt-oss: https://huggingface.co/openai (gpt-oss-20b, gpt-oss-120b)."""

from litgpt.configs import variants

# Every value from the published config.json. Attention with biases and a learned sink per head, alternating
# 128-token windows (the first layer slides), YaRN stretching 4096 positions 32 times; a mixture of experts with a
# biased router, biased experts and the clamped SwiGLU (swiglu_alpha is transformers' default: config.json has
# swiglu_limit only). Both sizes share every shape but the depth and the number of experts.
_COMMON = dict(
    hf_model_type="gpt_oss",
    block_size=131072,
    vocab_size=201088,
    padded_vocab_size=201088,
    n_embd=2880,
    n_head=64,
    head_size=64,
    n_query_groups=8,
    bias=True,
    norm_class_name="RMSNorm",
    norm_eps=1e-5,
    mlp_class_name="LLaMAMoE",
    intermediate_size=2880,
    moe_intermediate_size=2880,
    n_expert_per_token=4,
    moe_renormalize=True,
    router_aux_loss_coef=0.9,
    rope_base=150000.0,
    rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                      truncate=False),
    sliding_window_size=128,
    sliding_window_pattern=2,
    prompt_style="harmony",
    attention_sinks=True,
    router_bias=True,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
)

CONFIGS = variants(
    "openai",
    _COMMON,
    dict(name="gpt-oss-20b", n_layer=24, n_expert=32),
    dict(name="gpt-oss-120b", n_layer=36, n_expert=128),
)

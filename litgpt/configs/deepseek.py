"""DeepSeek-V3, DeepSeek-R1, Kimi K2 and DeepSeek-V2-Lite: https://huggingface.co/deepseek-ai, /moonshotai.

Multi-head latent attention (a 512-element latent plus a 64-element rotary key cached per token and layer; each
head's query and key are 128 unrotated + 64 rotated elements, its value 128) with YaRN, and DeepSeek's mixture of
experts after dense first layers: one or two shared experts beside the routed ones. V3, R1 and K2 route by sigmoid
score plus a correction bias within the best groups (K2: one group), renormalize and scale the weights; V2-Lite by
softmax probability, greedily over all experts. The published V3/R1/K2 checkpoints hold FP8 weights with a scale per
128x128 block, which `litgpt convert_to_litgpt` dequantizes, and V3/R1 one multi-token prediction layer
(num_nextn_predict_layers), which it leaves out.
"""

from litgpt.configs import tuned, variants

_COMMON = dict(
    hf_model_type="deepseek_v3",
    norm_class_name="RMSNorm",
    norm_eps=1e-6,
    n_layer=61,
    n_embd=7168,
    intermediate_size=18432,
    head_size=192,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_interleaved=True,
    tie_embeddings=False,
    mlp_class_name="LLaMAMoE",
    n_expert_per_token=8,
    moe_intermediate_size=2048,
    moe_n_shared_expert=1,
    moe_score_function="sigmoid",
    moe_expert_bias=True,
    moe_group_score="top2_sum",
    moe_renormalize=True,
    router_aux_loss_coef=0.0,
)
_YARN = dict(type="yarn", original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)

# 671B parameters, 37B active: 128 heads, 256 routed experts in 8 groups (4 chosen per token), 3 dense layers.
_V3 = dict(
    _COMMON, n_head=128, n_query_groups=128, vocab_size=129280, padded_vocab_size=129280, block_size=163840,
    rope_base=10000.0, rope_scaling=dict(_YARN, factor=40.0, beta_fast=32, beta_slow=1), n_expert=256,
    moe_n_group=8, moe_topk_group=4, moe_routed_scaling=2.5, moe_first_dense_layers=3,
)
DEEPSEEK_V3 = variants(
    "deepseek-ai",
    _V3,
    dict(name="DeepSeek-V3"),
    dict(name="DeepSeek-V3-Base"),
    dict(name="DeepSeek-V3-0324"),
    dict(name="DeepSeek-R1"),
    dict(name="DeepSeek-R1-0528"),
)

# Kimi K2 (1.04T parameters, 32B active): DeepSeek-V3's classes with 64 heads, 384 routed experts in one group, one
# dense layer, rotary base 50000 and its own YaRN (factor 32, both betas 1). config.json says model_type "kimi_k2".
_K2 = dict(
    _COMMON, n_head=64, n_query_groups=64, vocab_size=163840, padded_vocab_size=163840, block_size=131072,
    rope_base=50000.0, rope_scaling=dict(_YARN, factor=32.0, beta_fast=1.0, beta_slow=1.0), n_expert=384,
    moe_n_group=1, moe_topk_group=1, moe_routed_scaling=2.827, moe_first_dense_layers=1,
)
KIMI_K2 = variants("moonshotai", _K2, dict(name="Kimi-K2-Instruct"), dict(name="Kimi-K2-Base"))

# DeepSeek-V2-Lite (15.7B parameters, 2.4B active): a plain query projection (no q_lora_rank), 16 heads, softmax
# routing to 6 of 64 experts without renormalization, 2 shared experts, one dense layer, YaRN with mscale 0.707.
DEEPSEEK_V2_LITE = variants(
    "deepseek-ai",
    dict(
        _COMMON, hf_model_type="deepseek_v2", n_layer=27, n_embd=2048, intermediate_size=10944, n_head=16,
        n_query_groups=16, q_lora_rank=None, vocab_size=102400, padded_vocab_size=102400, block_size=163840,
        rope_base=10000.0, rope_scaling=dict(_YARN, factor=40.0, beta_fast=32, beta_slow=1, mscale=0.707,
                                             mscale_all_dim=0.707),
        n_expert=64, n_expert_per_token=6, moe_intermediate_size=1408, moe_n_shared_expert=2,
        moe_score_function="softmax", moe_expert_bias=False, moe_renormalize=False, moe_n_group=1,
        moe_topk_group=1, moe_routed_scaling=1.0, moe_first_dense_layers=1,
    ),
    dict(name="DeepSeek-V2-Lite"),
)
DEEPSEEK_V2_LITE_CHAT = tuned(DEEPSEEK_V2_LITE, "-Chat", "default")

CONFIGS = DEEPSEEK_V3 + KIMI_K2 + DEEPSEEK_V2_LITE + DEEPSEEK_V2_LITE_CHAT

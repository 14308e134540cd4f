"""Qwen2.5 (with -Coder, -Math, -1M and QwQ) and Qwen3 (with -Base and -2507): https://huggingface.co/Qwen."""

from litgpt.configs import tuned, variants

_COMMON = dict(
    norm_class_name="RMSNorm",
    norm_eps=1e-6,
    mlp_class_name="LLaMAMLP",
    rope_base=1000000.0,
)

# ---- Qwen2.5 -----------------------------------------------------------------------------------------------------
# Biases on the q/k/v projection only. The small models tie their embeddings and share a 151936-row vocabulary;
# from 7B on the vocabulary has 152064 rows and the base models' config allows 131072 positions (the instruct
# models' config.json: 32768, to be extended with YaRN by the user).
_V_SMALL = dict(vocab_size=151936, padded_vocab_size=151936, tie_embeddings=True, block_size=32768)
_V_LARGE = dict(vocab_size=152064, padded_vocab_size=152064, tie_embeddings=False, block_size=131072)
QWEN_2_5 = variants(
    "Qwen",
    dict(_COMMON, hf_model_type="qwen2", attn_bias=True),
    dict(name="Qwen2.5-0.5B", n_layer=24, n_embd=896, n_head=14, n_query_groups=2, intermediate_size=4864, **_V_SMALL),
    dict(name="Qwen2.5-1.5B", n_layer=28, n_embd=1536, n_head=12, n_query_groups=2, intermediate_size=8960, **_V_SMALL),
    dict(name="Qwen2.5-3B", n_layer=36, n_embd=2048, n_head=16, n_query_groups=2, intermediate_size=11008, **_V_SMALL),
    dict(name="Qwen2.5-7B", n_layer=28, n_embd=3584, n_head=28, n_query_groups=4, intermediate_size=18944, **_V_LARGE),
    dict(name="Qwen2.5-14B", n_layer=48, n_embd=5120, n_head=40, n_query_groups=8, intermediate_size=13824, **_V_LARGE),
    dict(name="Qwen2.5-32B", n_layer=64, n_embd=5120, n_head=40, n_query_groups=8, intermediate_size=27648, **_V_LARGE),
    dict(name="Qwen2.5-72B", n_layer=80, n_embd=8192, n_head=64, n_query_groups=8, intermediate_size=29568, **_V_LARGE),
)
QWEN_2_5_INSTRUCT = tuned(QWEN_2_5, "-Instruct", "qwen2.5", block_size=32768)

# Qwen2.5-Coder: the same shapes, 32768 positions at every size; 14B and 32B set rms_norm_eps 1e-5.
_SHAPE = {c["name"]: {k: c[k] for k in ("n_layer", "n_embd", "n_head", "n_query_groups", "intermediate_size")}
          for c in QWEN_2_5}
_V_LARGE_32K = dict(_V_LARGE, block_size=32768)
QWEN_2_5_CODER = variants(
    "Qwen",
    dict(_COMMON, hf_model_type="qwen2", attn_bias=True),
    *(dict(name=f"Qwen2.5-Coder-{size}", **_SHAPE[f"Qwen2.5-{size}"], **_V_SMALL) for size in ("0.5B", "1.5B", "3B")),
    dict(name="Qwen2.5-Coder-7B", **_SHAPE["Qwen2.5-7B"], **_V_LARGE_32K),
    dict(name="Qwen2.5-Coder-14B", **_SHAPE["Qwen2.5-14B"], **_V_LARGE_32K, norm_eps=1e-5),
    dict(name="Qwen2.5-Coder-32B", **_SHAPE["Qwen2.5-32B"], **_V_LARGE_32K, norm_eps=1e-5),
)
# Qwen2.5-Math: 4096 positions with rope_theta 10000; 72B sets rms_norm_eps 1e-5.
QWEN_2_5_MATH = variants(
    "Qwen",
    dict(_COMMON, hf_model_type="qwen2", attn_bias=True),
    dict(name="Qwen2.5-Math-1.5B", **_SHAPE["Qwen2.5-1.5B"], **_V_SMALL),
    dict(name="Qwen2.5-Math-7B", **_SHAPE["Qwen2.5-7B"], **_V_LARGE),
    dict(name="Qwen2.5-Math-72B", **_SHAPE["Qwen2.5-72B"], **_V_LARGE, norm_eps=1e-5),
)
for _math in QWEN_2_5_MATH:
    _math.update(block_size=4096, rope_base=10000.0)
# The 1M-context instruct models: rope_theta 1e7 and 1010000 positions (transformers runs them as plain Qwen2; the
# published dual-chunk attention is an inference-engine option that changes no weight).
QWEN_2_5_1M = variants(
    "Qwen",
    dict(_COMMON, hf_model_type="qwen2", attn_bias=True, **dict(_V_LARGE, block_size=1010000),
         rope_base=10000000.0, norm_eps=1e-5, prompt_style="qwen2.5"),
    dict(name="Qwen2.5-7B-Instruct-1M", **_SHAPE["Qwen2.5-7B"]),
    dict(name="Qwen2.5-14B-Instruct-1M", **_SHAPE["Qwen2.5-14B"]),
)
# QwQ: reasoning models of Qwen2.5-32B's shape (rms_norm_eps 1e-5). QwQ-32B opens its reply with <think>.
QWQ = variants(
    "Qwen",
    dict(_COMMON, hf_model_type="qwen2", attn_bias=True, **_SHAPE["Qwen2.5-32B"], **_V_LARGE, norm_eps=1e-5),
    dict(name="QwQ-32B", block_size=40960, prompt_style="chatml-thinking"),
    dict(name="QwQ-32B-Preview", block_size=32768, prompt_style="qwq-preview"),
)

# ---- Qwen3 -------------------------------------------------------------------------------------------------------
# RMS-normalized queries and keys, head_dim 128 at every size, no biases. The post-trained (hybrid thinking)
# checkpoints allow 40960 positions, the pretrained "-Base" ones 32768.
_QWEN_3 = dict(
    _COMMON, hf_model_type="qwen3", norm_qk=True, head_size=128, block_size=40960,
    vocab_size=151936, padded_vocab_size=151936, tie_embeddings=False, prompt_style="chatml",
)
_MOE = dict(hf_model_type="qwen3_moe", mlp_class_name="LLaMAMoE", n_expert=128, n_expert_per_token=8,
            moe_renormalize=True, router_aux_loss_coef=0.001)
QWEN_3 = variants(
    "Qwen",
    _QWEN_3,
    dict(name="Qwen3-0.6B", n_layer=28, n_embd=1024, n_head=16, n_query_groups=8, intermediate_size=3072,
         tie_embeddings=True),
    dict(name="Qwen3-1.7B", n_layer=28, n_embd=2048, n_head=16, n_query_groups=8, intermediate_size=6144,
         tie_embeddings=True),
    dict(name="Qwen3-4B", n_layer=36, n_embd=2560, n_head=32, n_query_groups=8, intermediate_size=9728,
         tie_embeddings=True),
    dict(name="Qwen3-8B", n_layer=36, n_embd=4096, n_head=32, n_query_groups=8, intermediate_size=12288),
    dict(name="Qwen3-14B", n_layer=40, n_embd=5120, n_head=40, n_query_groups=8, intermediate_size=17408),
    dict(name="Qwen3-32B", n_layer=64, n_embd=5120, n_head=64, n_query_groups=8, intermediate_size=25600),
    # Every layer is sparse (decoder_sparse_step 1, no mlp_only_layers); intermediate_size is the unused dense size.
    dict(name="Qwen3-30B-A3B", n_layer=48, n_embd=2048, n_head=32, n_query_groups=4, intermediate_size=6144,
         moe_intermediate_size=768, **_MOE),
    dict(name="Qwen3-235B-A22B", n_layer=94, n_embd=4096, n_head=64, n_query_groups=4, intermediate_size=12288,
         moe_intermediate_size=1536, **_MOE),
)

# The pretrained checkpoints the above were post-trained from (no 32B or 235B one was published): plain text.
QWEN_3_BASE = tuned(
    [c for c in QWEN_3 if c["name"] not in ("Qwen3-32B", "Qwen3-235B-A22B")], "-Base", "default", block_size=32768
)
# The July 2025 (-2507) updates: separate instruct and thinking models with 262144 positions and a larger rope_theta.
_2507 = {"Qwen3-4B": 5000000.0, "Qwen3-30B-A3B": 10000000.0, "Qwen3-235B-A22B": 5000000.0}
QWEN_3_2507 = [
    tuned([c], suffix, style, block_size=262144, rope_base=_2507[c["name"]])[0]
    for c in QWEN_3 if c["name"] in _2507
    for suffix, style in (("-Instruct-2507", "chatml"), ("-Thinking-2507", "chatml-thinking"))
]

CONFIGS = [
    *QWEN_2_5, *QWEN_2_5_INSTRUCT, *QWEN_2_5_CODER, *tuned(QWEN_2_5_CODER, "-Instruct", "qwen2.5"),
    *QWEN_2_5_MATH, *tuned(QWEN_2_5_MATH, "-Instruct", "qwen2.5-math"), *QWEN_2_5_1M, *QWQ,
    *QWEN_3, *QWEN_3_BASE, *QWEN_3_2507,
]

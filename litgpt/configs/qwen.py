"""Qwen2.5 and Qwen3: https://huggingface.co/Qwen."""

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
QWEN_2_5_INSTRUCT = tuned(QWEN_2_5, "-Instruct", "chatml", block_size=32768)

# ---- Qwen3 -------------------------------------------------------------------------------------------------------
# RMS-normalized queries and keys, head_dim 128 at every size, no biases. The published (post-trained, hybrid
# thinking) checkpoints; the "-Base" repos are not registered.
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

CONFIGS = [*QWEN_2_5, *QWEN_2_5_INSTRUCT, *QWEN_3]

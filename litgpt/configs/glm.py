"""GLM-4.5 and GLM-4.6: https://huggingface.co/zai-org.

DeepSeek-V3's mixture of experts (sigmoid router with a correction bias, one shared expert, 8 of the routed experts
per token, dense first layers) without its latent attention: grouped-query attention with biases on q/k/v, rotary
embeddings on the first half of each head (halves layout), RMS-normalized queries and keys in GLM-4.5 and 4.6 but
not in Air. Every published checkpoint also holds one multi-token prediction layer (num_nextn_predict_layers: 1),
which `litgpt convert_to_litgpt` leaves out.
"""

from litgpt.configs import variants

_COMMON = dict(
    hf_model_type="glm4_moe",
    norm_class_name="RMSNorm",
    norm_eps=1e-5,
    rope_base=1000000.0,
    rotary_percentage=0.5,
    n_head=96,
    n_query_groups=8,
    head_size=128,
    attn_bias=True,
    vocab_size=151552,
    padded_vocab_size=151552,
    tie_embeddings=False,
    block_size=131072,
    mlp_class_name="LLaMAMoE",
    n_expert_per_token=8,
    moe_n_shared_expert=1,
    moe_score_function="sigmoid",
    moe_expert_bias=True,
    moe_n_group=1,
    moe_topk_group=1,
    moe_renormalize=True,
    router_aux_loss_coef=0.0,
)
# 355B parameters, 32B active: 92 layers, the first 3 dense.
_GLM_4_5 = dict(n_layer=92, n_embd=5120, intermediate_size=12288, moe_intermediate_size=1536, n_expert=160,
                moe_routed_scaling=2.5, moe_first_dense_layers=3, norm_qk=True)
# 106B parameters, 12B active: 46 layers, the first dense.
_AIR = dict(n_layer=46, n_embd=4096, intermediate_size=10944, moe_intermediate_size=1408, n_expert=128,
            moe_routed_scaling=1.0, moe_first_dense_layers=1, norm_qk=False)

CONFIGS = variants(
    "zai-org",
    _COMMON,
    dict(name="GLM-4.5", **_GLM_4_5),
    dict(name="GLM-4.5-Base", **_GLM_4_5),
    dict(name="GLM-4.5-Air", **_AIR),
    dict(name="GLM-4.5-Air-Base", **_AIR),
    # GLM-4.5's architecture with a 200K context.
    dict(name="GLM-4.6", **_GLM_4_5, block_size=202752),
)

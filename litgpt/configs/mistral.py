"""Mistral 7B and Mixtral 8x7B: https://huggingface.co/mistralai."""

from litgpt.configs import variants

_7B = dict(
    norm_class_name="RMSNorm",
    norm_eps=1e-5,
    mlp_class_name="LLaMAMLP",
    tie_embeddings=False,
    block_size=32768,
    n_layer=32,
    n_embd=4096,
    n_head=32,
    n_query_groups=8,
    intermediate_size=14336,
    vocab_size=32000,
    padded_vocab_size=32000,
)
# v0.1 slides a 4096-token window in every layer with rope base 1e4; v0.2 (instruct) and v0.3 attend globally
# with rope base 1e6, and v0.3 extends the vocabulary to 32768.
_V01 = dict(hf_model_type="mistral", rope_base=10000.0, sliding_window_size=4096)
_V02 = dict(hf_model_type="mistral", rope_base=1000000.0)
_V03 = dict(_V02, vocab_size=32768, padded_vocab_size=32768)
_MIXTRAL = dict(
    hf_model_type="mixtral", rope_base=1000000.0,
    mlp_class_name="LLaMAMoE", n_expert=8, n_expert_per_token=2, moe_intermediate_size=14336,
    router_aux_loss_coef=0.02,
)

CONFIGS = variants(
    "mistralai",
    _7B,
    dict(name="Mistral-7B-v0.1", **_V01),
    dict(name="Mistral-7B-Instruct-v0.1", **_V01, prompt_style="mistral"),
    dict(name="Mistral-7B-Instruct-v0.2", **_V02, prompt_style="mistral"),
    dict(name="Mistral-7B-v0.3", **_V03),
    dict(name="Mistral-7B-Instruct-v0.3", **_V03, prompt_style="mistral"),
    dict(name="Mixtral-8x7B-v0.1", **_MIXTRAL),
    dict(name="Mixtral-8x7B-Instruct-v0.1", **_MIXTRAL, prompt_style="mistral"),
)

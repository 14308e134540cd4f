"""Mistral 7B, Mathstral, Mistral Large 2, Mixtral 8x7B and 8x22B: https://huggingface.co/mistralai."""

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
# with rope base 1e6, and v0.3 extends the vocabulary to 32768 (with [INST] as control tokens: style mistral-v3).
_V01 = dict(hf_model_type="mistral", rope_base=10000.0, sliding_window_size=4096)
_V02 = dict(hf_model_type="mistral", rope_base=1000000.0)
_V03 = dict(_V02, vocab_size=32768, padded_vocab_size=32768)
_MIXTRAL = dict(
    hf_model_type="mixtral", rope_base=1000000.0,
    mlp_class_name="LLaMAMoE", n_expert=8, n_expert_per_token=2, moe_intermediate_size=14336,
    router_aux_loss_coef=0.02,
)
# Mixtral 8x22B: 56 layers of 8 experts at 6144 wide, the v0.3 vocabulary, 65536 positions.
_MIXTRAL_8X22B = dict(
    _MIXTRAL, vocab_size=32768, padded_vocab_size=32768, block_size=65536, n_layer=56, n_embd=6144, n_head=48,
    intermediate_size=16384, moe_intermediate_size=16384, router_aux_loss_coef=0.001,
)
# Mistral Large 2 (123B): 88 layers at 12288 wide, the v0.3 vocabulary, 131072 positions.
_LARGE = dict(
    _V03, block_size=131072, n_layer=88, n_embd=12288, n_head=96, intermediate_size=28672, prompt_style="mistral-v3"
)

CONFIGS = variants(
    "mistralai",
    _7B,
    dict(name="Mistral-7B-v0.1", **_V01),
    dict(name="Mistral-7B-Instruct-v0.1", **_V01, prompt_style="mistral"),
    dict(name="Mistral-7B-Instruct-v0.2", **_V02, prompt_style="mistral"),
    # Mistral published the v0.2 base model as raw weights only; unsloth's repo holds them in transformers' layout.
    dict(name="Mistral-7B-v0.2", **_V02, hf_config=dict(org="unsloth", name="Mistral-7B-v0.2")),
    dict(name="Mistral-7B-v0.3", **_V03),
    dict(name="Mistral-7B-Instruct-v0.3", **_V03, prompt_style="mistral-v3"),
    # Mathstral is Mistral 7B v0.3 tuned for mathematics (its config.json: no sliding window).
    dict(name="Mathstral-7B-v0.1", **_V03, prompt_style="mistral-v3",
         hf_config=dict(org="mistralai", name="mathstral-7B-v0.1")),
    dict(name="Mistral-Large-Instruct-2407", **_LARGE),
    dict(name="Mistral-Large-Instruct-2411", **_LARGE),
    dict(name="Mixtral-8x7B-v0.1", **_MIXTRAL),
    dict(name="Mixtral-8x7B-Instruct-v0.1", **_MIXTRAL, prompt_style="mistral"),
    dict(name="Mixtral-8x22B-v0.1", **_MIXTRAL_8X22B),
    dict(name="Mixtral-8x22B-Instruct-v0.1", **_MIXTRAL_8X22B, prompt_style="mistral-v3"),
)

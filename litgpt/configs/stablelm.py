"""Stability AI StableLM and StableCode: https://huggingface.co/stabilityai.

The 3B-4E1T generation (stablelm-3b-4e1t, stablelm-zephyr-3b, stable-code-3b) is Hugging Face `stablelm`: LayerNorm,
SwiGLU, a quarter of each head rotating. The alpha models (stablelm-*-alpha, stablecode-*-alpha) are GPT-NeoX.
"""

from litgpt.configs import variants

_STABLELM = dict(
    hf_model_type="stablelm",
    n_layer=32,
    n_embd=2560,
    n_head=32,
    intermediate_size=6912,
    vocab_size=50304,
    padded_vocab_size=50304,
    block_size=4096,
    norm_class_name="LayerNorm",
    norm_eps=1e-5,
    mlp_class_name="LLaMAMLP",
    rotary_percentage=0.25,
    rope_base=10000.0,
    tie_embeddings=False,
)

_NEOX = dict(
    hf_model_type="gpt_neox",
    block_size=4096,
    norm_class_name="LayerNorm",
    norm_eps=1e-5,
    mlp_class_name="GptNeoxMLP",
    parallel_residual=True,
    bias=True,
    rotary_percentage=0.25,
    rope_base=10000.0,
    tie_embeddings=False,
)
_ALPHA_3B = dict(n_layer=16, n_embd=4096, n_head=32, vocab_size=50688, padded_vocab_size=50688)
_ALPHA_7B = dict(n_layer=16, n_embd=6144, n_head=48, vocab_size=50432, padded_vocab_size=50432)
_STABLECODE = dict(n_layer=32, n_embd=2560, n_head=32, vocab_size=49152, padded_vocab_size=49152)

CONFIGS = [
    *variants(
        "stabilityai",
        _STABLELM,
        dict(name="stablelm-3b-4e1t"),
        dict(name="stablelm-zephyr-3b"),
        dict(name="stable-code-3b", block_size=16384, rope_base=1000000.0),
    ),
    # intermediate_size is 4 * n_embd throughout (the Config default).
    *variants(
        "stabilityai",
        _NEOX,
        dict(name="stablelm-base-alpha-3b", **_ALPHA_3B),
        dict(name="stablelm-tuned-alpha-3b", **_ALPHA_3B),
        dict(name="stablelm-base-alpha-7b", **_ALPHA_7B),
        dict(name="stablelm-tuned-alpha-7b", **_ALPHA_7B),
        dict(name="stablecode-completion-alpha-3b", **_STABLECODE, block_size=16384),
        dict(name="stablecode-completion-alpha-3b-4k", **_STABLECODE),
        dict(name="stablecode-instruct-alpha-3b", **_STABLECODE),
    ),
]

"""Allen AI OLMo 1 (Hugging Face `olmo` architecture): https://huggingface.co/allenai.

LayerNorms without weights or biases, SwiGLU, no biases anywhere.
"""

from litgpt.configs import tuned, variants

_COMMON = dict(
    hf_model_type="olmo",
    block_size=2048,
    vocab_size=50304,
    padded_vocab_size=50304,
    norm_class_name="LayerNorm",
    norm_affine=False,
    norm_eps=1e-5,
    mlp_class_name="LLaMAMLP",
    rope_base=10000.0,
)

_7B = variants("allenai", _COMMON, dict(name="OLMo-7B-hf", n_layer=32, n_embd=4096, n_head=32, intermediate_size=11008,
                                        tie_embeddings=False))

CONFIGS = [
    *variants("allenai", _COMMON, dict(name="OLMo-1B-hf", n_layer=16, n_embd=2048, n_head=16, intermediate_size=8192,
                                       tie_embeddings=True)),
    *_7B,
    *tuned(_7B, lambda name: name.replace("-hf", "-Instruct-hf"), "default"),
]

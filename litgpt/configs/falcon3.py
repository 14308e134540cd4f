"""TII Falcon3 (Llama architecture): https://huggingface.co/tiiuae.

Every size has head_dim 256 with 4 key/value heads, a 131072-token vocabulary and rope_theta 1000042. The base
models' config.json allow 4096 positions at 1B and 32768 from 3B on; post-training lengthened the 1B model's context
to 8192 (its model card).
"""

from litgpt.configs import tuned, variants

FALCON3 = variants(
    "tiiuae",
    dict(
        hf_model_type="llama",
        norm_class_name="RMSNorm",
        norm_eps=1e-6,
        mlp_class_name="LLaMAMLP",
        tie_embeddings=False,
        block_size=32768,
        vocab_size=131072,
        padded_vocab_size=131072,
        rope_base=1000042.0,
        head_size=256,
        n_query_groups=4,
    ),
    dict(name="Falcon3-1B-Base", block_size=4096, n_layer=18, n_embd=2048, n_head=8, intermediate_size=8192),
    dict(name="Falcon3-3B-Base", n_layer=22, n_embd=3072, n_head=12, intermediate_size=9216),
    dict(name="Falcon3-7B-Base", n_layer=28, n_embd=3072, n_head=12, intermediate_size=23040),
    dict(name="Falcon3-10B-Base", n_layer=40, n_embd=3072, n_head=12, intermediate_size=23040),
)

FALCON3_INSTRUCT = [
    dict(c, block_size=8192) if c["name"] == "Falcon3-1B-Instruct" else c
    for c in tuned(FALCON3, lambda name: name.replace("-Base", "-Instruct"), "falcon3")
]

CONFIGS = [*FALCON3, *FALCON3_INSTRUCT]

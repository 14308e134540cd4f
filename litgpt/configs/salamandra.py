"""BSC Salamandra (Llama architecture, a 256000-token multilingual vocabulary): https://huggingface.co/BSC-LT.

2B has full multi-head attention and rms_norm_eps 1e-5; 7B has 8 key/value heads and rms_norm_eps 1e-6.
"""

from litgpt.configs import tuned, variants

SALAMANDRA = variants(
    "BSC-LT",
    dict(
        hf_model_type="llama",
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        tie_embeddings=False,
        block_size=8192,
        vocab_size=256000,
        padded_vocab_size=256000,
        rope_base=10000.0,
    ),
    dict(name="salamandra-2b", n_layer=24, n_embd=2048, n_head=16, intermediate_size=5440, norm_eps=1e-5),
    dict(name="salamandra-7b", n_layer=32, n_embd=4096, n_head=32, n_query_groups=8, intermediate_size=11008,
         norm_eps=1e-6),
)

CONFIGS = [*SALAMANDRA, *tuned(SALAMANDRA, "-instruct", "salamandra")]

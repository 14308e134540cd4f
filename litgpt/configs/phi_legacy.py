"""Microsoft phi-1.5 and phi-2 (Hugging Face `phi` architecture): https://huggingface.co/microsoft.

Attention and a dense GELU MLP run in parallel off one LayerNorm; every linear layer has a bias, the head too.
"""

from litgpt.configs import variants

CONFIGS = variants(
    "microsoft",
    dict(
        hf_model_type="phi",
        block_size=2048,
        vocab_size=51200,
        padded_vocab_size=51200,
        n_head=32,
        norm_class_name="LayerNorm",
        norm_eps=1e-5,
        mlp_class_name="GptNeoxMLP",
        gelu_approximate="tanh",  # gelu_new
        parallel_residual=True,
        shared_attention_norm=True,
        bias=True,
        lm_head_bias=True,
        rope_base=10000.0,
        tie_embeddings=False,
    ),
    dict(name="phi-1_5", n_layer=24, n_embd=2048, intermediate_size=8192, rotary_percentage=0.5),
    dict(name="phi-2", n_layer=32, n_embd=2560, intermediate_size=10240, rotary_percentage=0.4),
)

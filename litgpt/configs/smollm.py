"""Hugging Face SmolLM2 (Llama architecture): https://huggingface.co/HuggingFaceTB."""

from litgpt.configs import tuned, variants

SMOLLM2 = variants(
    "HuggingFaceTB",
    dict(
        hf_model_type="llama",
        norm_class_name="RMSNorm",
        norm_eps=1e-5,
        mlp_class_name="LLaMAMLP",
        tie_embeddings=True,
        block_size=8192,
        vocab_size=49152,
        padded_vocab_size=49152,
        rope_base=100000.0,
    ),
    dict(name="SmolLM2-135M", n_layer=30, n_embd=576, n_head=9, n_query_groups=3, intermediate_size=1536),
    dict(name="SmolLM2-360M", n_layer=32, n_embd=960, n_head=15, n_query_groups=5, intermediate_size=2560),
    dict(name="SmolLM2-1.7B", n_layer=24, n_embd=2048, n_head=32, n_query_groups=32, intermediate_size=8192,
         rope_base=130000.0),
)

CONFIGS = [*SMOLLM2, *tuned(SMOLLM2, "-Instruct", "chatml")]

# SmolLM3 (Hugging Face `smollm3`): every fourth layer has no rotary embedding (NoPE), the published no_rope_layers.
SMOLLM3 = variants(
    "HuggingFaceTB",
    dict(
        hf_model_type="smollm3",
        norm_class_name="RMSNorm",
        norm_eps=1e-6,
        mlp_class_name="LLaMAMLP",
        tie_embeddings=True,
        block_size=65536,
        vocab_size=128256,
        padded_vocab_size=128256,
        rope_base=5000000.0,
        n_layer=36,
        n_embd=2048,
        n_head=16,
        n_query_groups=4,
        intermediate_size=11008,
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)],
    ),
    dict(name="SmolLM3-3B-Base"),
    dict(name="SmolLM3-3B", prompt_style="chatml"),
)

CONFIGS += SMOLLM3

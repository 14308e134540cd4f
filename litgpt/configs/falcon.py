"""TII Falcon 7B, 40B and 180B (Hugging Face `falcon` architecture): https://huggingface.co/tiiuae.

Falcon3 is Llama-architecture and lives with the Llama-style families. The published config.json files leave out
tie_word_embeddings, so transformers ties the output head to the embeddings (FalconConfig's default).
"""

from litgpt.configs import tuned, variants

COMMON = dict(
    hf_model_type="falcon",
    block_size=2048,
    vocab_size=65024,
    padded_vocab_size=65024,
    norm_class_name="LayerNorm",
    norm_eps=1e-5,
    mlp_class_name="GptNeoxMLP",
    parallel_residual=True,
    bias=False,
    rotary_percentage=1.0,
    rope_base=10000.0,
    tie_embeddings=True,
)

# falcon-7b: multi-query attention and one LayerNorm for attention and MLP (the original decoder).
_7B = variants("tiiuae", COMMON, dict(name="falcon-7b", n_layer=32, n_embd=4544, n_head=71, n_query_groups=1,
                                      intermediate_size=18176, shared_attention_norm=True))
# 40B and 180B: new_decoder_architecture, 8 KV groups and two LayerNorms (ln_attn, ln_mlp).
_40B = variants("tiiuae", COMMON, dict(name="falcon-40b", n_layer=60, n_embd=8192, n_head=128, n_query_groups=8,
                                       intermediate_size=32768))
_180B = variants("tiiuae", COMMON, dict(name="falcon-180B", n_layer=80, n_embd=14848, n_head=232, n_query_groups=8,
                                        intermediate_size=59392))

# LitGPT has no Falcon chat prompt style of ours: the instruct/chat twins keep the plain one.
CONFIGS = [
    *_7B, *tuned(_7B, "-instruct", "default"),
    *_40B, *tuned(_40B, "-instruct", "default"),
    *_180B, *tuned(_180B, "-chat", "default"),
]

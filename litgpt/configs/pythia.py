"""EleutherAI Pythia (GPT-NeoX architecture): https://huggingface.co/EleutherAI."""

from litgpt.configs import variants

COMMON = dict(
    hf_model_type="gpt_neox",
    block_size=2048,
    vocab_size=50304,
    padded_vocab_size=50304,
    bias=True,
    norm_class_name="LayerNorm",
    norm_eps=1e-5,
    parallel_residual=True,
    mlp_class_name="GptNeoxMLP",
    rotary_percentage=0.25,
    rope_base=10000.0,
    tie_embeddings=False,
)

# intermediate_size is 4 * n_embd throughout (the Config default).
_SIZES = [
    dict(name="pythia-70m", n_layer=6, n_embd=512, n_head=8),
    dict(name="pythia-160m", n_layer=12, n_embd=768, n_head=12),
    dict(name="pythia-410m", n_layer=24, n_embd=1024, n_head=16),
    dict(name="pythia-1b", n_layer=16, n_embd=2048, n_head=8),
    dict(name="pythia-1.4b", n_layer=24, n_embd=2048, n_head=16),
    dict(name="pythia-2.8b", n_layer=32, n_embd=2560, n_head=32),
    dict(name="pythia-6.9b", n_layer=32, n_embd=4096, n_head=32, vocab_size=50432, padded_vocab_size=50432),
    dict(name="pythia-12b", n_layer=36, n_embd=5120, n_head=40, vocab_size=50688, padded_vocab_size=50688),
]

CONFIGS = variants(
    "EleutherAI",
    COMMON,
    dict(name="pythia-14m", block_size=512, n_layer=6, n_embd=128, n_head=4),
    dict(name="pythia-31m", block_size=1024, n_layer=6, n_embd=256, n_head=8),
    *_SIZES,
    # The same models trained on the deduplicated Pile.
    *({**size, "name": size["name"] + "-deduped"} for size in _SIZES),
)

"""Google Gemma, CodeGemma, Gemma 2 and Gemma 3 (text): https://huggingface.co/google."""

from litgpt.configs import tuned, variants

_COMMON = dict(
    norm_class_name="RMSNorm",
    norm_eps=1e-6,
    norm_unit_offset=True,
    post_attention_norm=True,
    post_mlp_norm=True,
    scale_embeddings=True,
    mlp_class_name="GemmaMLP",
    gelu_approximate="tanh",
    tie_embeddings=True,
)

# ---- Gemma (1) and CodeGemma -----------------------------------------------------------------------------------
# No post-norms, softcapping or sliding windows; 2B has one key/value head, 7B full multi-head attention. Scores are
# scaled by 1/sqrt(head_dim), which the converter writes as attention_scores_scalar = head_dim.
_GEMMA_1 = dict(
    {k: v for k, v in _COMMON.items() if k not in ("post_attention_norm", "post_mlp_norm")},
    hf_model_type="gemma", block_size=8192, vocab_size=256000, padded_vocab_size=256000, rope_base=10000.0,
    head_size=256, attention_scores_scalar=256,
)
_GEMMA_7B = dict(n_layer=28, n_embd=3072, n_head=16, n_query_groups=16, intermediate_size=24576)
GEMMA_1 = variants(
    "google",
    _GEMMA_1,
    dict(name="gemma-2b", n_layer=18, n_embd=2048, n_head=8, n_query_groups=1, intermediate_size=16384),
    dict(name="gemma-7b", **_GEMMA_7B),
)
CODEGEMMA = variants("google", _GEMMA_1, dict(name="codegemma-7b-it", **_GEMMA_7B, prompt_style="gemma"))

# ---- Gemma 2 -----------------------------------------------------------------------------------------------------
# Layers alternate a 4096-token sliding window (even layers) with global attention (odd layers).
GEMMA_2 = variants(
    "google",
    dict(
        _COMMON, hf_model_type="gemma2", block_size=8192, vocab_size=256000, padded_vocab_size=256000,
        rope_base=10000.0, sliding_window_size=4096, sliding_window_pattern=2,
        attention_logit_softcapping=50.0, final_logit_softcapping=30.0,
    ),
    dict(name="gemma-2-2b", n_layer=26, n_embd=2304, n_head=8, n_query_groups=4, head_size=256,
         intermediate_size=9216, attention_scores_scalar=256),
    dict(name="gemma-2-9b", n_layer=42, n_embd=3584, n_head=16, n_query_groups=8, head_size=256,
         intermediate_size=14336, attention_scores_scalar=256),
    dict(name="gemma-2-27b", n_layer=46, n_embd=4608, n_head=32, n_query_groups=16, head_size=128,
         intermediate_size=36864, attention_scores_scalar=144),
)

# ---- Gemma 3 -----------------------------------------------------------------------------------------------------
# Five sliding-window layers (rope base 1e4) to one global layer (rope base 1e6), RMS-normalized queries and keys.
# 4B and up are image-text checkpoints (Hugging Face model_type "gemma3"); registered here is their language model
# (its `text_config`, model_type "gemma3_text"), whose vocabulary also has rows for the image tokens.
_GEMMA_3 = dict(
    _COMMON, hf_model_type="gemma3_text", norm_qk=True, rope_base=1000000.0, rope_local_base=10000.0,
    sliding_window_pattern=6, head_size=256, attention_scores_scalar=256,
)
_LARGE = dict(block_size=131072, vocab_size=262208, padded_vocab_size=262208, sliding_window_size=1024,
              rope_scaling=dict(type="linear", factor=8.0))
GEMMA_3 = variants(
    "google",
    _GEMMA_3,
    dict(name="gemma-3-1b-pt", n_layer=26, n_embd=1152, n_head=4, n_query_groups=1, intermediate_size=6912,
         block_size=32768, vocab_size=262144, padded_vocab_size=262144, sliding_window_size=512),
    dict(name="gemma-3-4b-pt", n_layer=34, n_embd=2560, n_head=8, n_query_groups=4, intermediate_size=10240,
         **_LARGE),
    dict(name="gemma-3-12b-pt", n_layer=48, n_embd=3840, n_head=16, n_query_groups=8, intermediate_size=15360,
         **_LARGE),
    dict(name="gemma-3-27b-pt", n_layer=62, n_embd=5376, n_head=32, n_query_groups=16, intermediate_size=21504,
         head_size=128, attention_scores_scalar=168, **_LARGE),
)

CONFIGS = [
    *GEMMA_1,
    *tuned(GEMMA_1, "-it", "gemma"),
    *CODEGEMMA,
    *GEMMA_2,
    *tuned(GEMMA_2, "-it", "gemma"),
    *GEMMA_3,
    *tuned(GEMMA_3, lambda name: name.replace("-pt", "-it"), "gemma"),
]

# LitGPT 0.5.13 capitalizes "Gemma" (its code recognizes the family by that word) and registers the -it models only
# of Gemma 3.
LITGPT_NAMES = {
    name.replace("codegemma", "CodeGemma").replace("gemma", "Gemma", 1): name
    for name in (c["name"] for c in CONFIGS)
    if not name.startswith("gemma-3-") or name.endswith("-it")
}

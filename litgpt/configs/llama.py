"""Meta Llama 2 / 3 / 3.1 / 3.2 / 3.3, Code Llama, TinyLlama and MicroLlama: https://huggingface.co/meta-llama."""

from litgpt.configs import tuned, variants

COMMON = dict(
    hf_model_type="llama",
    norm_class_name="RMSNorm",
    norm_eps=1e-5,
    mlp_class_name="LLaMAMLP",
    tie_embeddings=False,
)

# ---- TinyLlama ---------------------------------------------------------------------------------------------------
_TINY = dict(
    block_size=2048, vocab_size=32000, padded_vocab_size=32000, rope_base=10000.0,
    n_layer=22, n_embd=2048, n_head=32, n_query_groups=4, intermediate_size=5632,
)
TINYLLAMA = variants(
    "TinyLlama",
    {**COMMON, **_TINY},
    dict(name="tiny-llama-1.1b", hf_config=dict(org="TinyLlama", name="TinyLlama-1.1B-intermediate-step-1431k-3T")),
    dict(name="tiny-llama-1.1b-chat", hf_config=dict(org="TinyLlama", name="TinyLlama-1.1B-Chat-v1.0"),
         prompt_style="tinyllama"),
)
# MicroLlama (keeeeenw/MicroLlama): TinyLlama's recipe at 300M parameters.
MICRO_LLAMA = variants(
    "keeeeenw",
    {**COMMON, **_TINY, "n_layer": 12, "n_embd": 1024, "n_head": 16},
    dict(name="micro-llama-300M", hf_config=dict(org="keeeeenw", name="MicroLlama")),
)

# ---- Llama 2 -----------------------------------------------------------------------------------------------------
LLAMA_2 = variants(
    "meta-llama",
    {**COMMON, "block_size": 4096, "vocab_size": 32000, "padded_vocab_size": 32000, "rope_base": 10000.0},
    dict(name="Llama-2-7b-hf", n_layer=32, n_embd=4096, n_head=32, intermediate_size=11008),
    dict(name="Llama-2-13b-hf", n_layer=40, n_embd=5120, n_head=40, intermediate_size=13824),
    dict(name="Llama-2-70b-hf", n_layer=80, n_embd=8192, n_head=64, n_query_groups=8, intermediate_size=28672),
)
LLAMA_2_CHAT = tuned(LLAMA_2, lambda name: name.replace("-hf", "-chat-hf"), "llama2")

# ---- Llama 3, 3.1, 3.2, 3.3 --------------------------------------------------------------------------------------
_LLAMA_3 = dict(COMMON, vocab_size=128256, padded_vocab_size=128256, rope_base=500000.0)
_8B = dict(n_layer=32, n_embd=4096, n_head=32, n_query_groups=8, intermediate_size=14336)
_70B = dict(n_layer=80, n_embd=8192, n_head=64, n_query_groups=8, intermediate_size=28672)
_405B = dict(n_layer=126, n_embd=16384, n_head=128, n_query_groups=8, intermediate_size=53248)


def _llama3_scaling(factor: float) -> dict:
    return dict(type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)


LLAMA_3 = variants(
    "meta-llama",
    {**_LLAMA_3, "block_size": 8192},
    dict(name="Meta-Llama-3-8B", **_8B),
    dict(name="Meta-Llama-3-70B", **_70B),
)
LLAMA_3_1 = variants(
    "meta-llama",
    {**_LLAMA_3, "block_size": 131072, "rope_scaling": _llama3_scaling(8.0)},
    dict(name="Llama-3.1-8B", **_8B),
    dict(name="Llama-3.1-70B", **_70B),
    dict(name="Llama-3.1-405B", **_405B),
)
LLAMA_3_2 = variants(
    "meta-llama",
    {**_LLAMA_3, "block_size": 131072, "rope_scaling": _llama3_scaling(32.0), "tie_embeddings": True},
    dict(name="Llama-3.2-1B", n_layer=16, n_embd=2048, n_head=32, n_query_groups=8, intermediate_size=8192),
    dict(name="Llama-3.2-3B", n_layer=28, n_embd=3072, n_head=24, n_query_groups=8, intermediate_size=8192),
)
# Llama 3.3 was published as an instruct model only; its architecture is Llama 3.1 70B's.
LLAMA_3_3 = variants(
    "meta-llama",
    {**_LLAMA_3, "block_size": 131072, "rope_scaling": _llama3_scaling(8.0), "prompt_style": "llama3"},
    dict(name="Llama-3.3-70B-Instruct", **_70B),
)

# ---- Code Llama --------------------------------------------------------------------------------------------------
# 7B and 13B (base and instruct) add 16 infilling tokens to the vocabulary; the 7B/13B Python and 34B models do not.
# 70B (all three) has 32016 rows and Llama 2 70B's shape; its instruct model ends turns with <step> (id 32015).
_CODE = dict(COMMON, block_size=16384, rope_base=1000000.0)
_CODE_7B = dict(n_layer=32, n_embd=4096, n_head=32, intermediate_size=11008)
_CODE_13B = dict(n_layer=40, n_embd=5120, n_head=40, intermediate_size=13824)
_CODE_34B = dict(n_layer=48, n_embd=8192, n_head=64, n_query_groups=8, intermediate_size=22016)
_CODE_70B = dict(n_layer=80, n_embd=8192, n_head=64, n_query_groups=8, intermediate_size=28672)
_V32016 = dict(vocab_size=32016, padded_vocab_size=32016)
_V32000 = dict(vocab_size=32000, padded_vocab_size=32000)
CODE_LLAMA = variants(
    "codellama",
    _CODE,
    dict(name="CodeLlama-7b-hf", **_CODE_7B, **_V32016),
    dict(name="CodeLlama-13b-hf", **_CODE_13B, **_V32016),
    dict(name="CodeLlama-34b-hf", **_CODE_34B, **_V32000),
    dict(name="CodeLlama-7b-Python-hf", **_CODE_7B, **_V32000),
    dict(name="CodeLlama-13b-Python-hf", **_CODE_13B, **_V32000),
    dict(name="CodeLlama-34b-Python-hf", **_CODE_34B, **_V32000),
    dict(name="CodeLlama-7b-Instruct-hf", **_CODE_7B, **_V32016, prompt_style="llama2"),
    dict(name="CodeLlama-13b-Instruct-hf", **_CODE_13B, **_V32016, prompt_style="llama2"),
    dict(name="CodeLlama-34b-Instruct-hf", **_CODE_34B, **_V32000, prompt_style="llama2"),
    dict(name="CodeLlama-70b-hf", **_CODE_70B, **_V32016),
    dict(name="CodeLlama-70b-Python-hf", **_CODE_70B, **_V32016),
    dict(name="CodeLlama-70b-Instruct-hf", **_CODE_70B, **_V32016, prompt_style="codellama-70b"),
)

CONFIGS = [
    *TINYLLAMA,
    *MICRO_LLAMA,
    *LLAMA_2,
    *LLAMA_2_CHAT,
    *LLAMA_3,
    *tuned(LLAMA_3, "-Instruct", "llama3"),
    *LLAMA_3_1,
    *tuned(LLAMA_3_1, "-Instruct", "llama3"),
    *LLAMA_3_2,
    *tuned(LLAMA_3_2, "-Instruct", "llama3"),
    *LLAMA_3_3,
    *CODE_LLAMA,
]

# LitGPT 0.5.13 names Llama 3 without "Meta-".
LITGPT_NAMES = {name[len("Meta-"):]: name for name in (c["name"] for c in CONFIGS) if name.startswith("Meta-Llama-3-")}

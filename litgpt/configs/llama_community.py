"""Llama models of other organizations (OpenLLaMA, Platypus, FreeWilly2, Llama 2 variants, R1-Distill-Llama,
Nemotron): https://huggingface.co.

Each is a re-training or fine-tune of a Meta Llama shape, so the values are Llama's (litgpt/configs/llama.py) except
where the repo's own config.json differs, as noted per family.
"""

from litgpt.configs import variants
from litgpt.configs.llama import _8B, _70B, _LLAMA_3, COMMON, _llama3_scaling

_LLAMA_2 = dict(COMMON, block_size=4096, vocab_size=32000, padded_vocab_size=32000, rope_base=10000.0)
_L2_7B = dict(n_layer=32, n_embd=4096, n_head=32, intermediate_size=11008)
_L2_13B = dict(n_layer=40, n_embd=5120, n_head=40, intermediate_size=13824)
_L2_70B = dict(n_layer=80, n_embd=8192, n_head=64, n_query_groups=8, intermediate_size=28672)

# ---- OpenLLaMA (openlm-research): LLaMA 1 shapes trained on RedPajama; 3B is its own size -------------------------
OPEN_LLAMA = variants(
    "openlm-research",
    dict(_LLAMA_2, block_size=2048, norm_eps=1e-6),
    dict(name="open_llama_3b", n_layer=26, n_embd=3200, n_head=32, intermediate_size=8640),
    dict(name="open_llama_7b", **_L2_7B),
    dict(name="open_llama_13b", **_L2_13B),
)

# ---- Platypus (garage-bAInd): instruction fine-tunes of LLaMA 1 30B and Llama 2, and merges of them ----------------
PLATYPUS = variants(
    "garage-bAInd",
    dict(_LLAMA_2, prompt_style="platypus"),
    dict(name="Platypus-30B", block_size=2048, norm_eps=1e-6, n_layer=60, n_embd=6656, n_head=52,
         intermediate_size=17920),
    dict(name="Platypus2-7B", **_L2_7B),
    dict(name="Platypus2-13B", **_L2_13B),
    dict(name="Platypus2-70B", **_L2_70B),
    dict(name="Platypus2-70B-instruct", **_L2_70B),
    dict(name="Camel-Platypus2-13B", **_L2_13B),
    dict(name="Camel-Platypus2-70B", **_L2_70B),
    dict(name="Stable-Platypus2-13B", **_L2_13B),
)

# ---- Llama 2 fine-tunes ------------------------------------------------------------------------------------------
LLAMA_2_TUNES = [
    # Stability AI's FreeWilly2: Llama 2 70B tuned on Orca-style data.
    *variants("stabilityai", _LLAMA_2, dict(name="FreeWilly2", **_L2_70B, prompt_style="freewilly2")),
    # Together's 32K-context Llama 2 7B: positions interpolated linearly by 8 (rope_scaling linear, factor 8).
    *variants("togethercomputer", _LLAMA_2, dict(name="LLaMA-2-7B-32K", **_L2_7B, block_size=32768,
                                                  rope_scaling=dict(type="linear", factor=8.0))),
    # Trelis's function-calling tune of Llama-2-7b-chat; its config.json keeps the early rms_norm_eps of 1e-6.
    # Without a function list its prompts are Llama 2 chat turns.
    *variants("Trelis", _LLAMA_2, dict(name="Llama-2-7b-chat-hf-function-calling-v2", **_L2_7B, norm_eps=1e-6,
                                       prompt_style="llama2")),
]

# ---- Llama 3.1 / 3.3 derivatives ---------------------------------------------------------------------------------
_LLAMA_3_1 = dict(_LLAMA_3, block_size=131072, rope_scaling=_llama3_scaling(8.0))
LLAMA_3_TUNES = [
    *variants("nvidia", _LLAMA_3_1, dict(name="Llama-3.1-Nemotron-70B-Instruct-HF", **_70B, prompt_style="llama3")),
    # DeepSeek-R1 distilled into Llama 3.1 8B and Llama 3.3 70B Instruct; the hub repos carry a "DeepSeek-" prefix.
    *variants(
        "deepseek-ai",
        dict(_LLAMA_3_1, prompt_style="deepseek-r1"),
        dict(name="R1-Distill-Llama-8B", **_8B, hf_config=dict(org="deepseek-ai", name="DeepSeek-R1-Distill-Llama-8B")),
        dict(name="R1-Distill-Llama-70B", **_70B,
             hf_config=dict(org="deepseek-ai", name="DeepSeek-R1-Distill-Llama-70B")),
    ),
]

CONFIGS = [*OPEN_LLAMA, *PLATYPUS, *LLAMA_2_TUNES, *LLAMA_3_TUNES]

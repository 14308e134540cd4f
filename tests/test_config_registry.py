"""The named-config registry (litgpt/configs): published values, buildable models, lookup by name and hub id."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
import torch

from litgpt.config import Config
from litgpt.configs import configs_by_name
from litgpt.errors import UserError
from litgpt.model import GPT

REGISTRY = configs_by_name()

# The published Hugging Face config.json values, written out by hand (not derived from the registry):
# name: (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size,
#        rope_theta, norm eps, tie_word_embeddings, head_dim)
PUBLISHED = {
    "pythia-14m": (128, 6, 4, 4, 512, 50304, 10000, 1e-5, False, 32),
    "pythia-70m": (512, 6, 8, 8, 2048, 50304, 10000, 1e-5, False, 64),
    "pythia-160m": (768, 12, 12, 12, 3072, 50304, 10000, 1e-5, False, 64),
    "pythia-1b": (2048, 16, 8, 8, 8192, 50304, 10000, 1e-5, False, 256),
    "pythia-2.8b": (2560, 32, 32, 32, 10240, 50304, 10000, 1e-5, False, 80),
    "pythia-6.9b": (4096, 32, 32, 32, 16384, 50432, 10000, 1e-5, False, 128),
    "pythia-12b": (5120, 36, 40, 40, 20480, 50688, 10000, 1e-5, False, 128),
    "tiny-llama-1.1b": (2048, 22, 32, 4, 5632, 32000, 10000, 1e-5, False, 64),
    "tiny-llama-1.1b-chat": (2048, 22, 32, 4, 5632, 32000, 10000, 1e-5, False, 64),
    "micro-llama-300M": (1024, 12, 16, 4, 5632, 32000, 10000, 1e-5, False, 64),
    "Llama-2-7b-hf": (4096, 32, 32, 32, 11008, 32000, 10000, 1e-5, False, 128),
    "Llama-2-13b-chat-hf": (5120, 40, 40, 40, 13824, 32000, 10000, 1e-5, False, 128),
    "Llama-2-70b-hf": (8192, 80, 64, 8, 28672, 32000, 10000, 1e-5, False, 128),
    "Meta-Llama-3-8B-Instruct": (4096, 32, 32, 8, 14336, 128256, 500000, 1e-5, False, 128),
    "Llama-3.1-8B": (4096, 32, 32, 8, 14336, 128256, 500000, 1e-5, False, 128),
    "Llama-3.1-70B-Instruct": (8192, 80, 64, 8, 28672, 128256, 500000, 1e-5, False, 128),
    "Llama-3.1-405B": (16384, 126, 128, 8, 53248, 128256, 500000, 1e-5, False, 128),
    "Llama-3.2-1B": (2048, 16, 32, 8, 8192, 128256, 500000, 1e-5, True, 64),
    "Llama-3.2-3B-Instruct": (3072, 28, 24, 8, 8192, 128256, 500000, 1e-5, True, 128),
    "Llama-3.3-70B-Instruct": (8192, 80, 64, 8, 28672, 128256, 500000, 1e-5, False, 128),
    "CodeLlama-7b-hf": (4096, 32, 32, 32, 11008, 32016, 1000000, 1e-5, False, 128),
    "CodeLlama-13b-Instruct-hf": (5120, 40, 40, 40, 13824, 32016, 1000000, 1e-5, False, 128),
    "CodeLlama-34b-hf": (8192, 48, 64, 8, 22016, 32000, 1000000, 1e-5, False, 128),
    "CodeLlama-7b-Python-hf": (4096, 32, 32, 32, 11008, 32000, 1000000, 1e-5, False, 128),
    "Mistral-7B-v0.1": (4096, 32, 32, 8, 14336, 32000, 10000, 1e-5, False, 128),
    "Mistral-7B-Instruct-v0.2": (4096, 32, 32, 8, 14336, 32000, 1000000, 1e-5, False, 128),
    "Mistral-7B-v0.3": (4096, 32, 32, 8, 14336, 32768, 1000000, 1e-5, False, 128),
    "Mixtral-8x7B-v0.1": (4096, 32, 32, 8, 14336, 32000, 1000000, 1e-5, False, 128),
    "Qwen2.5-0.5B": (896, 24, 14, 2, 4864, 151936, 1000000, 1e-6, True, 64),
    "Qwen2.5-1.5B-Instruct": (1536, 28, 12, 2, 8960, 151936, 1000000, 1e-6, True, 128),
    "Qwen2.5-3B": (2048, 36, 16, 2, 11008, 151936, 1000000, 1e-6, True, 128),
    "Qwen2.5-7B": (3584, 28, 28, 4, 18944, 152064, 1000000, 1e-6, False, 128),
    "Qwen2.5-14B-Instruct": (5120, 48, 40, 8, 13824, 152064, 1000000, 1e-6, False, 128),
    "Qwen2.5-32B": (5120, 64, 40, 8, 27648, 152064, 1000000, 1e-6, False, 128),
    "Qwen2.5-72B": (8192, 80, 64, 8, 29568, 152064, 1000000, 1e-6, False, 128),
    "Qwen3-0.6B": (1024, 28, 16, 8, 3072, 151936, 1000000, 1e-6, True, 128),
    "Qwen3-1.7B": (2048, 28, 16, 8, 6144, 151936, 1000000, 1e-6, True, 128),
    "Qwen3-4B": (2560, 36, 32, 8, 9728, 151936, 1000000, 1e-6, True, 128),
    "Qwen3-8B": (4096, 36, 32, 8, 12288, 151936, 1000000, 1e-6, False, 128),
    "gpt-oss-20b": (2880, 24, 64, 8, 2880, 201088, 150000, 1e-5, False, 64),
    "gpt-oss-120b": (2880, 36, 64, 8, 2880, 201088, 150000, 1e-5, False, 64),
    "Qwen3-14B": (5120, 40, 40, 8, 17408, 151936, 1000000, 1e-6, False, 128),
    "Qwen3-32B": (5120, 64, 64, 8, 25600, 151936, 1000000, 1e-6, False, 128),
    "Qwen3-30B-A3B": (2048, 48, 32, 4, 6144, 151936, 1000000, 1e-6, False, 128),
    "Phi-3-mini-4k-instruct": (3072, 32, 32, 32, 8192, 32064, 10000, 1e-5, False, 96),
    "Phi-3-medium-4k-instruct": (5120, 40, 40, 10, 17920, 32064, 10000, 1e-5, False, 128),
    "phi-4": (5120, 40, 40, 10, 17920, 100352, 250000, 1e-5, False, 128),
    "gemma-2-2b": (2304, 26, 8, 4, 9216, 256000, 10000, 1e-6, True, 256),
    "gemma-2-9b-it": (3584, 42, 16, 8, 14336, 256000, 10000, 1e-6, True, 256),
    "gemma-2-27b": (4608, 46, 32, 16, 36864, 256000, 10000, 1e-6, True, 128),
    "gemma-3-1b-it": (1152, 26, 4, 1, 6912, 262144, 1000000, 1e-6, True, 256),
    "gemma-3-4b-it": (2560, 34, 8, 4, 10240, 262208, 1000000, 1e-6, True, 256),
    "gemma-3-12b-pt": (3840, 48, 16, 8, 15360, 262208, 1000000, 1e-6, True, 256),
    "gemma-3-27b-it": (5376, 62, 32, 16, 21504, 262208, 1000000, 1e-6, True, 128),
    "SmolLM2-135M": (576, 30, 9, 3, 1536, 49152, 100000, 1e-5, True, 64),
    "SmolLM2-360M-Instruct": (960, 32, 15, 5, 2560, 49152, 100000, 1e-5, True, 64),
    "SmolLM2-1.7B": (2048, 24, 32, 32, 8192, 49152, 130000, 1e-5, True, 64),
    # Falcon's config.json has num_kv_heads (new_decoder_architecture) or multi_query (one KV head), ffn_hidden_size
    # or none (4 * hidden_size), no tie_word_embeddings (FalconConfig ties).
    "falcon-7b": (4544, 32, 71, 1, 18176, 65024, 10000, 1e-5, True, 64),
    "falcon-40b-instruct": (8192, 60, 128, 8, 32768, 65024, 10000, 1e-5, True, 64),
    "falcon-180B": (14848, 80, 232, 8, 59392, 65024, 10000, 1e-5, True, 64),
    "stablelm-3b-4e1t": (2560, 32, 32, 32, 6912, 50304, 10000, 1e-5, False, 80),
    "stablelm-zephyr-3b": (2560, 32, 32, 32, 6912, 50304, 10000, 1e-5, False, 80),
    "stable-code-3b": (2560, 32, 32, 32, 6912, 50304, 1000000, 1e-5, False, 80),
    "stablelm-base-alpha-3b": (4096, 16, 32, 32, 16384, 50688, 10000, 1e-5, False, 128),
    "stablelm-tuned-alpha-7b": (6144, 16, 48, 48, 24576, 50432, 10000, 1e-5, False, 128),
    "stablecode-completion-alpha-3b": (2560, 32, 32, 32, 10240, 49152, 10000, 1e-5, False, 80),
    "phi-1_5": (2048, 24, 32, 32, 8192, 51200, 10000, 1e-5, False, 64),
    "phi-2": (2560, 32, 32, 32, 10240, 51200, 10000, 1e-5, False, 80),
    "OLMo-1B-hf": (2048, 16, 16, 16, 8192, 50304, 10000, 1e-5, True, 128),
    "OLMo-7B-hf": (4096, 32, 32, 32, 11008, 50304, 10000, 1e-5, False, 128),
    "OLMo-7B-Instruct-hf": (4096, 32, 32, 32, 11008, 50304, 10000, 1e-5, False, 128),
    "OLMo-2-0425-1B": (2048, 16, 16, 16, 8192, 100352, 500000, 1e-6, False, 128),
    "OLMo-2-1124-7B": (4096, 32, 32, 32, 11008, 100352, 500000, 1e-6, False, 128),
    "OLMo-2-1124-13B-Instruct": (5120, 40, 40, 40, 13824, 100352, 500000, 1e-6, False, 128),
    "OLMo-2-0325-32B": (5120, 64, 40, 8, 27648, 100352, 500000, 1e-6, False, 128),
    "SmolLM3-3B": (2048, 36, 16, 4, 11008, 128256, 5000000, 1e-6, True, 128),
    "SmolLM3-3B-Base": (2048, 36, 16, 4, 11008, 128256, 5000000, 1e-6, True, 128),
    "Phi-3.5-mini-instruct": (3072, 32, 32, 32, 8192, 32064, 10000, 1e-5, False, 96),
    "Phi-4-mini-instruct": (3072, 32, 24, 8, 8192, 200064, 10000, 1e-5, True, 128),
    "GLM-4.5": (5120, 92, 96, 8, 12288, 151552, 1000000, 1e-5, False, 128),
    "GLM-4.5-Air": (4096, 46, 96, 8, 10944, 151552, 1000000, 1e-5, False, 128),
    "GLM-4.6": (5120, 92, 96, 8, 12288, 151552, 1000000, 1e-5, False, 128),
    # Latent attention: head_dim is qk_nope_head_dim + qk_rope_head_dim (128 + 64); key/value heads = heads.
    "DeepSeek-V3": (7168, 61, 128, 128, 18432, 129280, 10000, 1e-6, False, 192),
    "DeepSeek-V3-Base": (7168, 61, 128, 128, 18432, 129280, 10000, 1e-6, False, 192),
    "DeepSeek-R1": (7168, 61, 128, 128, 18432, 129280, 10000, 1e-6, False, 192),
    "Kimi-K2-Instruct": (7168, 61, 64, 64, 18432, 163840, 50000, 1e-6, False, 192),
    "Kimi-K2-Base": (7168, 61, 64, 64, 18432, 163840, 50000, 1e-6, False, 192),
    "DeepSeek-V2-Lite": (2048, 27, 16, 16, 10944, 102400, 10000, 1e-6, False, 192),
    "DeepSeek-V2-Lite-Chat": (2048, 27, 16, 16, 10944, 102400, 10000, 1e-6, False, 192),
}

# Published context lengths (max_position_embeddings).
PUBLISHED_BLOCK_SIZE = {
    "pythia-14m": 512,
    "pythia-410m": 2048,
    "tiny-llama-1.1b": 2048,
    "micro-llama-300M": 2048,
    "Llama-2-7b-hf": 4096,
    "Meta-Llama-3-8B": 8192,
    "Llama-3.1-8B": 131072,
    "Llama-3.2-1B": 131072,
    "CodeLlama-34b-hf": 16384,
    "Mistral-7B-v0.1": 32768,
    "Mixtral-8x7B-v0.1": 32768,
    "Qwen2.5-0.5B": 32768,
    "Qwen2.5-7B": 131072,
    "Qwen2.5-7B-Instruct": 32768,
    "Qwen3-0.6B": 40960,
    "Qwen3-30B-A3B": 40960,
    "Phi-3-mini-4k-instruct": 4096,
    "phi-4": 16384,
    "gemma-2-9b": 8192,
    "gemma-3-1b-it": 32768,
    "gemma-3-27b-it": 131072,
    "SmolLM2-135M": 8192,
    "falcon-180B-chat": 2048,
    "stable-code-3b": 16384,
    "stablecode-completion-alpha-3b": 16384,
    "stablecode-completion-alpha-3b-4k": 4096,
    "stablelm-zephyr-3b": 4096,
    "phi-2": 2048,
    "OLMo-7B-hf": 2048,
    "gpt-oss-20b": 131072,
    "gpt-oss-120b": 131072,
    "OLMo-2-0425-1B": 4096,
    "OLMo-2-0325-32B-Instruct": 4096,
    "SmolLM3-3B": 65536,
    "Phi-3.5-mini-instruct": 131072,
    "Phi-4-mini-instruct": 131072,
    "GLM-4.5": 131072,
    "GLM-4.5-Air": 131072,
    "GLM-4.6": 202752,
    "DeepSeek-V3": 163840,
    "DeepSeek-R1": 163840,
    "Kimi-K2-Instruct": 131072,
    "DeepSeek-V2-Lite": 163840,
}

# Published total parameter counts (tied embeddings counted once).
PUBLISHED_PARAMS = {
    "pythia-14m": 14.07e6,
    "pythia-70m": 70.4e6,
    "pythia-12b": 11.85e9,
    "tiny-llama-1.1b": 1.1e9,
    "micro-llama-300M": 3.05e8,  # the hub page's safetensors count (305M; "300M" in the name)
    "Llama-2-7b-hf": 6.74e9,
    "Llama-2-70b-hf": 69.0e9,
    "Llama-3.1-8B": 8.03e9,
    "Llama-3.1-70B": 70.6e9,
    "Llama-3.1-405B": 405.9e9,
    "Llama-3.2-1B": 1.24e9,
    "Llama-3.2-3B": 3.21e9,
    "Mistral-7B-v0.1": 7.24e9,
    "Mixtral-8x7B-v0.1": 46.7e9,
    "Qwen2.5-0.5B": 0.49e9,
    "Qwen2.5-7B": 7.61e9,
    "Qwen2.5-72B": 72.7e9,
    "Qwen3-0.6B": 0.6e9,
    "Qwen3-8B": 8.2e9,
    "Qwen3-30B-A3B": 30.5e9,
    "Qwen3-235B-A22B": 235e9,
    "Phi-3-mini-4k-instruct": 3.82e9,
    "Phi-3-medium-4k-instruct": 14.0e9,
    "phi-4": 14.7e9,
    "gemma-2-2b": 2.61e9,
    "gemma-2-9b": 9.24e9,
    "gemma-2-27b": 27.2e9,
    "gemma-3-1b-it": 1.0e9,
    "SmolLM2-135M": 135e6,
    "SmolLM2-360M": 362e6,
    "SmolLM2-1.7B": 1.71e9,
    # The hub counts Falcon's head, stored beside the embedding it is tied to.
    "falcon-7b": 7.22e9 - 65024 * 4544,
    "falcon-40b": 41.8e9 - 65024 * 8192,
    "stablelm-3b-4e1t": 2_795_443_200,  # the model card's exact count
    "phi-1_5": 1.42e9,
    "phi-2": 2.78e9,
    "OLMo-1B-hf": 1.18e9,
    "OLMo-7B-hf": 6.89e9,
    "gpt-oss-20b": 20.91e9,  # the model card's 20.91B total, 3.61B active
    "gpt-oss-120b": 116.83e9,  # 116.83B total, 5.13B active
    "OLMo-2-0425-1B": 1.48e9,
    "OLMo-2-1124-7B": 7.30e9,
    "OLMo-2-1124-13B": 13.7e9,
    "OLMo-2-0325-32B": 32.2e9,
    "SmolLM3-3B": 3.08e9,
    "Phi-3.5-mini-instruct": 3.82e9,
    "Phi-4-mini-instruct": 3.84e9,
    # Without the multi-token prediction layer that the checkpoints also hold (GLM-4.5: 3.9B, Air: 2.3B, which
    # litgpt does not convert): 352.8B and 106.8B, within 1% of the announced 355B and 106B.
    "GLM-4.5": 355e9,
    "GLM-4.5-Air": 106e9,
    # Without the multi-token prediction layer of the V3/R1 checkpoints (14B: 685B with it), as DeepSeek counts.
    "DeepSeek-V3": 671e9,
    "DeepSeek-R1": 671e9,
    "Kimi-K2-Instruct": 1026.5e9,  # the hub's count of the checkpoint ("1T" on the model card)
    "DeepSeek-V2-Lite": 15.7e9,
}
# Published active parameters per token of mixtures: every weight a token goes through except the embedding and
# output matrices (the count model cards announce). Announced in whole billions, hence 5%: "12B" may be 11.5-12.5B.
PUBLISHED_ACTIVE_PARAMS = {
    "GLM-4.5": 32e9,  # 32.1B
    "GLM-4.5-Air": 12e9,  # 12.2B
}

# The names LitGPT 0.5.13 registers that came with its name list (tests/test_litgpt_names.py), one or more per family.
PUBLISHED.update({
    "gemma-7b": (3072, 28, 16, 16, 24576, 256000, 10000, 1e-6, True, 256),
    "gemma-2b-it": (2048, 18, 8, 1, 16384, 256000, 10000, 1e-6, True, 256),
    "codegemma-7b-it": (3072, 28, 16, 16, 24576, 256000, 10000, 1e-6, True, 256),
    "CodeLlama-70b-Instruct-hf": (8192, 80, 64, 8, 28672, 32016, 1000000, 1e-5, False, 128),
    "Mistral-7B-v0.2": (4096, 32, 32, 8, 14336, 32000, 1000000, 1e-5, False, 128),
    "Mathstral-7B-v0.1": (4096, 32, 32, 8, 14336, 32768, 1000000, 1e-5, False, 128),
    "Mistral-Large-Instruct-2407": (12288, 88, 96, 8, 28672, 32768, 1000000, 1e-5, False, 128),
    "Mixtral-8x22B-v0.1": (6144, 56, 48, 8, 16384, 32768, 1000000, 1e-5, False, 128),
    "QwQ-32B": (5120, 64, 40, 8, 27648, 152064, 1000000, 1e-5, False, 128),
    "Qwen2.5-Coder-1.5B-Instruct": (1536, 28, 12, 2, 8960, 151936, 1000000, 1e-6, True, 128),
    "Qwen2.5-Coder-32B": (5120, 64, 40, 8, 27648, 152064, 1000000, 1e-5, False, 128),
    "Qwen2.5-Math-7B": (3584, 28, 28, 4, 18944, 152064, 10000, 1e-6, False, 128),
    "Qwen2.5-7B-Instruct-1M": (3584, 28, 28, 4, 18944, 152064, 10000000, 1e-5, False, 128),
    "Qwen3-8B-Base": (4096, 36, 32, 8, 12288, 151936, 1000000, 1e-6, False, 128),
    "Qwen3-30B-A3B-Instruct-2507": (2048, 48, 32, 4, 6144, 151936, 10000000, 1e-6, False, 128),
    "Qwen3-4B-Thinking-2507": (2560, 36, 32, 8, 9728, 151936, 5000000, 1e-6, True, 128),
    "Falcon3-1B-Instruct": (2048, 18, 8, 4, 8192, 131072, 1000042, 1e-6, False, 256),
    "Falcon3-7B-Base": (3072, 28, 12, 4, 23040, 131072, 1000042, 1e-6, False, 256),
    "salamandra-2b": (2048, 24, 16, 16, 5440, 256000, 10000, 1e-5, False, 128),
    "salamandra-7b-instruct": (4096, 32, 32, 8, 11008, 256000, 10000, 1e-6, False, 128),
    "open_llama_3b": (3200, 26, 32, 32, 8640, 32000, 10000, 1e-6, False, 100),
    "Platypus-30B": (6656, 60, 52, 52, 17920, 32000, 10000, 1e-6, False, 128),
    "Platypus2-70B": (8192, 80, 64, 8, 28672, 32000, 10000, 1e-5, False, 128),
    "FreeWilly2": (8192, 80, 64, 8, 28672, 32000, 10000, 1e-5, False, 128),
    "LLaMA-2-7B-32K": (4096, 32, 32, 32, 11008, 32000, 10000, 1e-5, False, 128),
    "R1-Distill-Llama-8B": (4096, 32, 32, 8, 14336, 128256, 500000, 1e-5, False, 128),
    "Llama-3.1-Nemotron-70B-Instruct-HF": (8192, 80, 64, 8, 28672, 128256, 500000, 1e-5, False, 128),
})
PUBLISHED_BLOCK_SIZE.update({
    "gemma-7b": 8192, "CodeLlama-70b-hf": 16384, "Mathstral-7B-v0.1": 32768, "Mistral-Large-Instruct-2411": 131072,
    "Mixtral-8x22B-v0.1": 65536, "QwQ-32B": 40960, "QwQ-32B-Preview": 32768, "Qwen2.5-Coder-7B": 32768,
    "Qwen2.5-Math-72B-Instruct": 4096, "Qwen2.5-14B-Instruct-1M": 1010000, "Qwen3-0.6B-Base": 32768,
    "Qwen3-235B-A22B-Instruct-2507": 262144, "Falcon3-1B-Base": 4096, "Falcon3-1B-Instruct": 8192,
    "Falcon3-3B-Base": 32768, "Falcon3-10B-Instruct": 32768,
    "salamandra-7b": 8192, "open_llama_13b": 2048, "Platypus-30B": 2048, "LLaMA-2-7B-32K": 32768,
    "R1-Distill-Llama-70B": 131072,
})
# Names whose size announces something else ("1B" for 1.67B parameters) are checked against these instead.
PUBLISHED_PARAMS.update({
    "gemma-7b": 8.54e9, "gemma-2b": 2.51e9, "Mistral-Large-Instruct-2407": 123e9, "Mixtral-8x22B-v0.1": 141e9,
    "QwQ-32B": 32.8e9, "Qwen2.5-Coder-7B": 7.62e9, "Falcon3-1B-Base": 1.67e9, "Falcon3-1B-Instruct": 1.67e9,
    "Falcon3-7B-Base": 7.46e9, "Falcon3-10B-Base": 10.3e9, "salamandra-2b": 2.25e9, "salamandra-7b": 7.77e9,
    "Platypus-30B": 32.5e9, "R1-Distill-Llama-70B": 70.6e9,
})

PROMPT_STYLES = {"default", "alpaca", "chatml", "llama2", "llama3", "mistral", "phi3", "gemma", "tinyllama"}
PROMPT_STYLES |= {"qwen2.5", "qwen2.5-math", "qwq-preview", "chatml-thinking", "deepseek-r1", "falcon3", "salamandra",
                  "codellama-70b", "platypus", "freewilly2", "mistral-v3", "harmony"}
HF_MODEL_TYPES = {
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text", "gpt_neox",
    "falcon", "stablelm", "phi", "olmo", "gpt_oss",
    "olmo2", "smollm3",
    "glm4_moe", "deepseek_v3", "deepseek_v2",
}
HF_MODEL_TYPES |= {"gemma"}


def test_registry_size_and_shape():
    assert len(REGISTRY) >= 60
    known = {f.name for f in fields(Config)}
    repos = set()
    for name, values in REGISTRY.items():
        assert values["name"] == name
        assert set(values) <= known, (name, set(values) - known)
        assert set(values["hf_config"]) == {"org", "name"}, name
        repo = f"{values['hf_config']['org']}/{values['hf_config']['name']}"
        assert repo not in repos, f"{repo} is registered twice"
        repos.add(repo)
        assert values["hf_model_type"] in HF_MODEL_TYPES, name
        assert values.get("prompt_style", "default") in PROMPT_STYLES, name
        # The embedding rows are exactly the published vocabulary.
        assert values["vocab_size"] == values["padded_vocab_size"], name


def test_registry_returns_copies():
    first = configs_by_name()
    first["Llama-3.1-8B"]["rope_scaling"]["factor"] = 1.0
    first["Llama-3.1-8B"]["hf_config"]["org"] = "someone"
    second = configs_by_name()
    assert second["Llama-3.1-8B"]["rope_scaling"]["factor"] == 8.0
    assert second["Llama-3.1-8B"]["hf_config"]["org"] == "meta-llama"


def test_published_table_is_large_enough():
    assert len(PUBLISHED) >= 40


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_values(name):
    n_embd, n_layer, n_head, n_groups, intermediate, vocab, rope_base, eps, tie, head_size = PUBLISHED[name]
    config = Config(**REGISTRY[name])
    assert config.n_embd == n_embd
    assert config.n_layer == n_layer
    assert config.n_head == n_head
    assert config.n_query_groups == n_groups
    assert config.intermediate_size == intermediate
    assert config.vocab_size == vocab
    assert config.padded_vocab_size == vocab
    assert config.rope_base == rope_base
    assert config.norm_eps == eps
    assert config.tie_embeddings is tie
    assert config.head_size == head_size
    if name in PUBLISHED_BLOCK_SIZE:
        assert config.block_size == PUBLISHED_BLOCK_SIZE[name]


def test_family_specifics():
    c = {name: Config(**values) for name, values in REGISTRY.items()}

    pythia = c["pythia-410m"]
    assert pythia.hf_model_type == "gpt_neox"
    assert (pythia.mlp_class_name, pythia.norm_class_name) == ("GptNeoxMLP", "LayerNorm")
    assert pythia.parallel_residual and pythia.bias and pythia.rotary_percentage == 0.25
    assert c["pythia-410m-deduped"].hf_config == {"org": "EleutherAI", "name": "pythia-410m-deduped"}

    assert c["tiny-llama-1.1b-chat"].prompt_style == "tinyllama"
    assert c["Llama-2-7b-chat-hf"].prompt_style == "llama2"
    assert c["Llama-2-7b-chat-hf"].hf_config == {"org": "meta-llama", "name": "Llama-2-7b-chat-hf"}
    llama3 = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192, type="llama3")
    assert c["Meta-Llama-3-8B"].rope_scaling is None
    assert c["Llama-3.1-8B"].rope_scaling == dict(llama3, factor=8.0)
    assert c["Llama-3.3-70B-Instruct"].rope_scaling == dict(llama3, factor=8.0)
    assert c["Llama-3.2-1B"].rope_scaling == dict(llama3, factor=32.0)
    assert c["Llama-3.1-8B-Instruct"].prompt_style == "llama3"
    assert c["Llama-3.1-8B"].prompt_style == "default"

    assert c["Mistral-7B-v0.1"].sliding_window_size == 4096
    assert c["Mistral-7B-v0.1"].sliding_window_pattern == 1
    assert c["Mistral-7B-v0.3"].sliding_window_size is None
    assert c["Mistral-7B-Instruct-v0.3"].prompt_style == "mistral-v3"
    mixtral = c["Mixtral-8x7B-v0.1"]
    assert (mixtral.hf_model_type, mixtral.mlp_class_name) == ("mixtral", "LLaMAMoE")
    assert (mixtral.n_expert, mixtral.n_expert_per_token, mixtral.moe_intermediate_size) == (8, 2, 14336)
    assert mixtral.sliding_window_size is None

    qwen25 = c["Qwen2.5-7B-Instruct"]
    assert qwen25.attn_bias and not qwen25.bias and not qwen25.norm_qk and qwen25.hf_model_type == "qwen2"
    assert qwen25.prompt_style == "qwen2.5" and qwen25.sliding_window_size is None
    qwen3 = c["Qwen3-8B"]
    assert qwen3.norm_qk and not qwen3.attn_bias and qwen3.hf_model_type == "qwen3"
    moe = c["Qwen3-30B-A3B"]
    assert (moe.hf_model_type, moe.mlp_class_name) == ("qwen3_moe", "LLaMAMoE")
    assert (moe.n_expert, moe.n_expert_per_token) == (128, 8)
    assert moe.moe_intermediate_size == 768 and moe.moe_renormalize and moe.norm_qk

    assert c["Phi-3-mini-4k-instruct"].sliding_window_size == 2047
    assert c["Phi-3-mini-4k-instruct"].hf_model_type == "phi3"
    assert c["Phi-3-mini-4k-instruct"].prompt_style == "phi3"
    assert c["phi-4"].sliding_window_size is None

    for name in ("gemma-2-2b", "gemma-2-27b-it", "gemma-3-1b-it", "gemma-3-27b-pt"):
        g = c[name]
        assert g.norm_unit_offset and g.scale_embeddings and g.post_attention_norm and g.post_mlp_norm, name
        assert (g.mlp_class_name, g.gelu_approximate) == ("GemmaMLP", "tanh"), name
    g2 = c["gemma-2-9b"]
    assert g2.hf_model_type == "gemma2" and not g2.norm_qk
    assert (g2.sliding_window_size, g2.sliding_window_pattern) == (4096, 2)
    assert (g2.attention_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.attention_scores_scalar == 256 and c["gemma-2-27b"].attention_scores_scalar == 144
    assert g2.is_sliding_layer(0) and not g2.is_sliding_layer(1)
    g3 = c["gemma-3-1b-it"]
    assert g3.hf_model_type == "gemma3_text" and g3.norm_qk and g3.prompt_style == "gemma"
    assert (g3.sliding_window_size, g3.sliding_window_pattern) == (512, 6)
    assert (g3.rope_base, g3.rope_local_base, g3.rope_scaling) == (1e6, 1e4, None)
    assert g3.attention_logit_softcapping is None and g3.final_logit_softcapping is None
    assert [g3.is_sliding_layer(i) for i in range(6)] == [True] * 5 + [False]
    for name in ("gemma-3-4b-it", "gemma-3-12b-pt", "gemma-3-27b-it"):
        g = c[name]
        assert g.sliding_window_size == 1024 and g.rope_scaling == {"type": "linear", "factor": 8.0}, name
    assert c["gemma-3-27b-it"].attention_scores_scalar == 168
    assert c["gemma-3-1b-pt"].prompt_style == "default"

    assert c["SmolLM2-1.7B-Instruct"].prompt_style == "chatml"
    assert c["SmolLM2-135M"].hf_config == {"org": "HuggingFaceTB", "name": "SmolLM2-135M"}


def test_olmo2_smollm3_longrope_specifics():
    c = {name: Config(**values) for name, values in REGISTRY.items()}
    for name in ("OLMo-2-0425-1B", "OLMo-2-1124-13B-Instruct", "OLMo-2-0325-32B"):
        olmo = c[name]
        assert (olmo.hf_model_type, olmo.norm_qk, olmo.norm_qk_type) == ("olmo2", True, "olmo2"), name
        assert not olmo.norm_1 and not olmo.norm_2 and olmo.post_attention_norm and olmo.post_mlp_norm, name
    assert c["OLMo-2-1124-7B-Instruct"].hf_config == {"org": "allenai", "name": "OLMo-2-1124-7B-Instruct"}
    smol = c["SmolLM3-3B"]
    assert smol.hf_model_type == "smollm3" and smol.prompt_style == "chatml"
    assert [i for i in range(36) if not smol.uses_rope(i)] == list(range(3, 36, 4))
    assert c["SmolLM3-3B-Base"].prompt_style == "default"
    for name, short_first, long_last in (("Phi-3.5-mini-instruct", 1.0, 64.83999633789062),
                                         ("Phi-4-mini-instruct", 1.0, 47.77)):
        scaling = c[name].rope_scaling
        assert scaling["type"] == "longrope" and scaling["original_max_position_embeddings"] == 4096, name
        assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == 48, name
        assert (scaling["short_factor"][0], scaling["long_factor"][-1]) == (short_first, long_last), name
    assert c["Phi-3.5-mini-instruct"].prompt_style == "phi3" and c["Phi-3.5-mini-instruct"].rope_n_elem == 96
    phi4 = c["Phi-4-mini-instruct"]
    assert (phi4.rotary_percentage, phi4.rope_n_elem, phi4.tie_embeddings) == (0.75, 96, True)
    assert set(phi4.rope_scaling["short_factor"]) == {1.0}


def _nominal_size(name: str):
    """The parameter count a model's name announces ("8B", "1.1b", "135M", "8x7B"), or None."""
    match = re.search(r"(?:(\d+)x)?(\d+(?:\.\d+)?)([bBmM])(?![a-zA-Z])", name)
    if match is None:
        return None
    experts, size, unit = match.groups()
    return float(size) * (int(experts) if experts else 1) * (1e9 if unit in "bB" else 1e6)


def _skip_meta_init():
    """Parameters on the meta device need no initialization; skipping it makes the build several times faster."""
    patch = pytest.MonkeyPatch()
    patch.setattr(torch.nn.Linear, "reset_parameters", lambda self: None)
    patch.setattr(torch.nn.Embedding, "reset_parameters", lambda self: None)
    return patch


def _meta_param_count(config: Config) -> int:
    with torch.device("meta"):
        model = GPT(config)
    assert model.lm_head.weight.device.type == "meta"
    return sum(p.numel() for p in model.parameters())  # tied weights once


# Mixtures with thousands of expert modules take seconds to build even on the meta device: the fast tests build two
# of their layers and extrapolate (identical layers), the slow test below builds them whole.
MANY_EXPERTS = sorted(name for name, v in REGISTRY.items() if v.get("n_expert", 0) * v["n_layer"] > 2000)
# One of each parameter layout (the -Base and -2507 twins differ only in context length and rope base).
_LAYOUT = ("n_layer", "n_embd", "n_head", "n_query_groups", "n_expert", "moe_intermediate_size", "vocab_size",
           "tie_embeddings")
WHOLE_MIXTURES = sorted({tuple(REGISTRY[n].get(k) for k in _LAYOUT): n for n in reversed(MANY_EXPERTS)}.values())


@pytest.fixture(scope="module")
def meta_param_counts():
    """Every distinct architecture built once on the meta device: name -> parameter count."""
    patch = _skip_meta_init()
    counts, by_architecture = {}, {}
    try:
        for name, values in REGISTRY.items():
            config = Config(**values)
            key = repr({k: v for k, v in values.items() if k not in ("name", "hf_config", "prompt_style")})
            if key not in by_architecture:
                if name in MANY_EXPERTS:  # the dense first layers, then identical MoE layers
                    dense = config.moe_first_dense_layers
                    one, two = (_meta_param_count(Config(**{**values, "n_layer": dense + n})) for n in (1, 2))
                    by_architecture[key] = one + (config.n_layer - dense - 1) * (two - one)
                else:
                    by_architecture[key] = _meta_param_count(config)
            counts[name] = by_architecture[key]
    finally:
        patch.undo()
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("name", WHOLE_MIXTURES)
def test_large_mixtures_build_whole_on_meta(meta_param_counts, name):
    patch = _skip_meta_init()
    try:
        assert _meta_param_count(Config(**REGISTRY[name])) == meta_param_counts[name]
    finally:
        patch.undo()


def test_every_config_builds_on_meta_with_a_plausible_size(meta_param_counts):
    assert set(meta_param_counts) == set(REGISTRY)
    for name, count in meta_param_counts.items():
        # OLMo-2-0425-1B has 1.48B parameters: a published count, where there is one, wins over the name.
        nominal = PUBLISHED_PARAMS.get(name) or PUBLISHED_PARAMS.get(name.removesuffix("-Instruct")) or _nominal_size(name)
        if nominal is not None:
            # Names round loosely (gemma-2-2b has 2.6B parameters, Mixtral 8x7B shares its attention).
            assert 0.75 <= count / nominal <= 1.35, (name, count, nominal)


def test_every_litgpt_name_builds_on_meta(meta_param_counts):
    """Every model name LitGPT 0.5.13 registers (but those pending on other branches, tests/test_litgpt_names.py)
    resolves to a registered model, built on the meta device above."""
    from test_litgpt_names import RESOLVING

    assert all(meta_param_counts[Config.from_name(name).name] > 0 for name in RESOLVING)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_published_parameter_counts(meta_param_counts, name):
    assert meta_param_counts[name] == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


# The model card's active parameters per token (the input embedding left out, the output head counted).
GPT_OSS_ACTIVE = {"gpt-oss-20b": 3.61e9, "gpt-oss-120b": 5.13e9}


@pytest.mark.parametrize("name", sorted(GPT_OSS_ACTIVE))
def test_gpt_oss_published_fields_and_active_parameters(meta_param_counts, name):
    c = Config(**REGISTRY[name])
    assert (c.n_expert, c.n_expert_per_token, c.moe_intermediate_size) == ({"gpt-oss-20b": 32}.get(name, 128), 4, 2880)
    assert c.rope_scaling == dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                  beta_slow=1.0, truncate=False)
    assert (c.sliding_window_size, c.swiglu_limit, c.swiglu_alpha, c.router_aux_loss_coef) == (128, 7.0, 1.702, 0.9)
    assert c.attention_sinks and c.router_bias and c.bias and not c.lm_head_bias
    assert [c.is_sliding_layer(i) for i in range(4)] == [True, False, True, False]  # layer_types: sliding first
    per_expert = 3 * c.n_embd * c.moe_intermediate_size + 2 * c.moe_intermediate_size + c.n_embd  # with biases
    inactive = (c.n_expert - c.n_expert_per_token) * per_expert * c.n_layer
    active = meta_param_counts[name] - inactive - c.padded_vocab_size * c.n_embd
    assert active == pytest.approx(GPT_OSS_ACTIVE[name], rel=0.005)


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE_PARAMS))
def test_published_active_parameter_counts(meta_param_counts, name):
    """The total less the embedding and output matrices and the experts a token does not go through, the sizes of
    one expert and of the embeddings read from a model built on the meta device."""
    config = Config(**REGISTRY[name])
    patch = _skip_meta_init()
    try:
        with torch.device("meta"):
            model = GPT(Config(**{**REGISTRY[name], "n_layer": config.moe_first_dense_layers + 1}))
    finally:
        patch.undo()
    per_expert = sum(p.numel() for p in model.transformer.h[-1].mlp.experts[0].parameters())
    idle_experts = (config.n_expert - config.n_expert_per_token) * (config.n_layer - config.moe_first_dense_layers)
    embeddings = model.transformer.wte.weight.numel() + model.lm_head.weight.numel()
    active = meta_param_counts[name] - embeddings - idle_experts * per_expert
    assert active == pytest.approx(PUBLISHED_ACTIVE_PARAMS[name], rel=0.05)


def test_from_name_by_hub_id():
    config = Config.from_name("meta-llama/Llama-3.2-1B")
    assert config.name == "Llama-3.2-1B"
    assert config.n_layer == 16
    assert Config.from_name("TinyLlama/TinyLlama-1.1B-Chat-v1.0").name == "tiny-llama-1.1b-chat"
    assert Config.from_name("Qwen/Qwen3-0.6B", n_layer=2).n_layer == 2


def test_unknown_name_suggests_close_names():
    with pytest.raises(UserError, match=re.escape("'Llama-3.2-1B'")):
        Config.from_name("Llama-3.2-1b")
    with pytest.raises(UserError, match=re.escape("'Qwen3-0.6B'")):
        Config.from_name("qwen3-0.6b")


def test_older_family_specifics():
    """Falcon, StableLM, phi-1.5/2 and OLMo 1: the layout switches their config.json files (or classes) set."""
    c = {name: Config(**values) for name, values in REGISTRY.items()}
    falcon7, falcon40 = c["falcon-7b-instruct"], c["falcon-40b"]
    assert falcon7.parallel_residual and falcon7.shared_attention_norm and falcon7.n_query_groups == 1
    assert falcon40.parallel_residual and not falcon40.shared_attention_norm and not falcon40.bias
    assert falcon40.mlp_class_name == "GptNeoxMLP" and falcon40.rotary_percentage == 1.0
    assert falcon40.gelu_approximate == "none"
    assert c["falcon-180B-chat"].hf_config == {"org": "tiiuae", "name": "falcon-180B-chat"}

    stablelm = c["stablelm-zephyr-3b"]
    assert stablelm.hf_model_type == "stablelm"
    assert (stablelm.mlp_class_name, stablelm.norm_class_name) == ("LLaMAMLP", "LayerNorm")
    assert stablelm.rotary_percentage == 0.25 and not stablelm.parallel_residual and not stablelm.attn_bias
    assert c["stablelm-tuned-alpha-3b"].hf_model_type == "gpt_neox" and c["stablelm-tuned-alpha-3b"].parallel_residual
    assert c["stablecode-instruct-alpha-3b"].hf_model_type == "gpt_neox"

    phi2 = c["phi-2"]
    assert phi2.rotary_percentage == 0.4 and c["phi-1_5"].rotary_percentage == 0.5
    assert phi2.bias and phi2.lm_head_bias and phi2.shared_attention_norm and phi2.gelu_approximate == "tanh"

    olmo = c["OLMo-7B-Instruct-hf"]
    assert not olmo.norm_affine and olmo.clip_qkv is None and olmo.mlp_class_name == "LLaMAMLP" and not olmo.bias
    assert olmo.hf_config == {"org": "allenai", "name": "OLMo-7B-Instruct-hf"}

"""Microsoft Phi-3 and Phi-4 (Hugging Face `phi3` architecture): https://huggingface.co/microsoft."""

from litgpt.configs import variants

# LongRoPE factors of the published config.json files, one per rotated frequency: the short ones up to the original
# context of 4096 tokens, the long ones past it (to 131072).
_PHI35_SHORT = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
    1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
    2.749999523162842, 2.8399994373321533,
]
_PHI35_LONG = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
    1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
    4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
    17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
    50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
    62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
    63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
    64.51000213623047, 64.52999877929688, 64.83999633789062,
]
_PHI4_MINI_LONG = [
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]


def _longrope(short: list, long: list) -> dict:
    return dict(type="longrope", short_factor=short, long_factor=long, original_max_position_embeddings=4096)


_14B = dict(n_layer=40, n_embd=5120, n_head=40, n_query_groups=10, intermediate_size=17920)

CONFIGS = variants(
    "microsoft",
    dict(
        hf_model_type="phi3",
        norm_class_name="RMSNorm",
        norm_eps=1e-5,
        mlp_class_name="LLaMAMLP",
        tie_embeddings=False,
        rope_base=10000.0,
        block_size=4096,
        vocab_size=32064,
        padded_vocab_size=32064,
        sliding_window_size=2047,
        prompt_style="phi3",
    ),
    dict(name="Phi-3-mini-4k-instruct", n_layer=32, n_embd=3072, n_head=32, intermediate_size=8192),
    dict(name="Phi-3-medium-4k-instruct", **_14B),
    # Phi-4 formats chats as <|im_start|>role<|im_sep|>...<|im_end|>: ChatML with <|im_sep|> after the role.
    dict(name="phi-4", **_14B, rope_base=250000.0, block_size=16384, vocab_size=100352, padded_vocab_size=100352,
         sliding_window_size=None, prompt_style="chatml"),
    # Phi-3.5-mini: Phi-3-mini with LongRoPE to 128k tokens (its window, 262144, exceeds the context).
    dict(name="Phi-3.5-mini-instruct", n_layer=32, n_embd=3072, n_head=32, intermediate_size=8192, block_size=131072,
         sliding_window_size=262144, rope_scaling=_longrope(_PHI35_SHORT, _PHI35_LONG)),
    # Phi-4-mini: grouped-query attention, 3/4 of each head rotated, tied embeddings, a 200k vocabulary. Its chat
    # template has no newline after the role tags; phi3 is the nearest prompt style.
    dict(name="Phi-4-mini-instruct", n_layer=32, n_embd=3072, n_head=24, n_query_groups=8, intermediate_size=8192,
         block_size=131072, vocab_size=200064, padded_vocab_size=200064, rotary_percentage=0.75,
         tie_embeddings=True, sliding_window_size=262144, rope_scaling=_longrope([1.0] * 48, _PHI4_MINI_LONG)),
)
_PHI4_MINI = next(c for c in CONFIGS if c["name"] == "Phi-4-mini-instruct")
_PHI4 = next(c for c in CONFIGS if c["name"] == "phi-4")
CONFIGS += [
    # Phi-4-mini-reasoning: Phi-4-mini-instruct's architecture, LongRoPE factors included.
    {**_PHI4_MINI, "name": "Phi-4-mini-reasoning", "hf_config": {"org": "microsoft", "name": "Phi-4-mini-reasoning"}},
    # Phi-4-reasoning(-plus): phi-4 with rope_theta 500000 and a context of 32768.
    *({**_PHI4, "name": name, "hf_config": {"org": "microsoft", "name": name}, "rope_base": 500000.0,
       "block_size": 32768} for name in ("Phi-4-reasoning", "Phi-4-reasoning-plus")),
]

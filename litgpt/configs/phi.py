"""Microsoft Phi-3 and Phi-4 (Hugging Face `phi3` architecture): https://huggingface.co/microsoft."""

from litgpt.configs import variants

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
)

"""Allen AI OLMo 2 (Hugging Face `olmo2` architecture): https://huggingface.co/allenai.

No norm before attention or the MLP; RMSNorm on their outputs before the residual add, and on the whole query and key
projections (all heads together).
"""

from litgpt.configs import tuned, variants

OLMO2 = variants(
    "allenai",
    dict(
        hf_model_type="olmo2",
        norm_class_name="RMSNorm",
        norm_eps=1e-6,
        norm_1=False,
        norm_2=False,
        post_attention_norm=True,
        post_mlp_norm=True,
        norm_qk=True,
        norm_qk_type="olmo2",
        mlp_class_name="LLaMAMLP",
        tie_embeddings=False,
        rope_base=500000.0,
        block_size=4096,
        vocab_size=100352,
        padded_vocab_size=100352,
    ),
    dict(name="OLMo-2-0425-1B", n_layer=16, n_embd=2048, n_head=16, intermediate_size=8192),
    dict(name="OLMo-2-1124-7B", n_layer=32, n_embd=4096, n_head=32, intermediate_size=11008),
    dict(name="OLMo-2-1124-13B", n_layer=40, n_embd=5120, n_head=40, intermediate_size=13824),
    dict(name="OLMo-2-0325-32B", n_layer=64, n_embd=5120, n_head=40, n_query_groups=8, intermediate_size=27648),
)

# The tuned models' chat template (Tulu's <|user|>\n...\n<|assistant|>\n) is none of litgpt's prompt styles yet.
# LitGPT 0.5.13 registers the -SFT and -DPO stages of the 7B and 13B models too.
_1124 = [c for c in OLMO2 if "-1124-" in c["name"]]
CONFIGS = [*OLMO2, *tuned(OLMO2, "-Instruct", "default"), *tuned(_1124, "-SFT", "default"),
           *tuned(_1124, "-DPO", "default")]

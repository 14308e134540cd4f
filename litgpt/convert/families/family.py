"""What a family is: the `Config` values its Hugging Face class hard-codes, built on the values every family shares,
and the reading of activation names that every family's config.json needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litgpt.errors import UserError

# The Config values of a Llama-style model, which every family shares unless it says otherwise.
LLAMA_STYLE_DEFAULTS = dict(
    norm_class_name="RMSNorm",
    mlp_class_name="LLaMAMLP",
    parallel_residual=False,
    shared_attention_norm=False,
    bias=False,
    attn_bias=False,
    lm_head_bias=False,
    norm_unit_offset=False,
    norm_qk=False,
    post_attention_norm=False,
    post_mlp_norm=False,
    scale_embeddings=False,
    attention_logit_softcapping=None,
    final_logit_softcapping=None,
    attention_scores_scalar=None,
    rope_local_base=None,
    n_expert=0,
    n_expert_per_token=0,
    norm_affine=True,
    clip_qkv=None,
    norm_qk_per_head=False,
    attention_sinks=False,
    router_bias=False,
    swiglu_alpha=None,
    swiglu_limit=None,
    norm_1=True,
    norm_2=True,
    norm_qk_type="default",
    no_rope_layers=None,
)


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    fixed: dict  # Config values the Hugging Face class hard-codes
    sliding: bool = False  # whether config.json may carry a sliding window
    fused_qkv: bool = False  # Phi-3 keeps q/k/v in one matrix, laid out as litgpt's
    fused_gate_up: bool = False  # Phi-3 keeps gate and up projections in one matrix
    head_dim_key: bool = True  # config.json has `head_dim`
    default_tie: bool = False
    latent: bool = False  # multi-head latent attention (DeepSeek): see `deepseek`


def define_family(model_type: str, architecture: str, free: tuple[str, ...] = (), **kwargs: Any) -> Family:
    """`fixed` overrides the shared values; `free` names shared fields that config.json sets for this family."""
    fixed = {**LLAMA_STYLE_DEFAULTS, **kwargs.pop("fixed", {})}
    return Family(model_type, architecture, {k: v for k, v in fixed.items() if k not in free}, **kwargs)


def gelu_approximate(activation: str, where: str) -> str:
    """`Config.gelu_approximate` for config.json's activation name."""
    approximations = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh"}
    if activation not in approximations:
        raise UserError(f"{where}: activation {activation!r} is not supported.")
    return approximations[activation]

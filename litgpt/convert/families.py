"""What each Hugging Face architecture is, in litgpt's terms: its config fields and one weight-name map.

The same map is read in both directions (Hugging Face -> litgpt and back), so the two converters cannot drift apart.
A family is a set of `Config` values that its Hugging Face class hard-codes; everything else is read from, and written
to, `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from litgpt.config import Config
from litgpt.errors import UserError

# Values every family shares unless it says otherwise.
_PLAIN = dict(
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
    latent: bool = False  # multi-head latent attention (DeepSeek): see the DeepSeek section below


def _family(model_type: str, architecture: str, free: tuple[str, ...] = (), **kwargs: Any) -> Family:
    """`fixed` overrides the shared values; `free` names shared fields that config.json sets for this family."""
    fixed = {**_PLAIN, **kwargs.pop("fixed", {})}
    return Family(model_type, architecture, {k: v for k, v in fixed.items() if k not in free}, **kwargs)


_MOE_FREE = ("n_expert", "n_expert_per_token")
_GEMMA_FREE = ("attention_logit_softcapping", "final_logit_softcapping", "attention_scores_scalar")


# OLMo 2 and 3: no norm before attention or the MLP, norms on their outputs, q/k norms over the whole projections.
_OLMO = dict(norm_1=False, norm_2=False, post_attention_norm=True, post_mlp_norm=True, norm_qk=True, norm_qk_type="olmo2")

# DeepSeek-V3's routing ("noaux_tc"), which GLM-4.5 shares: sigmoid scores, a correction bias, groups by top-2 sum.
_NOAUX_TC = dict(moe_score_function="sigmoid", moe_expert_bias=True, moe_group_score="top2_sum")
_GEMMA = dict(norm_unit_offset=True, scale_embeddings=True, mlp_class_name="GemmaMLP", gelu_approximate="tanh")

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        _family("llama", "LlamaForCausalLM"),
        _family("mistral", "MistralForCausalLM", sliding=True),
        _family("qwen2", "Qwen2ForCausalLM", sliding=True, fixed=dict(attn_bias=True)),
        _family("qwen3", "Qwen3ForCausalLM", sliding=True, fixed=dict(norm_qk=True)),
        _family("mixtral", "MixtralForCausalLM", sliding=True, free=_MOE_FREE, fixed=dict(mlp_class_name="LLaMAMoE", moe_renormalize=True)),
        _family("qwen3_moe", "Qwen3MoeForCausalLM", sliding=True, free=_MOE_FREE, fixed=dict(mlp_class_name="LLaMAMoE", norm_qk=True)),
        _family("phi3", "Phi3ForCausalLM", sliding=True, fused_qkv=True, fused_gate_up=True, head_dim_key=False),
        _family("gemma", "GemmaForCausalLM", default_tie=True, free=_GEMMA_FREE, fixed=_GEMMA),
        _family(
            "gemma2",
            "Gemma2ForCausalLM",
            sliding=True,
            free=_GEMMA_FREE,
            default_tie=True,
            fixed=dict(_GEMMA, post_attention_norm=True, post_mlp_norm=True),
        ),
        _family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            sliding=True,
            free=_GEMMA_FREE + ("rope_local_base",),
            default_tie=True,
            fixed=dict(_GEMMA, post_attention_norm=True, post_mlp_norm=True, norm_qk=True),
        ),
        _family(
            "glm4_moe",
            "Glm4MoeForCausalLM",
            free=_MOE_FREE + ("attn_bias", "norm_qk"),
            fixed=dict(mlp_class_name="LLaMAMoE", **_NOAUX_TC),
        ),
        _family(
            "gpt_neox",
            "GPTNeoXForCausalLM",
            head_dim_key=False,
            free=("parallel_residual",),
            fixed=dict(norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", bias=True),
        ),
        # gpt-oss: biases on attention and experts, attention sinks, a biased router, clamped SwiGLU experts.
        _family(
            "gpt_oss",
            "GptOssForCausalLM",
            sliding=True,
            free=_MOE_FREE + ("swiglu_alpha", "swiglu_limit"),
            fixed=dict(
                mlp_class_name="LLaMAMoE", moe_renormalize=True, bias=True, attention_sinks=True, router_bias=True
            ),
        ),
        _family("olmo2", "Olmo2ForCausalLM", head_dim_key=False, fixed=_OLMO),
        _family("olmo3", "Olmo3ForCausalLM", sliding=True, head_dim_key=False, free=("rope_local_base",), fixed=_OLMO),
        _family("smollm3", "SmolLM3ForCausalLM", head_dim_key=False, default_tie=True, free=("no_rope_layers",)),
        # config.json's head_dim is the rotary size (transformers sets it so); head_size is derived from the MLA sizes.
        _family("deepseek_v3", "DeepseekV3ForCausalLM", head_dim_key=False, latent=True, free=_MOE_FREE,
                fixed=dict(mlp_class_name="LLaMAMoE", **_NOAUX_TC)),
        # DeepSeek-V2's router: softmax scores, no correction bias; config.json's topk_method picks the group score.
        _family("deepseek_v2", "DeepseekV2ForCausalLM", head_dim_key=False, latent=True, free=_MOE_FREE,
                fixed=dict(mlp_class_name="LLaMAMoE", moe_score_function="softmax", moe_expert_bias=False,
                           rope_interleaved=True)),
    ]
}
# Other model types whose config.json describes one of the families above (Kimi K2 ships DeepSeek-V3's classes).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def family_of(model_type: str, where: str, architectures: Optional[list] = None) -> Family:
    """The family of `model_type`; with config.json's `architectures`, also refuses a known model_type whose class
    is not a causal LM (a classifier's or an encoder's weights are no language model's)."""
    model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
    supported = f"Supported model_type values: {', '.join(sorted(FAMILIES))} (causal LMs)."
    named = f"{architectures[0]} (model_type {model_type!r})" if architectures else f"model_type {model_type!r}"
    if model_type not in FAMILIES:
        raise UserError(f"{where} describes {named}, which litgpt does not support. {supported}")
    if architectures and not any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise UserError(f"{where} describes {named}, not a causal language model, which litgpt does not convert. "
                        f"{supported}")
    return FAMILIES[model_type]


# ---- config.json -> Config -------------------------------------------------------------------------------------------
# What transformers' Gemma3TextConfig assumes for the fields that Gemma 3's published text_config leaves out.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262208, num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6, tie_word_embeddings=True,
)
# Multimodal checkpoints whose language model litgpt converts: model_type -> (text family, weight prefixes).
MULTIMODAL = {"gemma3": "gemma3_text"}
# What transformers' config classes assume for fields that config.json may leave out, per family.
HF_DEFAULTS = {"glm4_moe": dict(partial_rotary_factor=0.5)}


def config_from_hf(hf: dict, where: str = "config.json") -> Config:
    """Derive a litgpt Config from a Hugging Face config.json (the 4.x and the 5.x `rope_parameters` layouts)."""
    model_type = hf.get("model_type")
    if model_type in MULTIMODAL and "text_config" in hf:
        # Gemma 3 4B and larger ship as image-text models: their language model is a Gemma 3 text model.
        text = {**GEMMA3_TEXT_DEFAULTS, **hf["text_config"], "model_type": MULTIMODAL[model_type]}
        if "tie_word_embeddings" in hf:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        return config_from_hf(text, f"{where} (text_config)")
    if model_type is None and "text_config" in hf:
        raise UserError(f"{where} describes a multimodal model; litgpt converts text-only causal LMs.")
    architectures = hf.get("architectures")
    family = family_of(model_type, where, architectures if isinstance(architectures, list) else None)
    hf = {**HF_DEFAULTS.get(model_type, {}), **hf}
    if model_type == "falcon":
        hf = _falcon_as_standard(hf, where)
    try:
        return _config_from_hf(hf, family, where)
    except KeyError as error:
        raise UserError(f"{where} lacks the field {error.args[0]!r} that a {model_type} config needs.") from None


def _config_from_hf(hf: dict, family: Family, where: str) -> Config:
    values: dict[str, Any] = dict(family.fixed)
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    values.update(
        hf_model_type=family.model_type,
        n_embd=n_embd,
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_query_groups=hf.get("num_key_value_heads") or n_head,
        head_size=(hf.get("head_dim") if family.head_dim_key else None) or n_embd // n_head,
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        padded_vocab_size=hf["vocab_size"],
        block_size=hf.get("max_position_embeddings", 4096),
        tie_embeddings=hf.get("tie_word_embeddings", family.default_tie),
    )
    if family.model_type == "gpt_neox":
        values.update(
            norm_eps=hf.get("layer_norm_eps", 1e-5),
            parallel_residual=hf.get("use_parallel_residual", True),
            gelu_approximate=_gelu_approximate(hf.get("hidden_act", "gelu"), where),
        )
        if not hf.get("attention_bias", True):
            raise UserError(f"{where}: GPT-NeoX without attention biases is not supported.")
    elif family.model_type in LEGACY_FAMILIES:
        values.update(_legacy_from_hf(hf, family, where))
    else:
        values["norm_eps"] = hf.get("rms_norm_eps", 1e-6)
        activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
        if values["mlp_class_name"] == "GemmaMLP":
            values["gelu_approximate"] = _gelu_approximate(activation, where)
        elif activation != "silu":
            raise UserError(f"{where}: activation {activation!r} is not supported for {family.model_type}.")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag) and not (family.model_type == "gpt_oss" or flag == "attention_bias" and family.model_type in ("qwen2", "glm4_moe")):
                raise UserError(f"{where}: {flag}=true is not supported for {family.model_type}.")
    if family.model_type == "glm4_moe":
        values.update(attn_bias=bool(hf.get("attention_bias", False)), norm_qk=bool(hf.get("use_qk_norm", False)))

    if family.model_type.startswith("gemma"):
        values["attention_scores_scalar"] = hf.get("query_pre_attn_scalar") or values["head_size"]
        values["attention_logit_softcapping"] = hf.get("attn_logit_softcapping")
        values["final_logit_softcapping"] = hf.get("final_logit_softcapping")
    if family.model_type == "gpt_oss":
        hf = _gpt_oss_hf(hf, where)
        values.update(
            n_expert=hf["num_local_experts"],
            moe_intermediate_size=hf["intermediate_size"],
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        )
    elif family.model_type in DEEPSEEK_MOE_FAMILIES:
        values.update(deepseek_moe_from_hf(hf, DEEPSEEK_MOE_FAMILIES[family.model_type], where))
    elif values["mlp_class_name"] == "LLaMAMoE":
        if family.model_type == "mixtral":
            values.update(n_expert=hf["num_local_experts"], moe_intermediate_size=hf["intermediate_size"])
        else:
            if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
                raise UserError(f"{where}: Qwen3-MoE with dense layers (decoder_sparse_step/mlp_only_layers) is not supported.")
            values.update(
                n_expert=hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                moe_renormalize=bool(hf.get("norm_topk_prob", False)),
            )
    if values["mlp_class_name"] == "LLaMAMoE" and family.model_type not in DEEPSEEK_MOE_FAMILIES:
        values["n_expert_per_token"] = hf["num_experts_per_tok"]
        # transformers' default for these families when config.json has none
        values["router_aux_loss_coef"] = hf.get("router_aux_loss_coef", 0.001)

    if family.model_type == "smollm3":
        interval = hf.get("no_rope_layer_interval", 4)  # transformers' SmolLM3Config default
        values["no_rope_layers"] = hf.get("no_rope_layers") or [
            int((i + 1) % interval != 0) for i in range(values["n_layer"])
        ]
    if family.latent:
        values.update(_latent_from_hf(hf, family, where))
    values.update(_rope_from_hf(hf, family, where))
    values.update(_sliding_from_hf(hf, family, values["n_layer"], where))
    return Config(**values)


# What transformers' GptOssConfig assumes when config.json leaves the rotary settings out.
GPT_OSS_ROPE_DEFAULTS = dict(
    rope_theta=150000.0,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096},
)


def _gpt_oss_hf(hf: dict, where: str) -> dict:
    """A gpt-oss config.json with transformers' defaults filled in, after checking that the fields the published
    configs state twice agree and that it has the biases and layout litgpt's gpt-oss layers have."""
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        hf = {**GPT_OSS_ROPE_DEFAULTS, **hf}
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    both = [("num_experts_per_tok", hf, "experts_per_token"), ("num_local_experts", hf, "num_experts"),
            ("original_max_position_embeddings", params, "initial_context_length")]
    clashes = [f"{a}={ours[a]} but {b}={hf[b]}" for a, ours, b in both if a in ours and b in hf and ours[a] != hf[b]]
    if clashes:
        raise UserError(f"{where} contradicts itself: {'; '.join(clashes)}.")
    if "num_local_experts" not in hf and "num_experts" in hf:
        hf = {**hf, "num_local_experts": hf["num_experts"]}
    if not hf.get("attention_bias", True):
        raise UserError(f"{where}: gpt_oss with attention_bias=false is not supported (litgpt's gpt-oss layers "
                        "have biases on attention and experts alike).")
    if (hf.get("quantization_config") or {}).get("quant_method", "mxfp4") != "mxfp4":
        method = hf["quantization_config"]["quant_method"]
        raise UserError(f"{where}: gpt_oss weights quantized with {method!r}; litgpt reads bf16/fp32 or MXFP4 experts.")
    return hf


def _gelu_approximate(activation: str, where: str) -> str:
    approximations = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh"}
    if activation not in approximations:
        raise UserError(f"{where}: activation {activation!r} is not supported.")
    return approximations[activation]


def _rope_from_hf(hf: dict, family: Family, where: str) -> dict:
    """rotary_percentage, rope_base, rope_scaling and rope_local_base from either config layout."""
    params = hf.get("rope_parameters")
    local = None
    if isinstance(params, dict) and "full_attention" in params:  # 5.x, one dict per layer type
        local = params.get("sliding_attention")
        params = params["full_attention"]
    if params is None:  # 4.x layout
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", 1.0)))
    out: dict[str, Any] = dict(
        rope_base=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rotary_percentage=float(partial),
        rope_scaling=_scaling_from_hf(params, hf, where),
    )
    if family.model_type == "gemma3_text":
        if local is not None:
            if _scaling_from_hf(local, hf, where) is not None:
                raise UserError(f"{where}: rope scaling on sliding-window layers is not supported.")
            out["rope_local_base"] = float(local["rope_theta"])
        else:
            out["rope_local_base"] = float(hf.get("rope_local_base_freq", 10000.0))
    if family.model_type == "olmo3":
        out["rope_local_base"] = _olmo3_local_base(local, out, hf, where)
    return out


def _olmo3_local_base(local: Optional[dict], out: dict, hf: dict, where: str) -> Optional[float]:
    """OLMo 3 scales only its full-attention layers' rotary frequencies (the 4.x `rope_scaling`, or 5.x's per layer
    type): its sliding layers then get their own unscaled table, litgpt's rope_local_base."""
    local_scaling = None if local is None else _scaling_from_hf(local, hf, where)
    if local_scaling is not None:
        if local_scaling == out["rope_scaling"] and float(local["rope_theta"]) == out["rope_base"]:
            return None  # one table for every layer
        raise UserError(f"{where}: rope scaling on sliding-window layers other than the full layers' is not supported.")
    theta = float(local["rope_theta"]) if local is not None and "rope_theta" in local else out["rope_base"]
    return theta if out["rope_scaling"] is not None or theta != out["rope_base"] else None


def _scaling_from_hf(params: dict, hf: dict, where: str) -> Optional[dict]:
    kind = params.get("rope_type", params.get("type", "default"))
    if hf.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # what transformers' Phi3Config reads these older names as
    if kind == "default":
        return None
    if kind == "longrope":
        return _longrope_from_hf(params, hf)
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    if kind == "llama3":
        return {
            "type": "llama3",
            "factor": float(factor),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(original),
        }
    if kind == "yarn":
        original = original or hf.get("max_position_embeddings")
        if factor is None:
            factor = hf["max_position_embeddings"] / original
        scaling = {"type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"):
            if params.get(key) is not None:
                scaling[key] = params[key]
        return scaling
    raise UserError(
        f"{where}: rope scaling type {kind!r} is not supported (litgpt supports linear, llama3, yarn, longrope)."
    )


def _longrope_from_hf(params: dict, hf: dict) -> dict:
    # transformers takes original_max_position_embeddings from the top level of the config first (Phi-3 keeps it
    # there, and Phi3Config defaults it to 4096), then from the rope parameters, then max_position_embeddings.
    default = 4096 if hf.get("model_type") == "phi3" else None
    original = hf.get("original_max_position_embeddings", default)
    original = original or params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    scaling = {
        "type": "longrope",
        "short_factor": [float(f) for f in params["short_factor"]],
        "long_factor": [float(f) for f in params["long_factor"]],
        "original_max_position_embeddings": int(original),
    }
    for key in ("factor", "attention_factor"):
        if params.get(key) is not None:
            scaling[key] = float(params[key])
    return scaling


def _sliding_from_hf(hf: dict, family: Family, n_layer: int, where: str) -> dict:
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if family.model_type == "smollm3" and not hf.get("use_sliding_window"):
        types = None  # transformers' SmolLM3 ignores layer_types then
    if family.model_type == "olmo3" and types is None:  # Olmo3Config's defaults
        window = hf.get("sliding_window", 4096)
        types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layer)]
    if types is None:
        if window is None or not family.sliding or hf.get("use_sliding_window") is False:
            return dict(sliding_window_size=None, sliding_window_pattern=1)
        if family.model_type in ("gemma2", "gpt_oss"):
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
        elif family.model_type == "gemma3_text":
            every = hf.get("sliding_window_pattern", 6)
            types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layer)]
        elif family.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            raise UserError(f"{where}: use_sliding_window without layer_types is not supported.")
        else:
            return dict(sliding_window_size=window, sliding_window_pattern=1)
    sliding = [t == "sliding_attention" for t in types]
    if len(sliding) != n_layer or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise UserError(f"{where}: layer_types must list 'sliding_attention'/'full_attention' for each layer.")
    if not any(sliding):
        return dict(sliding_window_size=None, sliding_window_pattern=1)
    if window is None or not family.sliding:
        raise UserError(f"{where}: sliding-window layers without a supported sliding_window.")
    for pattern in range(1, n_layer + 2):
        if all(((i + 1) % pattern != 0 or pattern == 1) == sliding[i] for i in range(n_layer)):
            return dict(sliding_window_size=window, sliding_window_pattern=pattern)
    raise UserError(f"{where}: this arrangement of sliding-window layers ({types}) is not supported.")


# ---- Config -> config.json -------------------------------------------------------------------------------------------
def config_to_hf(config: Config, extra: Optional[dict] = None) -> dict:
    """The config.json a Hugging Face `from_pretrained` reads for this Config (4.x layout, read by 5.x too)."""
    family = family_of(config.hf_model_type, "The model config")
    _check_writable(config, family)
    c = config
    hf: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": c.n_embd,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_query_groups,
        "vocab_size": c.padded_vocab_size,
        "max_position_embeddings": c.block_size,
        "tie_word_embeddings": c.tie_embeddings,
        "rope_theta": c.rope_base,
    }
    if family.head_dim_key:
        hf["head_dim"] = c.head_size
    elif c.head_size != c.n_embd // c.n_head and not family.latent:
        raise UserError(f"Hugging Face {family.model_type!r} requires head_size == n_embd // n_head.")
    if c.rope_scaling is not None:
        scaling = dict(c.rope_scaling)
        hf["rope_scaling"] = {"rope_type": scaling.pop("type"), **scaling}
        if c.rope_scaling["type"] == "longrope":  # where Phi3Config reads it (its own default otherwise: 4096)
            hf["original_max_position_embeddings"] = c.rope_scaling["original_max_position_embeddings"]
    if c.rotary_percentage != 1.0:
        hf["partial_rotary_factor"] = c.rotary_percentage
    if family.model_type == "gpt_neox":
        del hf["num_key_value_heads"]
        if c.n_query_groups != c.n_head:
            raise UserError("Hugging Face 'gpt_neox' has no grouped-query attention (n_query_groups must equal n_head).")
        hf.update(
            layer_norm_eps=c.norm_eps,
            use_parallel_residual=c.parallel_residual,
            hidden_act="gelu" if c.gelu_approximate == "none" else "gelu_new",
            rotary_pct=c.rotary_percentage,
            rotary_emb_base=c.rope_base,
            attention_bias=True,
        )
    elif family.model_type in LEGACY_FAMILIES:
        hf = _legacy_to_hf(c, family, hf)
    else:
        hf["rms_norm_eps"] = c.norm_eps
        if c.mlp_class_name == "GemmaMLP":
            hf["hidden_activation"] = hf["hidden_act"] = "gelu_pytorch_tanh"
        else:
            hf["hidden_act"] = "silu"
    if family.model_type.startswith("gemma"):
        hf.update(
            query_pre_attn_scalar=c.attention_scores_scalar,
            attn_logit_softcapping=c.attention_logit_softcapping,
            final_logit_softcapping=c.final_logit_softcapping,
        )
    if family.model_type == "gemma3_text":
        hf["rope_local_base_freq"] = c.rope_local_base
    if family.model_type == "olmo3":  # transformers 5's layout, one rotary table per layer type
        del hf["rope_theta"]
        hf.pop("rope_scaling", None)
        hf["rope_parameters"] = _olmo3_rope_parameters(c)
    if family.model_type == "smollm3":
        hf.update(no_rope_layers=list(c.no_rope_layers or [1] * c.n_layer), use_sliding_window=False)
    hf.update(_moe_to_hf(c, family))
    if family.model_type == "glm4_moe":
        # num_nextn_predict_layers: the multi-token prediction layer is not converted (deepseek_moe_from_hf).
        hf.update(attention_bias=c.attn_bias, use_qk_norm=c.norm_qk, partial_rotary_factor=c.rotary_percentage,
                  num_nextn_predict_layers=0)
    if family.latent:
        hf.update(_latent_to_hf(c, family))
    hf.update(_sliding_to_hf(c, family))
    hf.update(extra or {})
    return hf


def _check_writable(c: Config, family: Family) -> None:
    """One line when `c` has values that the Hugging Face class of its family hard-codes otherwise."""
    mismatched = {k: (getattr(c, k), v) for k, v in family.fixed.items() if getattr(c, k) != v}
    if mismatched:
        details = ", ".join(f"{k}={ours!r} (needs {theirs!r})" for k, (ours, theirs) in mismatched.items())
        raise UserError(
            f"This model cannot be written as Hugging Face {family.model_type!r}: {details}. "
            "Set hf_model_type in model_config.yaml to the family these weights match."
        )
    if (c.kv_lora_rank is not None) != family.latent:
        kind = "has" if family.latent else "has no"
        raise UserError(f"Hugging Face {family.model_type!r} {kind} latent attention; this model's kv_lora_rank is "
                        f"{c.kv_lora_rank}. Set hf_model_type in model_config.yaml to the family these weights match.")


def _moe_to_hf(c: Config, family: Family) -> dict:
    """The mixture-of-experts keys of config.json, each family in its own spelling (none for a dense model)."""
    hf: dict[str, Any] = {}
    if c.mlp_class_name == "LLaMAMoE":
        hf["router_aux_loss_coef"] = c.router_aux_loss_coef
    if family.model_type in DEEPSEEK_MOE_FAMILIES:
        hf.update(deepseek_moe_to_hf(c, method_keys=DEEPSEEK_MOE_FAMILIES[family.model_type] is None))
    if family.model_type == "mixtral":
        hf.update(num_local_experts=c.n_expert, num_experts_per_tok=c.n_expert_per_token)
        hf["intermediate_size"] = c.moe_intermediate_size
        if not c.moe_renormalize:
            raise UserError("Hugging Face 'mixtral' always renormalizes the router weights (moe_renormalize).")
    if family.model_type == "qwen3_moe":
        hf.update(
            num_experts=c.n_expert,
            num_experts_per_tok=c.n_expert_per_token,
            moe_intermediate_size=c.moe_intermediate_size,
            norm_topk_prob=c.moe_renormalize,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if family.model_type == "gpt_oss":
        hf.update(
            num_local_experts=c.n_expert,
            num_experts_per_tok=c.n_expert_per_token,
            intermediate_size=c.moe_intermediate_size,
            attention_bias=True,
            swiglu_alpha=c.swiglu_alpha,
            swiglu_limit=c.swiglu_limit,
        )
    return hf


def _olmo3_rope_parameters(c: Config) -> dict:
    """The full-attention layers' (scaled) rotary table; the sliding layers' unscaled one of rope_local_base, or the
    same table when rope_local_base is None (litgpt then rotates every layer alike)."""
    full = {"rope_type": "default", "rope_theta": c.rope_base}
    if c.rope_scaling is not None:
        scaling = dict(c.rope_scaling)
        full.update(rope_type=scaling.pop("type"), **scaling)
    local = full if c.rope_local_base is None else {"rope_type": "default", "rope_theta": c.rope_local_base}
    return {"full_attention": full, "sliding_attention": local}


def _sliding_to_hf(c: Config, family: Family) -> dict:
    if c.sliding_window_size is None and family.model_type == "gpt_oss":  # its default alternates windows
        return {"sliding_window": None, "layer_types": ["full_attention"] * c.n_layer}
    if c.sliding_window_size is None and family.model_type == "olmo3":
        # Every layer full (Olmo3Config slides 3 layers of 4 by default); its model builds a sliding mask anyway and
        # needs a window for it, which no layer then uses.
        return {"sliding_window": c.block_size, "layer_types": ["full_attention"] * c.n_layer}
    if c.sliding_window_size is None:
        return {"sliding_window": None, "use_sliding_window": False} if family.sliding else {}
    if not family.sliding:
        raise UserError(f"Hugging Face {family.model_type!r} has no sliding-window attention.")
    if family.model_type in ("mistral", "mixtral", "phi3"):
        # These slide in every layer; transformers reads `layer_types` on a Mistral config as another model.
        if c.sliding_window_pattern != 1:
            raise UserError(f"Hugging Face {family.model_type!r} slides the window in every layer (sliding_window_pattern 1).")
        return {"sliding_window": c.sliding_window_size}
    types = ["sliding_attention" if c.is_sliding_layer(i) else "full_attention" for i in range(c.n_layer)]
    out = {"sliding_window": c.sliding_window_size, "layer_types": types}
    if family.model_type.startswith("qwen"):
        out.update(use_sliding_window=True, max_window_layers=0)
    if family.model_type == "gemma3_text":
        out["sliding_window_pattern"] = c.sliding_window_pattern
    return out


# ---- the weight-name map -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """litgpt tensors `lit` <-> Hugging Face tensors `hf`.

    kind "copy": one to one. "cat": the single tensor on one side is the others concatenated along dim 0 (sizes give
    the split). "neox_qkv": GPT-NeoX interleaves q, k, v per head; litgpt stacks all q heads, then k, then v.
    "falcon_qkv": Falcon lays out each KV group as its q heads, then its k and v head (with one group per head this
    is GPT-NeoX's layout, with one group for all heads litgpt's).
    "experts": one Hugging Face tensor stacks the experts' (transformers keeps a weight as (in, out), litgpt as
    (out, in)). "experts_gate_up": the same with gate and up interleaved along the output dimension (gpt-oss), litgpt
    listing fc_1, fc_2 expert by expert.
    """

    lit: tuple[str, ...]
    hf: tuple[str, ...]
    kind: str = "copy"
    sizes: tuple[int, ...] = field(default=())

    def to_lit(self, tensors: list[torch.Tensor], config: Config) -> list[torch.Tensor]:
        if self.kind == "copy":
            return tensors
        if self.kind == "experts":
            return [_out_first(t) for t in tensors[0].unbind(0)]
        if self.kind == "experts_gate_up":
            return [_out_first(t)[part::2].contiguous() for t in tensors[0].unbind(0) for part in (0, 1)]
        if self.kind == "neox_qkv":
            return [_neox_to_stacked(tensors[0], config)]
        if self.kind == "falcon_qkv":
            return [_falcon_to_stacked(tensors[0], config)]
        if len(self.hf) > 1:
            return [torch.cat(tensors, dim=0)]
        return list(torch.split(tensors[0], self.sizes, dim=0))

    def to_hf(self, tensors: list[torch.Tensor], config: Config) -> list[torch.Tensor]:
        if self.kind == "copy":
            return tensors
        if self.kind == "experts":
            return [torch.stack([_out_first(t) for t in tensors])]
        if self.kind == "experts_gate_up":
            pairs = [torch.stack(tensors[i : i + 2], dim=1).flatten(0, 1) for i in range(0, len(tensors), 2)]
            return [torch.stack([_out_first(t) for t in pairs])]
        if self.kind == "neox_qkv":
            return [_stacked_to_neox(tensors[0], config)]
        if self.kind == "falcon_qkv":
            return [_stacked_to_falcon(tensors[0], config)]
        if len(self.lit) > 1:
            return [torch.cat(tensors, dim=0)]
        return [t.contiguous() for t in torch.split(tensors[0], self.sizes, dim=0)]


def _out_first(t: torch.Tensor) -> torch.Tensor:
    """A weight (in, out) as (out, in) and back, contiguous; a bias as it is."""
    return t.t().contiguous() if t.dim() == 2 else t


def _neox_to_stacked(t: torch.Tensor, c: Config) -> torch.Tensor:
    rest = t.shape[1:]
    t = t.reshape(c.n_head, 3, c.head_size, *rest)
    return torch.cat([t[:, i].reshape(c.n_head * c.head_size, *rest) for i in range(3)], dim=0)


def _stacked_to_neox(t: torch.Tensor, c: Config) -> torch.Tensor:
    rest = t.shape[1:]
    q, k, v = (part.reshape(c.n_head, c.head_size, *rest) for part in t.chunk(3, dim=0))
    return torch.stack((q, k, v), dim=1).reshape(3 * c.n_head * c.head_size, *rest).contiguous()


def weight_rules(config: Config, lit_keys: set[str]) -> list[Rule]:
    """Every rule for this config; `lit_keys` (the model's state-dict keys) decides which weights and biases exist."""
    family = family_of(config.hf_model_type, "The model config")
    modules = _module_map(config, family)
    rules = []
    for lit, hf, kind, sizes in modules:
        for suffix in ("weight", "bias", "e_score_correction_bias"):
            lit_names = tuple(f"{name}.{suffix}" for name in lit)
            present = [name in lit_keys for name in lit_names]
            if not any(present):
                continue
            if not all(present):
                raise AssertionError(f"partial parameter set for {lit_names}")
            hf_names = tuple(f"{name}.{suffix}" for name in hf)
            rules.append(Rule(lit_names, hf_names, kind, sizes))
    if family.model_type == "gpt_oss":
        rules.extend(_gpt_oss_rules(config))
    if config.tie_embeddings:
        rules = [r for r in rules if r.lit != ("lm_head.weight",)]
    return rules


def _gpt_oss_rules(c: Config) -> list[Rule]:
    """gpt-oss' attention sinks and fused experts: gate_up_proj (n_expert, n_embd, 2 * size) with gate and up
    interleaved, down_proj (n_expert, size, n_embd), and a bias of each."""
    rules = []
    for i in range(c.n_layer):
        lit, hf = f"transformer.h.{i}", f"model.layers.{i}"
        rules.append(Rule((f"{lit}.attn.sinks",), (f"{hf}.self_attn.sinks",)))
        experts = range(c.n_expert)
        for suffix, hf_suffix in (("weight", ""), ("bias", "_bias")):
            gate_up = tuple(f"{lit}.mlp.experts.{e}.{fc}.{suffix}" for e in experts for fc in ("fc_1", "fc_2"))
            rules.append(Rule(gate_up, (f"{hf}.mlp.experts.gate_up_proj{hf_suffix}",), "experts_gate_up"))
            down = tuple(f"{lit}.mlp.experts.{e}.proj.{suffix}" for e in experts)
            rules.append(Rule(down, (f"{hf}.mlp.experts.down_proj{hf_suffix}",), "experts"))
    return rules


def _module_map(c: Config, family: Family) -> list[tuple[tuple[str, ...], tuple[str, ...], str, tuple[int, ...]]]:
    """(litgpt modules, Hugging Face modules, kind, split sizes) for every module with parameters."""
    qkv_sizes = (c.n_head * c.head_size, c.n_query_groups * c.head_size, c.n_query_groups * c.head_size)
    out: list = []

    def add(lit, hf, kind="copy", sizes=()):
        out.append(((lit,) if isinstance(lit, str) else lit, (hf,) if isinstance(hf, str) else hf, kind, sizes))

    if family.model_type in LEGACY_FAMILIES:
        _legacy_modules(c, family, add)
        return out
    if family.model_type == "gpt_neox":
        add("transformer.wte", "gpt_neox.embed_in")
        add("transformer.ln_f", "gpt_neox.final_layer_norm")
        add("lm_head", "embed_out")
        for i in range(c.n_layer):
            lit, hf = f"transformer.h.{i}", f"gpt_neox.layers.{i}"
            add(f"{lit}.norm_1", f"{hf}.input_layernorm")
            add(f"{lit}.norm_2", f"{hf}.post_attention_layernorm")
            add(f"{lit}.attn.qkv", f"{hf}.attention.query_key_value", "neox_qkv")
            add(f"{lit}.attn.proj", f"{hf}.attention.dense")
            add(f"{lit}.mlp.fc", f"{hf}.mlp.dense_h_to_4h")
            add(f"{lit}.mlp.proj", f"{hf}.mlp.dense_4h_to_h")
        return out

    add("transformer.wte", "model.embed_tokens")
    add("transformer.ln_f", "model.norm")
    add("lm_head", "lm_head")
    gemma_norms = c.post_attention_norm
    for i in range(c.n_layer):
        lit, hf = f"transformer.h.{i}", f"model.layers.{i}"
        add(f"{lit}.norm_1", f"{hf}.input_layernorm")
        if gemma_norms:
            add(f"{lit}.post_attention_norm", f"{hf}.post_attention_layernorm")
            add(f"{lit}.norm_2", f"{hf}.pre_feedforward_layernorm")
            add(f"{lit}.post_mlp_norm", f"{hf}.post_feedforward_layernorm")
        else:
            add(f"{lit}.norm_2", f"{hf}.post_attention_layernorm")
        if family.latent:
            for ours, theirs in _latent_modules(c):
                add(f"{lit}.attn.{ours}", f"{hf}.self_attn.{theirs}")
        elif family.fused_qkv:
            add(f"{lit}.attn.qkv", f"{hf}.self_attn.qkv_proj")
        else:
            attn = f"{hf}.self_attn"
            add(f"{lit}.attn.qkv", (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"), "cat", qkv_sizes)
        add(f"{lit}.attn.proj", f"{hf}.self_attn.o_proj")
        if c.norm_qk:
            add(f"{lit}.attn.norm_q", f"{hf}.self_attn.q_norm")
            add(f"{lit}.attn.norm_k", f"{hf}.self_attn.k_norm")
        if family.model_type == "gpt_oss":
            add(f"{lit}.mlp.gate", f"{hf}.mlp.router")  # the experts are fused: _gpt_oss_rules
        elif family.model_type in DEEPSEEK_MOE_FAMILIES:
            add_deepseek_moe_modules(add, c, i, f"{lit}.mlp", f"{hf}.mlp")
        elif c.mlp_class_name == "LLaMAMoE":
            moe = f"{hf}.block_sparse_moe" if family.model_type == "mixtral" else f"{hf}.mlp"
            names = ("w1", "w3", "w2") if family.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            add(f"{lit}.mlp.gate", f"{moe}.gate")
            for e in range(c.n_expert):
                for ours, theirs in zip(("fc_1", "fc_2", "proj"), names):
                    add(f"{lit}.mlp.experts.{e}.{ours}", f"{moe}.experts.{e}.{theirs}")
        elif family.fused_gate_up:
            add((f"{lit}.mlp.fc_1", f"{lit}.mlp.fc_2"), f"{hf}.mlp.gate_up_proj", "cat", (c.intermediate_size,) * 2)
            add(f"{lit}.mlp.proj", f"{hf}.mlp.down_proj")
        else:
            add(f"{lit}.mlp.fc_1", f"{hf}.mlp.gate_proj")
            add(f"{lit}.mlp.fc_2", f"{hf}.mlp.up_proj")
            add(f"{lit}.mlp.proj", f"{hf}.mlp.down_proj")
    return out


# ---- Falcon, StableLM, phi-1.5/2 and OLMo 1 -------------------------------------------------------------------------
# Older architectures: LayerNorm (OLMo 1's without weights), partial rotary, parallel attention and MLP. Their
# config.json keys and weight names differ from the Llama-style families above, so they are read and written here.
_LAYER_NORM = dict(norm_class_name="LayerNorm")
LEGACY_FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        _family(
            "falcon",
            "FalconForCausalLM",
            head_dim_key=False,
            default_tie=True,
            free=("parallel_residual", "shared_attention_norm", "bias"),
            fixed=dict(_LAYER_NORM, mlp_class_name="GptNeoxMLP", rotary_percentage=1.0),
        ),
        _family(
            "stablelm",
            "StableLmForCausalLM",
            head_dim_key=False,
            free=("parallel_residual", "shared_attention_norm", "attn_bias", "norm_qk", "norm_qk_per_head"),
            fixed=_LAYER_NORM,
        ),
        _family(
            "phi",
            "PhiForCausalLM",
            head_dim_key=False,
            free=("norm_qk",),
            fixed=dict(_LAYER_NORM, mlp_class_name="GptNeoxMLP", parallel_residual=True, shared_attention_norm=True,
                       bias=True, lm_head_bias=True),
        ),
        _family(
            "olmo",
            "OlmoForCausalLM",
            head_dim_key=False,
            free=("clip_qkv",),
            # OLMo's LayerNorm has no weights and a fixed eps
            fixed=dict(_LAYER_NORM, norm_affine=False, norm_eps=1e-5, rotary_percentage=1.0),
        ),
    ]
}
FAMILIES.update(LEGACY_FAMILIES)
# transformers' default share of each head that rotates, when config.json does not say
_PARTIAL_ROTARY_DEFAULT = {"stablelm": 0.25, "phi": 0.5}


def _falcon_as_standard(hf: dict, where: str) -> dict:
    """A Falcon config.json in the keys the other families use, with FalconConfig's defaults and the layout checks
    that transformers' Falcon code relies on."""
    if hf.get("alibi"):
        raise UserError(f"{where}: Falcon with alibi=true is not supported (litgpt runs the rotary Falcon models).")
    heads = hf.get("num_attention_heads", 71)
    new = bool(hf.get("new_decoder_architecture", False))
    parallel = bool(hf.get("parallel_attn", True))
    kv_heads = hf.get("num_kv_heads") or heads
    norms = hf.get("num_ln_in_parallel_attn") or (2 if new else 1)
    if new and not parallel:
        raise UserError(f"{where}: Falcon with new_decoder_architecture=true needs parallel_attn=true.")
    if not new and (norms != 1 or (not hf.get("multi_query", True) and kv_heads != heads)):
        raise UserError(
            f"{where}: Falcon without new_decoder_architecture takes num_ln_in_parallel_attn=1 and, without "
            "multi_query, num_kv_heads equal to num_attention_heads."
        )
    hidden = hf.get("hidden_size", hf.get("n_embed", 4544))
    return dict(
        hf,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=hf.get("num_hidden_layers", 32),
        num_key_value_heads=kv_heads if new else 1 if hf.get("multi_query", True) else heads,
        intermediate_size=hf.get("ffn_hidden_size") or 4 * hidden,
        vocab_size=hf.get("vocab_size", 65024),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        parallel_attn=parallel,
        num_ln_in_parallel_attn=norms,
    )


def _legacy_from_hf(hf: dict, family: Family, where: str) -> dict:
    """The Config values particular to these families (the shared sizes are read by `_config_from_hf`)."""
    kind = family.model_type
    out: dict[str, Any] = {}
    if kind == "falcon":
        out.update(
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            parallel_residual=hf["parallel_attn"],
            shared_attention_norm=hf["parallel_attn"] and hf["num_ln_in_parallel_attn"] == 1,
            bias=bool(hf.get("bias", False)),
            gelu_approximate=_gelu_approximate(hf.get("activation", "gelu"), where),
        )
    elif kind == "stablelm":
        parallel = bool(hf.get("use_parallel_residual", False))
        qk_norm = bool(hf.get("qk_layernorm", False))
        out.update(norm_eps=hf.get("layer_norm_eps", 1e-5), parallel_residual=parallel, shared_attention_norm=parallel,
                   attn_bias=bool(hf.get("use_qkv_bias", False)), norm_qk=qk_norm, norm_qk_per_head=qk_norm)
    elif kind == "phi":
        out.update(norm_eps=hf.get("layer_norm_eps", 1e-5), norm_qk=bool(hf.get("qk_layernorm", False)),
                   gelu_approximate=_gelu_approximate(hf.get("hidden_act", "gelu_new"), where))
    elif kind == "olmo":
        if hf.get("attention_bias"):
            raise UserError(f"{where}: attention_bias=true is not supported for olmo.")
        out["clip_qkv"] = hf.get("clip_qkv")
    if kind in ("stablelm", "olmo") and hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: activation {hf['hidden_act']!r} is not supported for {kind}.")
    if kind in _PARTIAL_ROTARY_DEFAULT:
        params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        default = _PARTIAL_ROTARY_DEFAULT[kind]
        out["rotary_percentage"] = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))
    return out


def _legacy_to_hf(c: Config, family: Family, hf: dict) -> dict:
    """`hf` (the shared keys written by `config_to_hf`) completed and renamed for these families."""
    kind = family.model_type
    if kind in _PARTIAL_ROTARY_DEFAULT:
        hf["partial_rotary_factor"] = c.rotary_percentage
    if kind == "stablelm":
        hf.update(layer_norm_eps=c.norm_eps, hidden_act="silu", use_parallel_residual=c.parallel_residual,
                  use_qkv_bias=c.attn_bias, qk_layernorm=c.norm_qk)
        if c.parallel_residual != c.shared_attention_norm or c.norm_qk != c.norm_qk_per_head:
            raise UserError(
                "Hugging Face 'stablelm' needs shared_attention_norm equal to parallel_residual and norm_qk_per_head "
                "equal to norm_qk."
            )
    elif kind == "phi":
        hf.update(layer_norm_eps=c.norm_eps, hidden_act="gelu" if c.gelu_approximate == "none" else "gelu_new",
                  qk_layernorm=c.norm_qk)
    elif kind == "olmo":
        hf.update(hidden_act="silu", attention_bias=False, clip_qkv=c.clip_qkv)
    elif kind == "falcon":
        for key in ("intermediate_size", "num_key_value_heads"):
            del hf[key]
        new, multi_query, norms = _falcon_layout(c)
        hf.update(
            ffn_hidden_size=c.intermediate_size, num_kv_heads=c.n_query_groups, layer_norm_epsilon=c.norm_eps,
            bias=c.bias, alibi=False, new_decoder_architecture=new, multi_query=multi_query,
            parallel_attn=c.parallel_residual, num_ln_in_parallel_attn=norms,
            activation="gelu" if c.gelu_approximate == "none" else "gelu_new",
        )
    return hf


def _falcon_layout(c: Config) -> tuple[bool, bool, int]:
    """(new_decoder_architecture, multi_query, num_ln_in_parallel_attn) of the Falcon that computes like `c`. Where
    both decoders could, the older is written: their weights are then laid out alike (see `Rule`, "falcon_qkv")."""
    groups_fit_old = c.n_query_groups in (1, c.n_head)
    if c.parallel_residual and (not c.shared_attention_norm or not groups_fit_old):
        return True, c.n_query_groups == 1, 1 if c.shared_attention_norm else 2
    if not groups_fit_old:
        raise UserError(
            "Hugging Face 'falcon' runs grouped-query attention only with parallel_residual=True; use "
            "n_query_groups 1 or n_head."
        )
    if c.parallel_residual != c.shared_attention_norm:
        raise UserError(
            f"Hugging Face 'falcon' with n_query_groups={c.n_query_groups} and parallel_residual="
            f"{c.parallel_residual} needs shared_attention_norm={c.parallel_residual}."
        )
    return False, c.n_query_groups == 1, 1


def _legacy_modules(c: Config, family: Family, add) -> None:
    """Every weight of these families, through `_module_map`'s `add(lit, hf, kind, sizes)`."""
    kind = family.model_type
    qkv_sizes = (c.n_head * c.head_size, c.n_query_groups * c.head_size, c.n_query_groups * c.head_size)
    if kind == "falcon":
        add("transformer.wte", "transformer.word_embeddings")
        add("transformer.ln_f", "transformer.ln_f")
        add("lm_head", "lm_head")
        new = _falcon_layout(c)[0]
        for i in range(c.n_layer):
            lit, hf = f"transformer.h.{i}", f"transformer.h.{i}"
            add(f"{lit}.norm_1", f"{hf}.ln_attn" if new and not c.shared_attention_norm else f"{hf}.input_layernorm")
            add(f"{lit}.norm_2", f"{hf}.ln_mlp" if c.parallel_residual else f"{hf}.post_attention_layernorm")
            add(f"{lit}.attn.qkv", f"{hf}.self_attention.query_key_value", "falcon_qkv")
            add(f"{lit}.attn.proj", f"{hf}.self_attention.dense")
            add(f"{lit}.mlp.fc", f"{hf}.mlp.dense_h_to_4h")
            add(f"{lit}.mlp.proj", f"{hf}.mlp.dense_4h_to_h")
        return
    add("transformer.wte", "model.embed_tokens")
    add("transformer.ln_f", "model.final_layernorm" if kind == "phi" else "model.norm")
    add("lm_head", "lm_head")
    for i in range(c.n_layer):
        lit, hf = f"transformer.h.{i}", f"model.layers.{i}"
        attn = f"{hf}.self_attn"
        add(f"{lit}.norm_1", f"{hf}.input_layernorm")
        add(f"{lit}.norm_2", f"{hf}.post_attention_layernorm")
        add(f"{lit}.attn.qkv", (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"), "cat", qkv_sizes)
        add(f"{lit}.attn.proj", f"{attn}.dense" if kind == "phi" else f"{attn}.o_proj")
        if c.norm_qk and c.norm_qk_per_head:
            per_head = (("norm_q", "q_layernorm", c.n_head), ("norm_k", "k_layernorm", c.n_query_groups))
            for ours, theirs, heads in per_head:
                names = tuple(f"{attn}.{theirs}.norms.{h}" for h in range(heads))
                add(f"{lit}.attn.{ours}", names, "cat", (c.head_size,) * heads)
        elif c.norm_qk:
            add(f"{lit}.attn.norm_q", f"{attn}.q_layernorm")
            add(f"{lit}.attn.norm_k", f"{attn}.k_layernorm")
        if kind == "phi":
            add(f"{lit}.mlp.fc", f"{hf}.mlp.fc1")
            add(f"{lit}.mlp.proj", f"{hf}.mlp.fc2")
        else:
            add(f"{lit}.mlp.fc_1", f"{hf}.mlp.gate_proj")
            add(f"{lit}.mlp.fc_2", f"{hf}.mlp.up_proj")
            add(f"{lit}.mlp.proj", f"{hf}.mlp.down_proj")


def _falcon_to_stacked(t: torch.Tensor, c: Config) -> torch.Tensor:
    """Falcon's fused q/k/v, laid out per KV group as [its q heads | k | v], to litgpt's [all q | all k | all v]."""
    rest, per_group = t.shape[1:], c.n_head // c.n_query_groups
    t = t.reshape(c.n_query_groups, per_group + 2, c.head_size, *rest)
    q = t[:, :per_group].reshape(c.n_head * c.head_size, *rest)
    k, v = (t[:, per_group + i].reshape(c.n_query_groups * c.head_size, *rest) for i in (0, 1))
    return torch.cat((q, k, v), dim=0)


def _stacked_to_falcon(t: torch.Tensor, c: Config) -> torch.Tensor:
    rest, per_group = t.shape[1:], c.n_head // c.n_query_groups
    q, k, v = t.split((c.n_head * c.head_size, c.n_query_groups * c.head_size, c.n_query_groups * c.head_size))
    parts = (q.reshape(c.n_query_groups, per_group, c.head_size, *rest),
             *(x.reshape(c.n_query_groups, 1, c.head_size, *rest) for x in (k, v)))
    return torch.cat(parts, dim=1).reshape(t.shape).contiguous()
# ---- DeepSeek-style mixture of experts (DeepSeek-V2/V3, Kimi K2, GLM-4.5) ------------------------------------------
# model_type -> the router's `topk_method` its transformers class hard-codes, or None to read config.json's.
DEEPSEEK_MOE_FAMILIES: dict[str, Optional[str]] = {
    "glm4_moe": "noaux_tc", "deepseek_v3": "noaux_tc", "deepseek_v2": None,
}
# topk_method -> how our router runs it: "noaux_tc" (DeepSeek-V3) chooses by sigmoid score plus the correction bias
# within the best groups by top-2 sum; "greedy" and "group_limited_greedy" (DeepSeek-V2) by softmax probability,
# the latter within the groups of the best single probabilities.
TOPK_METHODS = {
    "noaux_tc": _NOAUX_TC,
    "greedy": dict(moe_score_function="softmax", moe_expert_bias=False, moe_group_score="top2_sum"),
    "group_limited_greedy": dict(moe_score_function="softmax", moe_expert_bias=False, moe_group_score="max"),
}


def deepseek_moe_from_hf(hf: dict, topk_method: Optional[str], where: str) -> dict:
    """Config values for the DeepSeek-style MoE keys of config.json (n_routed_experts, n_shared_experts,
    num_experts_per_tok, n_group, topk_group, routed_scaling_factor, norm_topk_prob, first_k_dense_replace,
    moe_intermediate_size, topk_method and scoring_func); `topk_method` is the one the family's class hard-codes, or
    None to read config.json's. Keys that contradict each other raise one line naming them."""
    method = topk_method or hf.get("topk_method", "greedy")
    if method not in TOPK_METHODS:
        raise UserError(f"{where}: topk_method {method!r} is not supported; litgpt runs {', '.join(TOPK_METHODS)}.")
    values = dict(TOPK_METHODS[method], mlp_class_name="LLaMAMoE")
    scoring = hf.get("scoring_func", values["moe_score_function"]) if topk_method is None else None
    if scoring is not None and scoring != values["moe_score_function"]:
        raise UserError(f"{where}: scoring_func {scoring!r} contradicts topk_method {method!r}.")
    if hf.get("moe_layer_freq", 1) != 1:
        raise UserError(f"{where}: moe_layer_freq={hf['moe_layer_freq']} is not supported (MoE in every layer after "
                        "first_k_dense_replace).")
    n_expert, k = hf["n_routed_experts"], hf["num_experts_per_tok"]
    grouped = method != "greedy"  # DeepSeek-V2's greedy router ignores n_group and topk_group
    n_group = (hf.get("n_group") or 1) if grouped else 1
    topk_group = (hf.get("topk_group") or 1) if grouped else 1
    if n_group < 1 or n_expert % n_group:
        raise UserError(f"{where}: n_routed_experts ({n_expert}) is not divisible by n_group ({n_group}).")
    if not 1 <= topk_group <= n_group:
        raise UserError(f"{where}: topk_group ({topk_group}) must be between 1 and n_group ({n_group}).")
    if not 0 < k <= topk_group * (n_expert // n_group):
        raise UserError(
            f"{where}: num_experts_per_tok ({k}) exceeds the {topk_group * (n_expert // n_group)} experts of "
            f"topk_group ({topk_group}) groups of n_routed_experts / n_group ({n_expert // n_group})."
        )
    first_dense = hf.get("first_k_dense_replace") or 0
    if not 0 <= first_dense <= hf["num_hidden_layers"]:
        raise UserError(f"{where}: first_k_dense_replace ({first_dense}) exceeds num_hidden_layers.")
    values.update(
        n_expert=n_expert,
        n_expert_per_token=k,
        moe_intermediate_size=hf["moe_intermediate_size"],
        moe_n_shared_expert=hf.get("n_shared_experts") or 0,
        moe_n_group=n_group,
        moe_topk_group=topk_group,
        moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        # transformers' DeepSeek-V2 router never renormalizes, whatever norm_topk_prob says
        moe_renormalize=bool(hf.get("norm_topk_prob", False)) and method == "noaux_tc",
        moe_first_dense_layers=first_dense,
        # These models balance their experts through the correction bias, not an auxiliary loss.
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
    )
    return values


def deepseek_moe_to_hf(c: Config, method_keys: bool) -> dict:
    """The DeepSeek-style MoE keys of config.json for `c` (with `method_keys`, also topk_method and scoring_func,
    for classes that read them)."""
    shared = c.moe_n_shared_expert
    if shared and c.moe_shared_intermediate_size != shared * c.moe_intermediate_size:
        raise UserError(
            f"Hugging Face sizes the shared experts n_shared_experts * moe_intermediate_size; this model has "
            f"moe_shared_intermediate_size={c.moe_shared_intermediate_size}, moe_n_shared_expert={shared} and "
            f"moe_intermediate_size={c.moe_intermediate_size}."
        )
    routing = dict(moe_score_function=c.moe_score_function, moe_expert_bias=c.moe_expert_bias)
    methods = [m for m, v in TOPK_METHODS.items() if v.items() >= routing.items()
               and (c.moe_n_group == 1 or v["moe_group_score"] == c.moe_group_score)]
    if not methods:
        raise UserError(f"No DeepSeek topk_method routes as moe_score_function={c.moe_score_function!r}, "
                        f"moe_expert_bias={c.moe_expert_bias}, moe_group_score={c.moe_group_score!r}.")
    hf = dict(
        n_routed_experts=c.n_expert,
        num_experts_per_tok=c.n_expert_per_token,
        moe_intermediate_size=c.moe_intermediate_size,
        n_shared_experts=shared,
        n_group=c.moe_n_group,
        topk_group=c.moe_topk_group,
        routed_scaling_factor=c.moe_routed_scaling,
        norm_topk_prob=c.moe_renormalize,
        first_k_dense_replace=c.moe_first_dense_layers,
    )
    if method_keys:
        hf.update(topk_method=methods[0], scoring_func=c.moe_score_function)
    return hf


def add_deepseek_moe_modules(add, c: Config, layer: int, lit: str, hf: str) -> None:
    """The weight-name map of one layer's MLP `lit` <-> `hf` (e.g. model.layers.3.mlp): the dense
    gate/up/down_proj in the first moe_first_dense_layers layers; then the router `gate` (weight and
    e_score_correction_bias), experts.N.{gate,up,down}_proj and shared_experts.{gate,up,down}_proj."""
    names = (("fc_1", "gate_proj"), ("fc_2", "up_proj"), ("proj", "down_proj"))
    if not c.is_moe_layer(layer):
        for ours, theirs in names:
            add(f"{lit}.{ours}", f"{hf}.{theirs}")
        return
    add(f"{lit}.gate", f"{hf}.gate")
    for e in range(c.n_expert):
        for ours, theirs in names:
            add(f"{lit}.experts.{e}.{ours}", f"{hf}.experts.{e}.{theirs}")
    if c.moe_n_shared_expert:
        for ours, theirs in names:
            add(f"{lit}.shared_experts.{ours}", f"{hf}.shared_experts.{theirs}")


# ---- DeepSeek-V2/V3 and Kimi K2: multi-head latent attention --------------------------------------------------------
_LATENT_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _latent_from_hf(hf: dict, family: Family, where: str) -> dict:
    """The latent attention sizes of config.json."""
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise UserError(f"{where}: num_key_value_heads must equal num_attention_heads ({heads}) with latent attention.")
    values = {key: hf.get(key) if key == "q_lora_rank" else hf[key] for key in _LATENT_SIZES}
    values.update(
        head_size=values["qk_nope_head_dim"] + values["qk_rope_head_dim"],
        n_query_groups=heads,
        rope_interleaved=bool(hf.get("rope_interleave", True)) if family.model_type == "deepseek_v3" else True,
    )
    return values


def _latent_to_hf(c: Config, family: Family) -> dict:
    hf = {key: getattr(c, key) for key in _LATENT_SIZES}
    hf.update(head_dim=c.qk_rope_head_dim, attention_bias=False)
    if family.model_type == "deepseek_v3":
        hf.update(rope_interleave=c.rope_interleaved, num_nextn_predict_layers=0)
    return hf


def _latent_modules(c: Config) -> list[tuple[str, str]]:
    """(litgpt, Hugging Face) names of the latent attention's modules under `attn` / `self_attn`."""
    query = [("q_proj", "q_proj")] if c.q_lora_rank is None else [
        ("q_a_proj", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b_proj", "q_b_proj")]
    return query + [("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj")]

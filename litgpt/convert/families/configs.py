"""config.json <-> `Config`, both ways (the transformers 4.x layout, and 5.x's `rope_parameters` when reading)."""

from __future__ import annotations

from typing import Any, Optional

from litgpt.config import Config
from litgpt.convert.families.catalogue import family_of
from litgpt.convert.families.deepseek import (
    DEEPSEEK_MOE_FAMILIES, deepseek_moe_from_hf, deepseek_moe_to_hf, latent_from_hf, latent_to_hf,
)
from litgpt.convert.families.family import Family, gelu_approximate
from litgpt.convert.families.legacy import LEGACY_FAMILIES, falcon_as_standard, legacy_from_hf, legacy_to_hf
from litgpt.errors import UserError


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
        hf = falcon_as_standard(hf, where)
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
            gelu_approximate=gelu_approximate(hf.get("hidden_act", "gelu"), where),
        )
        if not hf.get("attention_bias", True):
            raise UserError(f"{where}: GPT-NeoX without attention biases is not supported.")
    elif family.model_type in LEGACY_FAMILIES:
        values.update(legacy_from_hf(hf, family, where))
    else:
        values["norm_eps"] = hf.get("rms_norm_eps", 1e-6)
        activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
        if values["mlp_class_name"] == "GemmaMLP":
            values["gelu_approximate"] = gelu_approximate(activation, where)
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
        values.update(latent_from_hf(hf, family, where))
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
        hf = legacy_to_hf(c, family, hf)
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
        hf.update(latent_to_hf(c, family))
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

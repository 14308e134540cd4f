"""DeepSeek's pieces of the conversion: the DeepSeek-style mixture of experts (DeepSeek-V2/V3, Kimi K2, GLM-4.5:
routers, shared experts, dense first layers) and multi-head latent attention (DeepSeek-V2/V3, Kimi K2), in
config.json and in the weight-name map."""

from __future__ import annotations

from typing import Optional

from litgpt.config import Config
from litgpt.convert.families.family import Family
from litgpt.errors import UserError

# ---- DeepSeek-style mixture of experts (DeepSeek-V2/V3, Kimi K2, GLM-4.5) ------------------------------------------
# DeepSeek-V3's routing ("noaux_tc"), which GLM-4.5 shares: sigmoid scores, a correction bias, groups by top-2 sum.
NOAUX_TC_ROUTING = dict(moe_score_function="sigmoid", moe_expert_bias=True, moe_group_score="top2_sum")
# model_type -> the router's `topk_method` its transformers class hard-codes, or None to read config.json's.
DEEPSEEK_MOE_FAMILIES: dict[str, Optional[str]] = {
    "glm4_moe": "noaux_tc", "deepseek_v3": "noaux_tc", "deepseek_v2": None,
}
# topk_method -> how our router runs it: "noaux_tc" (DeepSeek-V3) chooses by sigmoid score plus the correction bias
# within the best groups by top-2 sum; "greedy" and "group_limited_greedy" (DeepSeek-V2) by softmax probability,
# the latter within the groups of the best single probabilities.
TOPK_METHODS = {
    "noaux_tc": NOAUX_TC_ROUTING,
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


def latent_from_hf(hf: dict, family: Family, where: str) -> dict:
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


def latent_to_hf(c: Config, family: Family) -> dict:
    hf = {key: getattr(c, key) for key in _LATENT_SIZES}
    hf.update(head_dim=c.qk_rope_head_dim, attention_bias=False)
    if family.model_type == "deepseek_v3":
        hf.update(rope_interleave=c.rope_interleaved, num_nextn_predict_layers=0)
    return hf


def latent_modules(c: Config) -> list[tuple[str, str]]:
    """(litgpt, Hugging Face) names of the latent attention's modules under `attn` / `self_attn`."""
    query = [("q_proj", "q_proj")] if c.q_lora_rank is None else [
        ("q_a_proj", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b_proj", "q_b_proj")]
    return query + [("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj")]

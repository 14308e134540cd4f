"""The older architectures (Falcon, StableLM, phi-1.5/2, OLMo 1): their families, config.json keys and weight
names, and the fused q/k/v layouts of Falcon and GPT-NeoX."""

from __future__ import annotations

from typing import Any

import torch

from litgpt.config import Config
from litgpt.convert.families.family import Family, define_family, gelu_approximate
from litgpt.errors import UserError

# Older architectures: LayerNorm (OLMo 1's without weights), partial rotary, parallel attention and MLP. Their
# config.json keys and weight names differ from the Llama-style families (`catalogue`), so they are read and written
# here.
# LayerNorm in place of the shared RMSNorm.
_LAYER_NORM_ARCHITECTURE = dict(norm_class_name="LayerNorm")
LEGACY_FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        define_family(
            "falcon",
            "FalconForCausalLM",
            head_dim_key=False,
            default_tie=True,
            free=("parallel_residual", "shared_attention_norm", "bias"),
            fixed=dict(_LAYER_NORM_ARCHITECTURE, mlp_class_name="GptNeoxMLP", rotary_percentage=1.0),
        ),
        define_family(
            "stablelm",
            "StableLmForCausalLM",
            head_dim_key=False,
            free=("parallel_residual", "shared_attention_norm", "attn_bias", "norm_qk", "norm_qk_per_head"),
            fixed=_LAYER_NORM_ARCHITECTURE,
        ),
        define_family(
            "phi",
            "PhiForCausalLM",
            head_dim_key=False,
            free=("norm_qk",),
            fixed=dict(_LAYER_NORM_ARCHITECTURE, mlp_class_name="GptNeoxMLP", parallel_residual=True,
                       shared_attention_norm=True, bias=True, lm_head_bias=True),
        ),
        define_family(
            "olmo",
            "OlmoForCausalLM",
            head_dim_key=False,
            free=("clip_qkv",),
            # OLMo's LayerNorm has no weights and a fixed eps
            fixed=dict(_LAYER_NORM_ARCHITECTURE, norm_affine=False, norm_eps=1e-5, rotary_percentage=1.0),
        ),
    ]
}
# transformers' default share of each head that rotates, when config.json does not say
_PARTIAL_ROTARY_DEFAULT = {"stablelm": 0.25, "phi": 0.5}


def falcon_as_standard(hf: dict, where: str) -> dict:
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


def legacy_from_hf(hf: dict, family: Family, where: str) -> dict:
    """The Config values particular to these families (the shared sizes are read by `configs._config_from_hf`)."""
    kind = family.model_type
    out: dict[str, Any] = {}
    if kind == "falcon":
        out.update(
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            parallel_residual=hf["parallel_attn"],
            shared_attention_norm=hf["parallel_attn"] and hf["num_ln_in_parallel_attn"] == 1,
            bias=bool(hf.get("bias", False)),
            gelu_approximate=gelu_approximate(hf.get("activation", "gelu"), where),
        )
    elif kind == "stablelm":
        parallel = bool(hf.get("use_parallel_residual", False))
        qk_norm = bool(hf.get("qk_layernorm", False))
        out.update(norm_eps=hf.get("layer_norm_eps", 1e-5), parallel_residual=parallel, shared_attention_norm=parallel,
                   attn_bias=bool(hf.get("use_qkv_bias", False)), norm_qk=qk_norm, norm_qk_per_head=qk_norm)
    elif kind == "phi":
        out.update(norm_eps=hf.get("layer_norm_eps", 1e-5), norm_qk=bool(hf.get("qk_layernorm", False)),
                   gelu_approximate=gelu_approximate(hf.get("hidden_act", "gelu_new"), where))
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


def legacy_to_hf(c: Config, family: Family, hf: dict) -> dict:
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


def legacy_modules(c: Config, family: Family, add) -> None:
    """Every weight of these families, through `weights._module_map`'s `add(lit, hf, kind, sizes)`."""
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


def falcon_to_stacked(t: torch.Tensor, c: Config) -> torch.Tensor:
    """Falcon's fused q/k/v, laid out per KV group as [its q heads | k | v], to litgpt's [all q | all k | all v]."""
    rest, per_group = t.shape[1:], c.n_head // c.n_query_groups
    t = t.reshape(c.n_query_groups, per_group + 2, c.head_size, *rest)
    q = t[:, :per_group].reshape(c.n_head * c.head_size, *rest)
    k, v = (t[:, per_group + i].reshape(c.n_query_groups * c.head_size, *rest) for i in (0, 1))
    return torch.cat((q, k, v), dim=0)


def stacked_to_falcon(t: torch.Tensor, c: Config) -> torch.Tensor:
    rest, per_group = t.shape[1:], c.n_head // c.n_query_groups
    q, k, v = t.split((c.n_head * c.head_size, c.n_query_groups * c.head_size, c.n_query_groups * c.head_size))
    parts = (q.reshape(c.n_query_groups, per_group, c.head_size, *rest),
             *(x.reshape(c.n_query_groups, 1, c.head_size, *rest) for x in (k, v)))
    return torch.cat(parts, dim=1).reshape(t.shape).contiguous()


# GPT-NeoX's fused q/k/v interleaves q, k and v per head (see `weights.Rule`, "neox_qkv").
def neox_to_stacked(t: torch.Tensor, c: Config) -> torch.Tensor:
    rest = t.shape[1:]
    t = t.reshape(c.n_head, 3, c.head_size, *rest)
    return torch.cat([t[:, i].reshape(c.n_head * c.head_size, *rest) for i in range(3)], dim=0)


def stacked_to_neox(t: torch.Tensor, c: Config) -> torch.Tensor:
    rest = t.shape[1:]
    q, k, v = (part.reshape(c.n_head, c.head_size, *rest) for part in t.chunk(3, dim=0))
    return torch.stack((q, k, v), dim=1).reshape(3 * c.n_head * c.head_size, *rest).contiguous()

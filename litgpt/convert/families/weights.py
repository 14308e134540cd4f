"""The weight-name map: which litgpt tensors are which Hugging Face tensors, and how one side's tensors become the
other's (`Rule`), for every family."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from litgpt.config import Config
from litgpt.convert.families.catalogue import family_of
from litgpt.convert.families.deepseek import DEEPSEEK_MOE_FAMILIES, add_deepseek_moe_modules, latent_modules
from litgpt.convert.families.family import Family
from litgpt.convert.families.legacy import (
    LEGACY_FAMILIES, falcon_to_stacked, legacy_modules, neox_to_stacked, stacked_to_falcon, stacked_to_neox,
)


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
            return [neox_to_stacked(tensors[0], config)]
        if self.kind == "falcon_qkv":
            return [falcon_to_stacked(tensors[0], config)]
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
            return [stacked_to_neox(tensors[0], config)]
        if self.kind == "falcon_qkv":
            return [stacked_to_falcon(tensors[0], config)]
        if len(self.lit) > 1:
            return [torch.cat(tensors, dim=0)]
        return [t.contiguous() for t in torch.split(tensors[0], self.sizes, dim=0)]


def _out_first(t: torch.Tensor) -> torch.Tensor:
    """A weight (in, out) as (out, in) and back, contiguous; a bias as it is."""
    return t.t().contiguous() if t.dim() == 2 else t


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
        legacy_modules(c, family, add)
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
            for ours, theirs in latent_modules(c):
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

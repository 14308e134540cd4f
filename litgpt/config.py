"""The model configuration: every architectural choice is a field, never derived from the model's name."""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from litgpt.errors import UserError

NormClass = Literal["LayerNorm", "RMSNorm"]
MLPClass = Literal["GptNeoxMLP", "LLaMAMLP", "GemmaMLP", "LLaMAMoE"]


@dataclass
class Config:
    name: str = ""
    # Where the published weights live: {"org": ..., "name": ...} on the Hugging Face hub.
    hf_config: dict = field(default_factory=dict)
    # The Hugging Face `model_type` these weights convert to and from (llama, mistral, qwen2, gemma2, ...).
    hf_model_type: str = "llama"

    block_size: int = 4096
    vocab_size: int = 50257
    # Rows of the embedding and output matrices; None rounds vocab_size up to padding_multiple.
    padded_vocab_size: Optional[int] = None
    padding_multiple: int = 512

    n_layer: int = 16
    n_embd: int = 4096
    n_head: int = 32
    head_size: Optional[int] = None  # None: n_embd // n_head
    n_query_groups: Optional[int] = None  # None: n_head (multi-head); 1: multi-query

    # Linear layers
    bias: bool = False  # every linear layer but the output head
    attn_bias: bool = False  # only the fused q/k/v projection (Qwen2)
    lm_head_bias: bool = False
    tie_embeddings: bool = False

    # Norms
    norm_class_name: NormClass = "RMSNorm"
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight) (Gemma)
    norm_qk: bool = False  # normalize queries and keys per head before RoPE (Qwen3, Gemma 3)
    post_attention_norm: bool = False  # norm on the attention output before the residual add (Gemma 2/3)
    post_mlp_norm: bool = False  # norm on the MLP output before the residual add (Gemma 2/3)

    # Residual layout
    parallel_residual: bool = False  # x + attn(norm_1(x)) + mlp(norm_2(x)) (GPT-NeoX)
    shared_attention_norm: bool = False  # parallel residual with one norm for both branches

    # MLP
    mlp_class_name: MLPClass = "LLaMAMLP"
    intermediate_size: Optional[int] = None  # None: 4 * n_embd
    gelu_approximate: Literal["none", "tanh"] = "none"
    n_expert: int = 0
    n_expert_per_token: int = 0
    moe_intermediate_size: Optional[int] = None  # None: intermediate_size
    moe_renormalize: bool = True  # rescale the top-k router weights to sum to one (Mixtral; Qwen3's norm_topk_prob)
    # Weight of the router's load-balancing loss in training (GPT.router_aux_loss); 0 turns it off.
    router_aux_loss_coef: float = 0.0

    # Rotary position embeddings
    rotary_percentage: float = 1.0
    rope_base: float = 10000.0
    # Scaling of the (global) rotary frequencies, in Hugging Face's terms:
    # {"type": "linear", "factor": f}, {"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}, {"type": "yarn", "factor", "original_max_position_embeddings",
    # optional "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"}.
    rope_scaling: Optional[dict] = None
    rope_local_base: Optional[float] = None  # rotary base of sliding-window layers when it differs (Gemma 3)

    # Attention
    sliding_window_size: Optional[int] = None
    # With a window: 1 = every layer slides; k > 1 = every k-th layer (k-1, 2k-1, ...) is global, the others slide.
    sliding_window_pattern: int = 1
    attention_scores_scalar: Optional[int] = None  # scores scale 1/sqrt(this) instead of 1/sqrt(head_size)
    attention_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(n_embd) (Gemma)

    # How chat and finetuning format a conversation for this model (see litgpt/prompts.py).
    prompt_style: str = "default"

    # Older architectures (Falcon, StableLM, phi-1.5/2, OLMo 1).
    norm_affine: bool = True  # False: LayerNorms without weight or bias (OLMo 1)
    clip_qkv: Optional[float] = None  # clamp q, k and v to [-clip_qkv, clip_qkv] after their projection (OLMo 1)
    norm_qk_per_head: bool = False  # with norm_qk: each head has its own LayerNorm weight, no bias (StableLM 2)
    # gpt-oss
    # A learned logit per head that joins every softmax's denominator and attends to nothing ("attention sinks").
    attention_sinks: bool = False
    router_bias: bool = False  # the MoE router's linear layer has a bias
    # The clamped SwiGLU of gpt-oss, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit),
    # in LLaMAMLP and the experts; both None: the plain SwiGLU silu(gate) * up.
    swiglu_alpha: Optional[float] = None
    swiglu_limit: Optional[float] = None
    # Norm placement of OLMo 2/3 (LitGPT's names): norm_1/norm_2 False drop the norm before attention/the MLP, whose
    # outputs post_attention_norm/post_mlp_norm then normalize before the residual add.
    norm_1: bool = True
    norm_2: bool = True
    # With norm_qk: "default" normalizes each head's queries and keys; "olmo2" the whole q and k projections (all
    # heads together, one weight of n_head * head_size and one of n_query_groups * head_size).
    norm_qk_type: Literal["default", "olmo2"] = "default"
    # Which layers rotate queries and keys, Hugging Face's SmolLM3 `no_rope_layers`: per layer 1 = RoPE, 0 = none
    # (NoPE); at least n_layer entries, the first n_layer used. None: every layer.
    no_rope_layers: Optional[list[int]] = None
    # DeepSeek-style mixture of experts (DeepSeek-V2/V3, Kimi K2, GLM-4.5); the defaults are Mixtral's routing.
    # Shared experts: one SwiGLU MLP every token goes through, added to the routed experts' output; its width is
    # moe_shared_intermediate_size (None: moe_n_shared_expert * moe_intermediate_size, as DeepSeek sizes it).
    moe_n_shared_expert: int = 0
    moe_shared_intermediate_size: Optional[int] = None
    # The router's score per expert: "softmax" over all experts (Mixtral, Qwen3-MoE, DeepSeek-V2) or an independent
    # "sigmoid" per expert (DeepSeek-V3, GLM-4.5).
    moe_score_function: Literal["softmax", "sigmoid"] = "softmax"
    # A per-expert bias added to the scores only to choose the experts, never to weight them (DeepSeek-V3's
    # `e_score_correction_bias`: a buffer, adjusted outside of gradient descent, saved and converted with the weights).
    moe_expert_bias: bool = False
    # Group-limited routing: the experts form moe_n_group equal groups, each token picks moe_topk_group groups by
    # their score (`moe_group_score`: the sum of a group's top two scores, DeepSeek-V3's "noaux_tc", or its best
    # score, DeepSeek-V2's "group_limited_greedy"), then its top n_expert_per_token experts among those groups.
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_group_score: Literal["top2_sum", "max"] = "top2_sum"
    # The routed experts' weights are multiplied by this (after any renormalization).
    moe_routed_scaling: float = 1.0
    # The first k layers have the dense LLaMAMLP of width intermediate_size instead of experts (first_k_dense_replace).
    moe_first_dense_layers: int = 0

    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), on when kv_lora_rank is set. Keys and values come from
    # one compressed latent of kv_lora_rank elements per token plus one rotary key of qk_rope_head_dim shared by the
    # heads; each head's query and key are qk_nope_head_dim elements without rotation followed by qk_rope_head_dim
    # rotated ones (head_size is their sum), its value v_head_dim. q_lora_rank None: one plain query projection
    # (DeepSeek-V2-Lite); else the query goes through a rank-q_lora_rank bottleneck with its own RMSNorm.
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    # Rotate the pairs (x0, x1), (x2, x3), ... of the rotary elements (DeepSeek's layout) instead of (x_i, x_i+n/2).
    rope_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.head_size is None:
            if self.n_embd % self.n_head:
                raise UserError(f"n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head}): set head_size.")
            self.head_size = self.n_embd // self.n_head
        if self.n_query_groups is None:
            self.n_query_groups = self.n_head
        if self.n_head % self.n_query_groups:
            raise UserError(
                f"n_head ({self.n_head}) must be a multiple of n_query_groups ({self.n_query_groups})."
            )
        if self.padded_vocab_size is None:
            multiple = self.padding_multiple
            self.padded_vocab_size = -(-self.vocab_size // multiple) * multiple
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        if self.mlp_class_name == "LLaMAMoE":
            if not (0 < self.n_expert_per_token <= self.n_expert):
                raise UserError(
                    f"A mixture-of-experts MLP needs 0 < n_expert_per_token <= n_expert, "
                    f"got {self.n_expert_per_token} and {self.n_expert}."
                )
            if self.moe_intermediate_size is None:
                self.moe_intermediate_size = self.intermediate_size
            self._check_moe_routing()
        if not self.router_aux_loss_coef >= 0:
            raise UserError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}.")
        if not self.norm_affine and self.norm_class_name != "LayerNorm":
            raise UserError("norm_affine=False (norms without weights) needs norm_class_name='LayerNorm'.")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise UserError(f"clip_qkv must be a positive number or null, got {self.clip_qkv}.")
        if self.norm_qk_per_head and not (self.norm_qk and self.norm_class_name == "LayerNorm" and self.norm_affine):
            raise UserError(
                "norm_qk_per_head=True needs norm_qk=True, norm_class_name='LayerNorm' and norm_affine=True "
                "(StableLM's per-head q/k LayerNorms)."
            )
        if (self.swiglu_alpha is None) != (self.swiglu_limit is None):
            raise UserError(
                f"swiglu_alpha ({self.swiglu_alpha}) and swiglu_limit ({self.swiglu_limit}) go together: set both "
                "for gpt-oss's clamped SwiGLU, or neither."
            )
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise UserError(f"swiglu_limit must be > 0, got {self.swiglu_limit}.")
        if self.router_bias and self.mlp_class_name != "LLaMAMoE":
            raise UserError(f"router_bias=True needs mlp_class_name='LLaMAMoE', got {self.mlp_class_name!r}.")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type")
            if kind not in ("linear", "llama3", "yarn", "longrope"):
                raise UserError(
                    f"rope_scaling type {kind!r} is not supported; use 'linear', 'llama3', 'yarn' or 'longrope'."
                )
            if kind == "longrope":
                self._check_longrope()
        self._check_norms_and_rope_layers()
        self._check_latent_attention()

    def _check_longrope(self) -> None:
        scaling, half = self.rope_scaling, self.rope_n_elem // 2
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key)
            if not isinstance(factors, (list, tuple)) or len(factors) != half:
                got = f"{len(factors)} values" if isinstance(factors, (list, tuple)) else repr(factors)
                raise UserError(
                    f"rope_scaling {key} must list rope_n_elem / 2 = {half} factors (head_size {self.head_size} x "
                    f"rotary_percentage {self.rotary_percentage} / 2), got {got}."
                )
        original = scaling.get("original_max_position_embeddings")
        if not isinstance(original, int) or original < 1:
            raise UserError(f"rope_scaling type 'longrope' needs original_max_position_embeddings > 0, got {original!r}.")

    def _check_norms_and_rope_layers(self) -> None:
        if self.norm_qk_type not in ("default", "olmo2"):
            raise UserError(f"norm_qk_type must be 'default' or 'olmo2', got {self.norm_qk_type!r}.")
        if self.norm_qk_type == "olmo2" and not self.norm_qk:
            raise UserError("norm_qk_type='olmo2' normalizes queries and keys: it needs norm_qk=True.")
        layers = self.no_rope_layers
        if layers is not None and (len(layers) < self.n_layer or any(v not in (0, 1) for v in layers)):
            raise UserError(
                f"no_rope_layers must give 1 (RoPE) or 0 (no RoPE) for each of the n_layer={self.n_layer} layers, "
                f"got {list(layers)}."
            )

    def _check_latent_attention(self) -> None:
        """One line naming the fields when the multi-head latent attention sizes do not fit together."""
        sizes = dict(q_lora_rank=self.q_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                     qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        if self.kv_lora_rank is None:
            given = [name for name, value in sizes.items() if value is not None]
            if given:
                raise UserError(f"{', '.join(given)} describe latent attention, which needs kv_lora_rank; set it or "
                                "leave them out.")
            return
        missing = [name for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if sizes[name] is None]
        if missing:
            raise UserError(f"kv_lora_rank={self.kv_lora_rank} (latent attention) needs {', '.join(missing)}.")
        bad = [f"{name}={value}" for name, value in dict(sizes, kv_lora_rank=self.kv_lora_rank).items()
               if value is not None and (not isinstance(value, int) or value <= 0)]
        if bad or self.qk_rope_head_dim % 2:
            raise UserError(f"Latent attention sizes must be positive integers and qk_rope_head_dim even: got "
                            f"{', '.join(bad) or f'qk_rope_head_dim={self.qk_rope_head_dim}'}.")
        if self.head_size != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise UserError(f"head_size={self.head_size} must equal qk_nope_head_dim + qk_rope_head_dim "
                            f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim}) with latent attention.")
        if self.n_query_groups != self.n_head:
            raise UserError(f"n_query_groups={self.n_query_groups} must equal n_head={self.n_head} with latent "
                            "attention (every head expands its own key and value from the latent).")
        if self.rotary_percentage != 1.0:
            raise UserError(f"rotary_percentage={self.rotary_percentage} does not apply to latent attention: "
                            "qk_rope_head_dim sets the rotated elements; leave it at 1.0.")
        unsupported = dict(norm_qk=self.norm_qk, attention_logit_softcapping=self.attention_logit_softcapping,
                           rope_local_base=self.rope_local_base)
        used = [f"{name}={value!r}" for name, value in unsupported.items() if value not in (None, False)]
        if used:
            raise UserError(f"Latent attention (kv_lora_rank) does not combine with {', '.join(used)}.")

    def _check_moe_routing(self) -> None:
        """The DeepSeek-style MoE fields against each other: one line naming the fields that contradict."""
        if self.moe_n_shared_expert < 0:
            raise UserError(f"moe_n_shared_expert must be >= 0, got {self.moe_n_shared_expert}.")
        if self.moe_n_shared_expert and self.moe_shared_intermediate_size is None:
            self.moe_shared_intermediate_size = self.moe_n_shared_expert * self.moe_intermediate_size
        if not self.moe_n_shared_expert and self.moe_shared_intermediate_size:
            raise UserError(
                f"moe_shared_intermediate_size={self.moe_shared_intermediate_size} needs moe_n_shared_expert > 0."
            )
        if self.moe_n_group < 1 or self.n_expert % self.moe_n_group:
            raise UserError(
                f"n_expert ({self.n_expert}) must be divisible by moe_n_group ({self.moe_n_group}), a positive count."
            )
        if not 1 <= self.moe_topk_group <= self.moe_n_group:
            raise UserError(
                f"moe_topk_group ({self.moe_topk_group}) must be between 1 and moe_n_group ({self.moe_n_group})."
            )
        per_group = self.n_expert // self.moe_n_group
        if self.n_expert_per_token > self.moe_topk_group * per_group:
            raise UserError(
                f"n_expert_per_token ({self.n_expert_per_token}) exceeds the experts in the moe_topk_group "
                f"({self.moe_topk_group}) chosen groups of n_expert / moe_n_group ({per_group})."
            )
        if self.moe_n_group > 1 and self.moe_group_score == "top2_sum" and per_group < 2:
            raise UserError(
                f"moe_group_score 'top2_sum' needs two experts per group; n_expert ({self.n_expert}) / "
                f"moe_n_group ({self.moe_n_group}) is {per_group}."
            )
        if not 0 <= self.moe_first_dense_layers <= self.n_layer:
            raise UserError(f"moe_first_dense_layers ({self.moe_first_dense_layers}) must be between 0 and n_layer "
                            f"({self.n_layer}).")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has routed experts (the first moe_first_dense_layers are dense)."""
        return self.mlp_class_name == "LLaMAMoE" and layer_idx >= self.moe_first_dense_layers

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def rope_n_elem(self) -> int:
        """How many leading elements of each head rotate (latent attention: the qk_rope_head_dim last ones)."""
        if self.kv_lora_rank is not None:
            return self.qk_rope_head_dim
        return int(self.rotary_percentage * self.head_size)

    @property
    def qkv_size(self) -> int:
        """Per token, the width of the queries, keys and values the attention's projections produce."""
        if self.kv_lora_rank is not None:  # the queries and the keys' and values' expansion of the latent
            return self.n_head * (self.head_size + self.qk_nope_head_dim + self.v_head_dim)
        return (self.n_head + 2 * self.n_query_groups) * self.head_size

    def uses_rope(self, layer_idx: int) -> bool:
        """Whether this layer rotates queries and keys (SmolLM3 leaves every fourth without: NoPE)."""
        return self.no_rope_layers is None or bool(self.no_rope_layers[layer_idx])

    def is_sliding_layer(self, layer_idx: int) -> bool:
        if self.sliding_window_size is None:
            return False
        if self.sliding_window_pattern <= 1:
            return True
        return (layer_idx + 1) % self.sliding_window_pattern != 0

    # ---- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Config":
        from litgpt.configs import canonical_name, configs_by_name

        registry = configs_by_name()
        name = canonical_name(name)  # LitGPT's spelling of a name registered here under another
        if name not in registry:
            # Accept the hub id too ("meta-llama/Llama-3.2-1B").
            by_repo = {f"{c['hf_config']['org']}/{c['hf_config']['name']}": c for c in registry.values()}
            if name in by_repo:
                return cls(**{**by_repo[name], **overrides})
            close = difflib.get_close_matches(name, list(registry) + list(by_repo), n=3, cutoff=0.4)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise UserError(f"Unknown model name {name!r}.{hint} `litgpt download list` shows every registered name.")
        return cls(**{**registry[name], **overrides})

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "Config":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"Model config file {str(path)!r} does not exist.")
        try:
            values = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            problem = " ".join(str(error).split())
            raise UserError(f"Model config file {str(path)!r} is not valid YAML: {problem}") from None
        if not isinstance(values, dict):
            raise UserError(f"Model config file {str(path)!r} must hold a mapping of config fields.")
        return cls.from_dict({**values, **overrides}, source=str(path))

    @classmethod
    def from_dict(cls, values: dict, source: str = "the model config") -> "Config":
        """A config from our fields, or from LitGPT 0.5.13's (a file with any field only LitGPT has, such as the
        model_config.yaml that LitGPT and our own commands write)."""
        known = {f.name for f in fields(cls)}
        if any(key in LITGPT_ONLY_FIELDS for key in values):
            values = fields_from_litgpt(values, source)
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"{source} has unknown config fields {unknown}; known fields are those of litgpt.Config.")
        try:
            return cls(**values)
        except TypeError as error:
            raise UserError(f"{source} is not a valid model config: {error}") from None

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, **overrides: Any) -> "Config":
        path = Path(checkpoint_dir) / "model_config.yaml"
        if not path.is_file():
            raise UserError(
                f"{str(checkpoint_dir)!r} has no model_config.yaml. Point to a folder written by "
                "`litgpt download`, `litgpt convert_to_litgpt` or a training run."
            )
        config = cls.from_file(path, **overrides)
        style = read_litgpt_prompt_style(Path(checkpoint_dir))  # LitGPT's prompt_style.yaml wins, as in LitGPT
        if style is not None and "prompt_style" not in overrides:
            config.prompt_style = style
        return config

    def to_dict(self) -> dict:
        return asdict(self)

    def to_litgpt_dict(self) -> dict:
        """The fields of LitGPT 0.5.13's Config for this model; ours that LitGPT lacks ride in hf_config."""
        return fields_to_litgpt(self)

    def save(self, path: str | Path) -> None:
        """Write model_config.yaml in LitGPT 0.5.13's fields (LitGPT's `Config(**yaml)` refuses any other key), and
        beside it LitGPT's prompt_style.yaml, so that LitGPT's commands load the folder too."""
        from litgpt.io import atomic_write_text

        path = Path(path)
        atomic_write_text(path, yaml.safe_dump(self.to_litgpt_dict(), sort_keys=False))
        style = LITGPT_PROMPT_STYLES.get(self.prompt_style)
        if style is not None:
            litgpt_style = {"class_path": f"litgpt.prompts.{style}"}
            atomic_write_text(path.parent / PROMPT_STYLE_FILE, yaml.safe_dump(litgpt_style))
        elif (path.parent / PROMPT_STYLE_FILE).is_file():
            (path.parent / PROMPT_STYLE_FILE).unlink()  # a style LitGPT lacks: LitGPT then derives one from the name


# ---- LitGPT 0.5.13's model_config.yaml -------------------------------------------------------------------------------
# Every field of LitGPT 0.5.13's Config with its default (LitGPT writes them all; a hand-written file may not).
LITGPT_DEFAULTS: dict[str, Any] = dict(
    name="", hf_config={}, block_size=4096, n_layer=16, n_embd=4096, vocab_size=50254, padding_multiple=512,
    padded_vocab_size=None, norm_class_name="LayerNorm", norm_eps=1e-5, norm_qk=False, norm_qk_type="default",
    post_attention_norm=False, post_mlp_norm=False, parallel_residual=True, shared_attention_norm=False, n_head=32,
    head_size=None, n_query_groups=None, attn_bias=False, attention_scores_scalar=None, sliding_window_size=None,
    sliding_window_indices=None, attention_logit_softcapping=None, rope_base=10000, rotary_percentage=0.25,
    rope_condense_ratio=1, rope_adjustments=None, rope_interleave=False, intermediate_size=None,
    moe_intermediate_size=None, bias=True, mlp_class_name="GptNeoxMLP", gelu_approximate="none", n_expert=0,
    n_shared_expert=None, n_expert_groups=None, n_topk_groups=None, n_topk_scores_per_group=None,
    n_expert_per_token=0, first_k_dense_replace=None, routed_scaling_factor=1.0, norm_topk_prob=False,
    scale_embeddings=False, lm_head_bias=False, final_logit_softcapping=None, norm_1=True, norm_2=True,
    latent_attention=None, rope_local_base_freq=None, rope_indices=None,
)
_OUR_FIELDS = tuple(f.name for f in fields(Config))
# Same name, same meaning in both.
SHARED_FIELDS = tuple(k for k in LITGPT_DEFAULTS if k in _OUR_FIELDS and k != "hf_config")
LITGPT_ONLY_FIELDS = frozenset(LITGPT_DEFAULTS) - set(_OUR_FIELDS)
# Our fields that LitGPT spells its own way (per-layer lists, rope_adjustments): translated both ways below.
_TRANSLATED = ("rope_scaling", "rope_local_base", "sliding_window_pattern")
# Our fields LitGPT has no place for (hf_model_type, norm_unit_offset, tie_embeddings, moe_renormalize, prompt_style,
# and any field added later), and the name: kept in hf_config under EXTRA_KEY. LitGPT keeps hf_config as it is, also
# when it copies or rewrites model_config.yaml, and reads only its org and name.
EXTRA_KEY = "litgpt_fields"
EXTRA_FIELDS = ("name",) + tuple(k for k in _OUR_FIELDS if k not in LITGPT_DEFAULTS and k not in _TRANSLATED)

PROMPT_STYLE_FILE = "prompt_style.yaml"
# Our prompt style -> LitGPT's class of the same layout (litgpt.prompts.X in LitGPT).
LITGPT_PROMPT_STYLES = {"default": "Default", "alpaca": "Alpaca", "chatml": "ChatML", "llama2": "Llama2",
                        "llama3": "Llama3", "phi3": "Phi3", "gemma": "Gemma", "tinyllama": "TinyLlama",
                        "qwen2.5": "Qwen2_5", "qwen2.5-math": "Qwen2_5_Math", "qwq-preview": "QwQ",
                        "deepseek-r1": "R1Base", "falcon3": "Falcon3", "salamandra": "Salamandra",
                        "platypus": "Platypus", "freewilly2": "FreeWilly2"}
# LitGPT's classes for models whose style we write under another class (read only): Qwen3 and SmolLM2 are ChatML
# with LitGPT's own default system messages, CodeLlama is its [INST] layout.
_LITGPT_CLASSES_READ = {"Qwen3": "chatml", "SmolLM2": "chatml", "CodeLlama": "llama2"}
# LitGPT picks a style from the model's name when the folder has no prompt_style.yaml (its model_name_to_prompt_style);
# these are the rules whose style we have (in its order: the first match wins).
_LITGPT_NAME_STYLES = (
    (r"Falcon3.*-Instruct", "falcon3"),
    (r"Llama-2.*-chat", "llama2"), (r"Llama-3.*-Instruct", "llama3"), (r"OLMo-2.*-(Instruct|SFT|DPO)", "llama3"),
    (r"R1", "deepseek-r1"), (r"FreeWilly2", "freewilly2"), (r"Platypus", "platypus"),
    (r"CodeLlama", "llama2"), (r"Mi[sx]tral.*Instruct", "mistral"),
    (r"Phi-3", "phi3"), (r"tiny-llama.*chat", "tinyllama"), (r"(Code)?Gemma.*-it", "gemma"),
    (r"Qwen2\.5-Math-", "qwen2.5-math"), (r"Qwen2\.5-", "qwen2.5"), (r"QwQ-", "qwq-preview"), (r"Qwen3-", "chatml"),
    (r"SmolLM2.*-Instruct", "chatml"), (r"salamandra-.*-instruct", "salamandra"),
)


def read_litgpt_prompt_style(checkpoint_dir: Path) -> Optional[str]:
    """Our name of the style in a folder's prompt_style.yaml (LitGPT's), or None without one."""
    path = checkpoint_dir / PROMPT_STYLE_FILE
    if not path.is_file():
        return None
    try:
        class_path = (yaml.safe_load(path.read_text()) or {}).get("class_path", "")
    except (yaml.YAMLError, AttributeError):
        raise UserError(f"{str(path)!r} is not LitGPT's prompt_style.yaml (class_path: litgpt.prompts.NAME).") from None
    by_class = {**_LITGPT_CLASSES_READ, **{litgpt: ours for ours, litgpt in LITGPT_PROMPT_STYLES.items()}}
    style = by_class.get(str(class_path).rsplit(".", 1)[-1]) if str(class_path).startswith("litgpt.prompts.") else None
    if style is None:
        raise UserError(
            f"{str(path)!r} names the prompt style {class_path!r}, which litgpt does not have; edit it to one of "
            f"{', '.join('litgpt.prompts.' + name for name in LITGPT_PROMPT_STYLES.values())}."
        )
    return style


def _litgpt_unsupported(v: dict) -> list[str]:
    """`field=value` for each LitGPT setting describing an architecture that our model does not run."""
    checks = (
        ("rope_interleave", v["rope_interleave"]),
        ("latent_attention", v["latent_attention"] is not None),
        ("n_shared_expert", bool(v["n_shared_expert"])),
        ("n_expert_groups", bool(v["n_expert_groups"])),
        ("first_k_dense_replace", v["first_k_dense_replace"] is not None),
        ("routed_scaling_factor", v["routed_scaling_factor"] != 1.0),
    )
    return [f"{name}={v[name]!r}" for name, bad in checks if bad]


def fields_from_litgpt(values: dict, source: str) -> dict:
    """Our Config fields for the values of a LitGPT 0.5.13 model_config.yaml (LitGPT's defaults for missing keys).

    A value that describes an architecture we cannot run raises UserError naming it; no field is dropped.
    """
    unknown = sorted(set(values) - set(LITGPT_DEFAULTS) - set(_OUR_FIELDS))
    if unknown:
        raise UserError(f"{source} has fields that neither litgpt nor LitGPT 0.5.13 knows: {unknown}.")
    v = {**LITGPT_DEFAULTS, **values}
    hf_config = dict(v["hf_config"] or {})
    extra = dict(hf_config.pop(EXTRA_KEY, None) or {})
    if not v["name"]:
        v["name"] = hf_config.get("name", "")
    unsupported = _litgpt_unsupported(v)
    if unsupported:
        raise UserError(f"{source} describes an architecture litgpt does not run: {', '.join(unsupported)}.")
    out = {key: v[key] for key in SHARED_FIELDS}
    out["hf_config"] = hf_config
    if v["padded_vocab_size"] is not None:  # LitGPT caps the vocabulary at the padded size
        out["vocab_size"] = min(v["vocab_size"], v["padded_vocab_size"])
    # LitGPT scales RMSNorm by (1 + weight) for models named Gemma; its top-k router always renormalizes.
    out["norm_unit_offset"] = v["norm_class_name"] == "RMSNorm" and "Gemma" in v["name"]
    out["norm_affine"] = not _litgpt_olmo_norm(v)  # LitGPT's LayerNorm has no weights for models named OLMo
    out["moe_renormalize"] = True
    out["rope_scaling"] = _rope_scaling_from_litgpt(v, source)
    out.update(_layer_kinds_from_litgpt(v, source))
    out["hf_model_type"] = _guess_hf_model_type(v)
    out["prompt_style"] = next((s for pattern, s in _LITGPT_NAME_STYLES if re.search(pattern, v["name"])), "default")
    out.update({key: values[key] for key in values if key in _OUR_FIELDS and key not in LITGPT_DEFAULTS})
    out.update({key: value for key, value in extra.items() if key in EXTRA_FIELDS})
    return out


def _rope_scaling_from_litgpt(v: dict, source: str) -> Optional[dict]:
    adjust, condense = v["rope_adjustments"], v["rope_condense_ratio"]
    if adjust is not None and "type" in adjust:  # written by us: our rope_scaling plus LitGPT's key names
        return {key: value for key, value in adjust.items() if key != "original_max_seq_len"}
    if adjust is not None and ("beta_fast" in adjust or "beta_slow" in adjust):
        raise UserError(
            f"{source} has YaRN rope_adjustments {adjust}: LitGPT 0.5.13 computes YaRN unlike Hugging Face, which "
            "litgpt follows. Convert the model from its Hugging Face weights (`litgpt convert_to_litgpt`) instead."
        )
    if adjust is not None and "low_freq_factor" in adjust:
        if condense != 1:
            raise UserError(f"{source} combines rope_condense_ratio={condense} with Llama 3 rope_adjustments.")
        return {"type": "llama3", "factor": adjust["factor"], "low_freq_factor": adjust["low_freq_factor"],
                "high_freq_factor": adjust["high_freq_factor"],
                "original_max_position_embeddings": adjust["original_max_seq_len"]}
    factor = (adjust or {}).get("factor", 1.0) * condense  # both divide the positions' angles
    return None if factor == 1 else {"type": "linear", "factor": factor}


def _layer_kinds_from_litgpt(v: dict, source: str) -> dict:
    """sliding_window_pattern and rope_local_base from LitGPT's per-layer indicator lists."""
    n_layer = v["n_layer"]
    sliding = (list(v["sliding_window_indices"] or [1] * n_layer) + [1] * n_layer)[:n_layer]
    out: dict[str, Any] = {"sliding_window_pattern": 1, "rope_local_base": None}
    if v["sliding_window_size"] is not None:
        patterns = [k for k in range(1, n_layer + 1)
                    if sliding == [int(k == 1 or (i + 1) % k != 0) for i in range(n_layer)]]
        if not patterns:
            raise UserError(
                f"{source} has sliding_window_indices={v['sliding_window_indices']}; litgpt runs a window on every "
                "layer or on all but every k-th layer."
            )
        out["sliding_window_pattern"] = patterns[0]
    if v["rope_local_base_freq"] is not None:
        local = (list(v["rope_indices"] or [1] * n_layer) + [1] * n_layer)[:n_layer]
        windowed = sliding if v["sliding_window_size"] is not None else [0] * n_layer
        if local != windowed:
            raise UserError(
                f"{source} has rope_indices={v['rope_indices']}; litgpt uses rope_local_base_freq on exactly the "
                "sliding-window layers."
            )
        out["rope_local_base"] = v["rope_local_base_freq"]
    return out


def _litgpt_olmo_norm(v: dict) -> bool:
    return v["norm_class_name"] == "LayerNorm" and "OLMo" in v["name"]


def _guess_hf_model_type(v: dict) -> str:
    """The Hugging Face family of a LitGPT config (LitGPT picks its converter by name; this looks at the layout)."""
    if v["parallel_residual"] and v["shared_attention_norm"] and v["lm_head_bias"]:
        return "phi"
    if v["parallel_residual"] and not v["bias"] and v["mlp_class_name"] == "GptNeoxMLP":
        return "falcon"
    if v["parallel_residual"]:
        return "gpt_neox"
    if v["norm_class_name"] == "LayerNorm" and v["mlp_class_name"] == "LLaMAMLP":
        return "olmo" if _litgpt_olmo_norm(v) else "stablelm"
    if v["mlp_class_name"] == "GemmaMLP":
        return "gemma3" if v["norm_qk"] else "gemma2" if v["post_attention_norm"] else "gemma"
    if v["mlp_class_name"] == "LLaMAMoE":
        return "qwen3_moe" if v["norm_qk"] else "mixtral"
    if v["norm_qk"] and v["norm_qk_type"] == "olmo2":
        return "olmo3" if v["sliding_window_size"] is not None else "olmo2"
    if v["norm_qk"]:
        return "qwen3"
    if v["attn_bias"]:
        return "qwen2"
    if re.match(r"(Phi-3|Phi-4|phi-4)", v["name"]):
        return "phi3"
    return "mistral" if v["sliding_window_size"] is not None else "llama"


def fields_to_litgpt(config: Config) -> dict:
    """LitGPT 0.5.13's Config fields describing `config` (what LitGPT computes with them is what we compute)."""
    c = config
    out = dict(LITGPT_DEFAULTS)
    out.update({key: getattr(c, key) for key in SHARED_FIELDS})
    layers = range(c.n_layer)
    if c.sliding_window_size is not None:
        out["sliding_window_indices"] = [int(c.is_sliding_layer(i)) for i in layers]
    if c.rope_local_base is not None:
        out["rope_local_base_freq"] = c.rope_local_base
        out["rope_indices"] = [int(c.is_sliding_layer(i)) for i in layers]
    if c.rope_scaling is not None:
        scaling = dict(c.rope_scaling)
        if "original_max_position_embeddings" in scaling:
            scaling["original_max_seq_len"] = scaling["original_max_position_embeddings"]
        if scaling["type"] == "yarn":  # LitGPT requires both betas; these are Hugging Face's defaults
            scaling = {"beta_fast": 32, "beta_slow": 1, **scaling}
        out["rope_adjustments"] = scaling
    out["norm_topk_prob"] = c.moe_renormalize
    extra = {key: getattr(c, key) for key in EXTRA_FIELDS}
    if c.norm_unit_offset and "Gemma" not in c.name:
        # LitGPT adds the unit offset to RMSNorm only for models whose name contains "Gemma".
        out["name"] = f"{c.name} (Gemma)".strip()
    if not c.norm_affine and "OLMo" not in c.name:
        out["name"] = f"{c.name} (OLMo)".strip()  # and its LayerNorms without weights only for names with "OLMo"
    out["hf_config"] = {**c.hf_config, EXTRA_KEY: extra}
    return out

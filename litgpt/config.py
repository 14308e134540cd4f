"""The model configuration: every architectural choice is a field, never derived from the model's name."""

from __future__ import annotations

import difflib
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
        if not self.router_aux_loss_coef >= 0:
            raise UserError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}.")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type")
            if kind not in ("linear", "llama3", "yarn"):
                raise UserError(f"rope_scaling type {kind!r} is not supported; use 'linear', 'llama3' or 'yarn'.")

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def rope_n_elem(self) -> int:
        """How many leading elements of each head rotate."""
        return int(self.rotary_percentage * self.head_size)

    @property
    def qkv_size(self) -> int:
        return (self.n_head + 2 * self.n_query_groups) * self.head_size

    def is_sliding_layer(self, layer_idx: int) -> bool:
        if self.sliding_window_size is None:
            return False
        if self.sliding_window_pattern <= 1:
            return True
        return (layer_idx + 1) % self.sliding_window_pattern != 0

    # ---- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Config":
        from litgpt.configs import configs_by_name

        registry = configs_by_name()
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
        known = {f.name for f in fields(cls)}
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
        return cls.from_file(path, **overrides)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        from litgpt.io import atomic_write_text

        atomic_write_text(Path(path), yaml.safe_dump(self.to_dict(), sort_keys=False))

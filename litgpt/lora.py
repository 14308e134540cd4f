"""Low-rank adaptation (LoRA, arXiv:2106.09685) of a litgpt `GPT`, applied from outside the model.

`add_lora` swaps chosen `nn.Linear` layers for `LoRALinear`, a subclass that keeps the frozen base `weight` and
`bias` under their usual names and adds small trainable factors next to them:

    y = x W^T + b + (dropout(x) A^T B^T) * alpha / r

A is (r, in_features) with Kaiming-uniform init, B is (rows, r) and starts at zero, so a freshly adapted model
computes exactly what the base model does. The fused q/k/v projection gets one independent pair of factors per
enabled part (`lora_A_q`/`lora_B_q`, `..._k`, `..._v`), each writing only into its own rows of the output.

Because the base keys do not change, a plain `lit_model.pth` loads into an adapted model (`load_base_weights`), the
adapters alone are saved with `lora_state_dict`, and `plain_state_dict` gives back the merged weights of a plain GPT.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from litgpt.checkpoint.model_files import assign_weights, check_weights_match
from litgpt.errors import UserError
from litgpt.nf4 import is_nf4, linear_of_rows

if TYPE_CHECKING:
    from litgpt.model import GPT

LORA_PREFIX = "lora_"
# The three parts of the fused q/k/v projection, in the order of its rows.
QKV_PARTS = ("q", "k", "v")
# The switch that adapts each linear layer of latent attention (`litgpt.model.MultiheadLatentAttention`): query the
# query path, key the compression of the token into the latent and the shared rotary key, value the expansion of the
# latent into every head's keys and values, projection the output projection.
LATENT_SWITCHES = {"q_proj": "query", "q_a_proj": "query", "q_b_proj": "query", "kv_a_proj": "key",
                   "kv_b_proj": "value", "proj": "projection"}


@dataclass
class LoRASettings:
    """Which linear layers get adapters, and their rank, scale and dropout.

    Args:
        r: Rank of the update B @ A.
        alpha: Scale of the update; the update is multiplied by alpha / r.
        dropout: Dropout on the adapters' input (0 disables it).
        query: Adapt the query rows of the fused q/k/v projection (latent attention: q_proj, or q_a_proj and
            q_b_proj).
        key: Adapt the key rows of the fused q/k/v projection (latent attention: kv_a_proj, the compression into
            the latent and the rotary key).
        value: Adapt the value rows of the fused q/k/v projection (latent attention: kv_b_proj, the latent's
            expansion into the heads' keys and values).
        projection: Adapt the attention output projection.
        mlp: Adapt every linear layer of the MLP (every expert's in a mixture of experts; not the router).
        head: Adapt the output head (not possible with tied embeddings).
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    query: bool = True
    key: bool = False
    value: bool = True
    projection: bool = False
    mlp: bool = False
    head: bool = False

    def __post_init__(self) -> None:
        switches = ("query", "key", "value", "projection", "mlp", "head")
        if not any(getattr(self, name) for name in switches):
            raise UserError(
                "LoRA targets no layer: enable at least one of lora_query, lora_key, lora_value, lora_projection, "
                "lora_mlp, lora_head."
            )
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise UserError(f"lora_r must be an integer >= 1, got {self.r!r}.")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise UserError(f"lora_alpha must be a number > 0, got {self.alpha!r}.")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise UserError(f"lora_dropout must be in [0, 1), got {self.dropout!r}.")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    # ---- the `lora_*` entries of a run's hyperparameters.yaml ---------------------------------------------------
    def to_hparams(self) -> dict[str, Any]:
        """The settings as `lora_r`, `lora_alpha`, ... (the names a finetuning run records)."""
        return {f"lora_{name}": value for name, value in asdict(self).items()}

    @classmethod
    def from_hparams(cls, hparams: dict, source: str = "the hyperparameters") -> "LoRASettings":
        """Read the settings back from `lora_*` entries; r and alpha are required, the switches default as above."""
        for required in ("lora_r", "lora_alpha"):
            if required not in hparams:
                raise UserError(f"{source} has no {required}: it is needed to apply the LoRA adapters.")
        values = {f.name: hparams[f"lora_{f.name}"] for f in fields(cls) if f"lora_{f.name}" in hparams}
        return cls(**values)


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a low-rank trainable update of some or all of its output rows.

    `parts` maps a name suffix to a row range [start, stop): each part has its own `lora_A{suffix}` (r, in_features)
    and `lora_B{suffix}` (stop - start, r). A plain adapter is one part, suffix "", over all rows.

    The base weight and bias are the very parameters of the layer it replaces (ties are kept). After bitsandbytes
    quantization (`litgpt.quantize`) they live in a child module `base_layer` instead and `weight`/`bias` are None;
    after ao.nf4 `weight` is a frozen torchao NF4Tensor (under FSDP possibly with rows appended, which the forward
    drops). A one-part layer is a `litgpt.moe.AdaptedLinear`, what the
    mixture-of-experts kernels read from an adapted expert.
    """

    def __init__(
        self,
        base: nn.Linear,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        parts: Optional[dict[str, tuple[int, int]]] = None,
    ) -> None:
        if type(base) is not nn.Linear:
            raise TypeError(f"LoRA wraps a plain nn.Linear, got {type(base).__name__} (add LoRA before quantizing).")
        # An nn.Linear without nn.Linear's own initialization: it takes over the base's parameters (ties included).
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self.r = r
        self.alpha = alpha
        self.scaling = alpha / r
        self.merged = False
        self.adapters_on = True  # False while `adapters_disabled` runs the base model alone (a DPO reference)
        if parts is None:
            parts = {"": (0, base.out_features)}
        self.lora_parts: tuple[tuple[str, int, int], ...] = tuple(
            sorted(((suffix, start, stop) for suffix, (start, stop) in parts.items()), key=lambda part: part[1])
        )
        for suffix, start, stop in self.lora_parts:
            if not 0 <= start < stop <= base.out_features:
                raise ValueError(f"LoRA part {suffix!r} rows [{start}, {stop}) do not fit {base.out_features} rows")
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        for suffix, start, stop in self.lora_parts:
            self.register_parameter(f"lora_A{suffix}", nn.Parameter(torch.empty(r, base.in_features, **factory)))
            self.register_parameter(f"lora_B{suffix}", nn.Parameter(torch.empty(stop - start, r, **factory)))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if not base.weight.is_meta:
            self.reset_lora_parameters()

    def extra_repr(self) -> str:
        parts = ", ".join(f"{s or 'all'}[{a}:{b}]" for s, a, b in self.lora_parts)
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}, parts=({parts})"

    # ---- parameters -------------------------------------------------------------------------------------------------
    def lora_factors(self) -> Iterator[tuple[str, int, int, nn.Parameter, nn.Parameter]]:
        """(suffix, row start, row stop, A, B) for every part."""
        for suffix, start, stop in self.lora_parts:
            yield suffix, start, stop, getattr(self, f"lora_A{suffix}"), getattr(self, f"lora_B{suffix}")

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """A Kaiming-uniform (as nn.Linear, a=sqrt(5)), B zero: the update starts at exactly zero.

        Factors still on the meta device are first materialized beside the base weight (its device and dtype);
        while the base weight itself is on meta the factors stay there, drawn on meta all the same (where a caller
        keeps the random stream going, as expert parallelism does for other ranks' experts).
        """
        device, dtype = self._base_placement()
        for suffix, _, _, a, b in self.lora_factors():
            for name, param in ((f"lora_A{suffix}", a), (f"lora_B{suffix}", b)):
                if param.is_meta and device.type != "meta":
                    fresh = torch.empty(param.shape, device=device, dtype=dtype)
                    setattr(self, name, nn.Parameter(fresh, requires_grad=param.requires_grad))
            a, b = getattr(self, f"lora_A{suffix}"), getattr(self, f"lora_B{suffix}")
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            nn.init.zeros_(b)
        self.merged = False

    def _base_placement(self) -> tuple[torch.device, torch.dtype]:
        """Device and dtype for the adapters: those of the base weight (of the first adapter once quantized)."""
        if self.weight is not None and self.weight.is_floating_point():
            return self.weight.device, self.weight.dtype
        _, _, _, a, _ = next(self.lora_factors())
        base = self._modules.get("base_layer")
        device = base.weight.device if base is not None and base.weight is not None else a.device
        return device, a.dtype

    def delta_weight(self) -> torch.Tensor:
        """The update scaling * B @ A as an (out_features, in_features) float32 matrix (zero rows where no part)."""
        _, _, _, a0, _ = next(self.lora_factors())
        delta = torch.zeros(self.out_features, self.in_features, device=a0.device, dtype=torch.float32)
        for _, start, stop, a, b in self.lora_factors():
            delta[start:stop] = (b.float() @ a.float()) * self.scaling
        return delta

    # ---- forward ----------------------------------------------------------------------------------------------------
    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self._modules.get("base_layer")
        if base is not None:
            return base(x)
        return linear_of_rows(x, self.weight, self.bias, self.out_features)

    @property
    def applies_update(self) -> bool:
        """Whether the forward adds the low-rank update: not once it is merged into the weight, nor while switched
        off."""
        return self.adapters_on and not self.merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_forward(x)
        if not self.applies_update:
            return out
        low_rank, b_all = self.low_rank(x)
        return out + F.linear(low_rank, b_all).to(out.dtype)

    def low_rank(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The update as two factors, update = low_rank @ b_all.T: low_rank = dropout(x) @ A.T * scaling (r columns
        per part, `adapter_input`) and b_all every part's B over the rows it writes (a chunked loss multiplies by
        b_all itself)."""
        rows = [(start, stop, b) for _, start, stop, _, b in self.lora_factors()]
        return self.adapter_input(x), stacked_rows(rows, self.out_features, self.r)

    def adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        """dropout(x) @ A.T * scaling, every part's A stacked: one matmul for all of them."""
        factors = [a for _, _, _, a, _ in self.lora_factors()]
        a_all = factors[0] if len(factors) == 1 else torch.cat(factors, dim=0)
        h = self.lora_dropout(x).to(a_all.dtype)
        return F.linear(h, a_all) * self.scaling

    # ---- merging ----------------------------------------------------------------------------------------------------
    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B @ A in the base weight's dtype, as a new tensor (the layer is not changed)."""
        self._check_mergeable()
        if self.merged:
            return self.weight.detach().clone()
        return (self.weight.detach().float() + self.delta_weight().to(self.weight.device)).to(self.weight.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Add the update into the base weight in place; the adapters are then skipped in `forward`."""
        self._check_mergeable()
        if self.merged:
            return
        self.weight.copy_(self.merged_weight())
        self.merged = True

    def _check_mergeable(self) -> None:
        if self.weight is None or is_nf4(self.weight):
            raise UserError("LoRA adapters cannot be merged into a quantized base weight; merge with the float base.")
        if self.weight.is_meta:
            raise RuntimeError("The base weight is on the meta device: load the base weights before merging.")


def stacked_rows(parts: list[tuple[int, int, torch.Tensor]], rows: int, r: int) -> torch.Tensor:
    """The B factors `parts` ((row start, row stop, B) each, in row order) as one (rows, r * len(parts)) matrix: part
    i's B in columns [i * r, (i + 1) * r) of the rows it writes, zero elsewhere, so one matmul applies every part and
    each writes only its own rows."""
    start, stop, b = parts[0]
    if len(parts) == 1 and start == 0 and stop == rows:
        return b
    width = r * len(parts)
    blocks, row = [], 0
    for index, (start, stop, b) in enumerate(parts):
        if start > row:
            blocks.append(b.new_zeros(start - row, width))
        blocks.append(F.pad(b, (index * r, width - (index + 1) * r)))
        row = stop
    if row < rows:
        blocks.append(b.new_zeros(rows - row, width))
    return torch.cat(blocks, dim=0)


# ---- applying LoRA to a GPT ------------------------------------------------------------------------------------------
def add_lora(model: "GPT", settings: LoRASettings) -> None:
    """Swap the targeted linear layers of `model` for `LoRALinear` in place (works on the meta device too).

    Targets: the q/k/v rows of each `attn.qkv` (per switch) or latent attention's projections (LATENT_SWITCHES),
    `attn.proj`, every `nn.Linear` of each MLP (all experts of a mixture; never the router `gate`) and `lm_head`.
    """
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise RuntimeError("The model already has LoRA adapters.")
    config = model.config
    if settings.head and config.tie_embeddings:
        raise UserError(
            "lora_head cannot be used with a model whose output head is tied to its embeddings (tie_embeddings): "
            "the merged head would change the embeddings too. Set lora_head to false."
        )
    kwargs = dict(r=settings.r, alpha=settings.alpha, dropout=settings.dropout)
    q_rows = config.n_head * config.head_size
    kv_rows = config.n_query_groups * config.head_size
    rows = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
    enabled = {"q": settings.query, "k": settings.key, "v": settings.value}
    qkv_parts = {f"_{p}": rows[p] for p in QKV_PARTS if enabled[p]}

    for block in model.transformer.h:
        attn = block.attn
        if not hasattr(attn, "qkv"):  # latent attention: one switch per projection (LATENT_SWITCHES)
            for name, switch in LATENT_SWITCHES.items():
                if hasattr(attn, name) and getattr(settings, switch):
                    setattr(attn, name, LoRALinear(getattr(attn, name), **kwargs))
        elif qkv_parts:
            attn.qkv = LoRALinear(attn.qkv, parts=qkv_parts, **kwargs)
        if settings.projection and hasattr(attn, "qkv"):
            attn.proj = LoRALinear(attn.proj, **kwargs)
        if settings.mlp:
            for name, module in list(block.mlp.named_modules()):
                if type(module) is nn.Linear and name.rsplit(".", 1)[-1] != "gate":
                    _replace(block.mlp, name, LoRALinear(module, **kwargs))
    if settings.head:
        model.lm_head = LoRALinear(model.lm_head, **kwargs)


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base alone: every adapter is switched off inside the block and on again after (the
    reference model of preference optimization, without a second copy of the weights)."""
    layers = [layer for _, layer in lora_layers(model)]
    for layer in layers:
        layer.adapters_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_on = True


def is_lora_key(key: str) -> bool:
    """Whether a state-dict key or parameter name belongs to an adapter."""
    return key.rsplit(".", 1)[-1].startswith(LORA_PREFIX)


@torch.no_grad()
def init_lora_weights(model: nn.Module) -> None:
    """(Re)initialize every adapter: A Kaiming-uniform, B zero; meta factors are materialized beside their base."""
    for _, layer in lora_layers(model):
        layer.reset_lora_parameters()


def mark_only_lora_as_trainable(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad = is_lora_key(name)


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in model.named_parameters():
        if is_lora_key(name):
            yield name, param


def lora_parameter_count(model: nn.Module) -> int:
    return sum(param.numel() for _, param in lora_parameters(model))


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (detached), under their full keys: what `lit_model.pth.lora` holds."""
    return {name: param.detach() for name, param in lora_parameters(model)}


def expected_lora_shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {name: param.shape for name, param in lora_parameters(model)}


# ---- loading ---------------------------------------------------------------------------------------------------------
def load_base_weights(model: nn.Module, state_dict: dict, source: str) -> None:
    """Load a plain (un-adapted) checkpoint into an adapted model: every non-adapter key must be there, fit, and
    nothing else may be; the first mismatch is a UserError. Adapters are left as they are. On a meta model the
    checkpoint's tensors are assigned (no copy); call `init_lora_weights` afterwards to materialize the adapters."""
    assign_weights(model, state_dict, source, lambda key: not is_lora_key(key))


def load_lora_weights(model: nn.Module, adapters: dict, source: str) -> None:
    """Copy adapter tensors (a `lora_state_dict`) into an adapted model; they must match its adapters exactly."""
    check_weights_match(
        expected_lora_shapes(model), adapters, source, subject="The LoRA adapters",
        fix="Check the lora_* hyperparameters (e.g. lora_r) and the base checkpoint.",
    )
    params = dict(lora_parameters(model))
    with torch.no_grad():
        for key, tensor in adapters.items():
            param = params[key]
            if param.is_meta:
                owner, _, name = key.rpartition(".")
                fresh = nn.Parameter(tensor.detach().clone(), requires_grad=param.requires_grad)
                setattr(model.get_submodule(owner), name, fresh)
            else:
                param.copy_(tensor)
    for _, layer in lora_layers(model):
        layer.merged = False


def adapters_from_litgpt(adapters: dict, config, settings: LoRASettings, source: str) -> dict:
    """Adapter tensors in our names. LitGPT 0.5 keeps one `attn.qkv.lora_A` (r rows per enabled part, q then k then
    v) and one `lora_B` (the enabled parts' output rows, stacked) where we keep a pair per part; every other key is
    the same. Pre-0.5 `attn.attn.lora_*` factors are refused: their rows follow the old interleaved layout."""
    if any(".attn.attn.lora_" in key for key in adapters):
        raise UserError(f"{source} holds pre-0.5 LitGPT adapters (attn.attn.lora_* keys): merge them with the "
                        "LitGPT version that wrote them (`litgpt merge_lora`) and use its merged lit_model.pth.")
    rows = {"q": config.n_head * config.head_size, "k": config.n_query_groups * config.head_size,
            "v": config.n_query_groups * config.head_size}
    parts = [part for part, on in zip(QKV_PARTS, (settings.query, settings.key, settings.value)) if on]
    result = {}
    for key, tensor in adapters.items():
        prefix, _, name = key.rpartition(".")
        if not prefix.endswith("attn.qkv") or name not in ("lora_A", "lora_B"):
            result[key] = tensor
            continue
        sizes = [settings.r] * len(parts) if name == "lora_A" else [rows[part] for part in parts]
        if tensor.ndim != 2 or tensor.shape[0] != sum(sizes):
            raise UserError(f"The LoRA adapters in {source} do not match the model config: {key} has shape "
                            f"{tuple(tensor.shape)}. Check the lora_* hyperparameters and the base checkpoint.")
        for part, piece in zip(parts, tensor.split(sizes)):
            result[f"{prefix}.{name}_{part}"] = piece
    return result


# ---- merging ---------------------------------------------------------------------------------------------------------
def merge_lora_weights(model: nn.Module) -> None:
    """Add every adapter's update into its base weight in place (W += alpha / r * B @ A, per part).

    Afterwards the adapters are skipped in forward and the non-adapter state equals that of a plain GPT.
    """
    for _, layer in lora_layers(model):
        layer.merge()


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the equivalent plain GPT: merged weights under the plain keys, no adapter keys.

    The model is not changed; only the adapted weights are new tensors, every other entry is the model's own.
    """
    merged = {f"{name}.weight" if name else "weight": layer.merged_weight() for name, layer in lora_layers(model)}
    return {key: merged.get(key, value) for key, value in model.state_dict().items() if not is_lora_key(key)}

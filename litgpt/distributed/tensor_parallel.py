"""Tensor parallelism (with sequence parallelism for training, without it for generation) of a model built on the
meta device: the family's plan (`litgpt.distributed.plans`) applied with `parallelize_module` over the mesh's "tensor" dimension, entry by entry, the
fused qkv rows permuted so each rank holds its own heads, and the attention told its local head counts.

Checkpoints stay in the one-process layout: `row_orders` names the parameters stored permuted, and
`litgpt.distributed.dtensor` permutes what is copied in and un-permutes what is gathered.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from litgpt.distributed.plans import check_tensor_parallel
from litgpt.distributed.plans.dense import (
    INFERENCE_MODEL_PLAN, MODEL_PLAN, block_plan, inference_block_plan, qkv_row_order,
)
from litgpt.model import CausalSelfAttention
from litgpt.moe import LLaMAMoE


def apply_tensor_parallel(model: nn.Module, mesh, sequence_parallel: bool = True, pad_sequences: bool = True) -> None:
    """Split `model` (a `GPT` on the meta device, or a pipeline stage of one: the embedding, final norm and head where
    it holds them) over the 1-D `mesh` of its tensor-parallel group, in place. `pad_sequences`: its forward pads the
    sequences to a multiple of the degree (`padded_to_multiple`); a pipeline stage's batches come padded.

    `sequence_parallel` False: generation's plan (`inference_block_plan`), whose activations are whole
    on every rank between the layers, so that a single decoding position runs; its norms stay plain tensors, the
    same on each rank.
    """
    config, degree = model.config, mesh.size()
    check_tensor_parallel(config, degree)
    # PyTorch's SequenceParallel registers the norms' weights anew, trainable: a frozen base (LoRA, a teacher) keeps
    # its own setting.
    trains = {name: param.requires_grad for name, param in model.named_parameters()}
    # A pipeline stage holds the embedding or the head, each its own parameter (`TiedEmbedding`): no tie to keep.
    head, parts = getattr(model, "lm_head", None), model.transformer
    tied = head is not None and "wte" in parts and head.weight is parts.wte.weight
    for block in model.transformer.h:
        plan = (block_plan if sequence_parallel else inference_block_plan)(config, isinstance(block.mlp, LLaMAMoE))
        for name, style in plan:
            if placeable(block, name):
                parallelize_module(block, mesh, {name: style})
        block.attn.n_head = config.n_head // degree
        if isinstance(block.attn, CausalSelfAttention):
            block.attn.n_query_groups = config.n_query_groups // degree
    for name, style in MODEL_PLAN if sequence_parallel else INFERENCE_MODEL_PLAN:
        if placeable(model, name):
            parallelize_module(model, mesh, {name: style})
    if tied:  # both Shard(0) over the vocabulary: the head takes the embedding's sharded weight
        model.lm_head.weight = model.transformer.wte.weight
    # The split model's output (the final norm's or the head's) is `DTensor.to_local()`'s view, which FSDP2 warns of
    # at its root on every rank: an in-place op on it would skip the pre-backward hook. No caller changes a model's
    # output in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    for name, param in model.named_parameters():
        param.requires_grad_(trains[name])
    if not sequence_parallel:
        return
    if pad_sequences:
        model.forward = padded_to_multiple(model, model.forward, degree)
    left = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if left:  # every parameter must live on the tensor mesh: the gradient norm adds them up together
        raise RuntimeError(f"The tensor-parallel plan leaves {left[0]} (and {len(left) - 1} more) unplaced.")


def padded_to_multiple(model: nn.Module, forward: Callable, degree: int) -> Callable:
    """`GPT.forward` on sequences padded at their end to a multiple of `degree` (sequence parallelism splits the
    positions evenly over the group) and its output cut back to the given length: causal attention keeps the padding
    out of every real position, and the mixture-of-experts layers leave it out of their load-balancing statistics
    (`counted_positions`). Packed samples' positions go on counting, so the padding joins the last sample."""
    moe_layers = [module for module in model.modules() if isinstance(module, LLaMAMoE)]

    def padded_forward(idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        length = idx.size(1)
        pad = -length % degree
        if pad == 0 or input_pos is not None:
            return forward(idx, input_pos, **kwargs)
        idx = F.pad(idx, (0, pad))
        positions = kwargs.get("sample_positions")
        if positions is not None:
            steps = torch.arange(1, pad + 1, device=positions.device, dtype=positions.dtype)
            kwargs["sample_positions"] = torch.cat((positions, positions[:, -1:] + steps), dim=1)
        for layer in moe_layers:
            layer.counted_positions = length
        try:
            return forward(idx, **kwargs)[:, :length]
        finally:
            for layer in moe_layers:
                layer.counted_positions = None

    return padded_forward


def placeable(parent: nn.Module, name: str) -> bool:
    """Whether `parent` has a module `name` that the plan should place: identity norms have nothing to split, a
    pipeline stage holds the model's ends or not."""
    try:
        module = parent.get_submodule(name)
    except AttributeError:
        return False
    return not isinstance(module, nn.Identity)


def row_orders(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of `model` stored with permuted rows, by state-dict key: `order[i]` is the checkpoint's row
    stored at row i (the fused qkv under tensor parallelism); empty for a model that is not split."""
    orders = {}
    for name, module in model.named_modules():
        if isinstance(module, CausalSelfAttention) and module.n_head != module.config.n_head:
            order = qkv_row_order(module.config, module.config.n_head // module.n_head)
            # The base's rows only: LoRA's B factors are split part by part (`litgpt.distributed.plans.styles`).
            for param_name in ("weight", "bias"):
                if getattr(module.qkv, param_name, None) is not None:
                    orders[f"{name}.qkv.{param_name}"] = order
    return orders

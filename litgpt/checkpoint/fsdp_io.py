"""`CheckpointIO` for a model on one device or sharded by FSDP2: whole tensors gathered from DTensors for full
checkpoints, torch.distributed.checkpoint for sharded ones (resharded to any world size on load). Under expert
parallelism a full checkpoint still holds every expert under its one-process name, gathered from the ranks owning
them, and each rank reads its own experts back; in a sharded one each rank writes and reads its own experts under
those names, so either resumes on any mesh. Under pipeline parallelism every stage's weights and optimizer state are
gathered to rank zero the same way, and each rank reads its own stages back."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from litgpt.checkpoint.interface import KeySelector
from litgpt.checkpoint.manager import unwrap
from litgpt.checkpoint.model_files import copy_weights
from litgpt.checkpoint.sharded_reader import load_sharded_state
from litgpt.checkpoint.store import SHARDED_DIR
from litgpt.distributed.dtensor import copy_into_shard, gather_full
from litgpt.distributed.expert_parallel import (
    expert_group,
    expert_peers,
    gather_across_experts,
    held_elsewhere,
    in_one_process_order,
    one_process_param_groups,
)
from litgpt.distributed.pipeline import pipeline_of
from litgpt.distributed.runtime import is_rank_zero
from litgpt.distributed.tensor_parallel import row_orders
from litgpt.io import read_sharded_metadata


class FSDPCheckpointIO:
    """The core's implementation of `litgpt.checkpoint.interface.CheckpointIO`."""

    def __init__(self, sharding_strategy: str = "none", state_dict_type: str = "full",
                 options: "dict | None" = None) -> None:
        self.sharding_strategy = sharding_strategy
        self.state_dict_type = state_dict_type
        self.options = options

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        tie = getattr(unwrap(model), "tie", None)  # a pipeline's tied embedding: a copy of the head
        return list(model.parameters()) if tie is None else tie.optimized(list(model.parameters()))

    def gather_weights(self, model: nn.Module, select: KeySelector) -> dict:
        gathered, orders = {}, row_orders(unwrap(model))
        peers, group = expert_peers(unwrap(model)), expert_group(unwrap(model))
        collects = collecting(unwrap(model))
        for key, value in model.state_dict().items():
            if select(key):
                full = gather_full(value, orders.get(key)).detach()
                for name, tensor in gather_across_experts(key, full, peers, group).items():
                    if collects:
                        gathered[name] = tensor.cpu()
        if pipeline_of(unwrap(model)) is not None:  # every stage's weights to rank zero
            return unwrap(model).gather_weights(gathered)
        return in_one_process_order(gathered, unwrap(model))

    def gather_optimizer_state(self, model: nn.Module, optimizer) -> dict:
        peers, pipelined = expert_peers(unwrap(model)), pipeline_of(unwrap(model)) is not None
        if peers or pipelined:  # tensor by tensor, experts from their owners; a pipeline's then from every stage
            state = gather_optimizer_state_by_tensor(model, optimizer, peers, expert_group(unwrap(model)))
            return unwrap(model).gather_optimizer_state(state) if pipelined else state

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(model, optimizer, options=options)
        return reorder_rows(state, row_orders(unwrap(model)), to_stored=False)

    def copy_weights(self, model: nn.Module, state_dict: dict, source: str, select: KeySelector) -> None:
        copy_weights(model, state_dict, source, select, row_orders=row_orders(unwrap(model)),
                     held_elsewhere=held_elsewhere(unwrap(model)))

    def load_optimizer_state(self, model: nn.Module, optimizer, state: dict) -> None:
        state = without_keys(state, held_elsewhere(unwrap(model)))

        state = reorder_rows(state, row_orders(unwrap(model)), to_stored=True)
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    @staticmethod
    def sharded_state(model: nn.Module, optimizer, select: KeySelector) -> dict:
        """This rank's shards of the selected weights and of the optimizer state, as torch.distributed.checkpoint
        reads and writes them: rows stored permuted (tensor parallelism's fused qkv) at their checkpoint positions,
        each expert under its one-process name (expert parallelism: a rank holds its own experts, FSDP-sharded over
        the ranks holding the same ones) and the optimizer's groups listing every parameter, so the checkpoint is the
        one-process layout, for any world size and tensor-, expert- and context-parallel degree."""

        weights = {key: value for key, value in get_model_state_dict(model).items() if select(key)}
        orders = row_orders(unwrap(model))
        weights = {key: reorder(value, orders[key], to_stored=False) if key in orders else value
                   for key, value in weights.items()}
        optimizer_state = reorder_rows(get_optimizer_state_dict(model, optimizer), orders, to_stored=False)
        peers = expert_peers(unwrap(model))
        if peers:  # saved once for all ranks: the whole list, not the first rank's experts
            optimizer_state["param_groups"] = one_process_param_groups(optimizer_state["param_groups"], peers,
                                                                       unwrap(model))
        return {"model": weights, "optimizer": optimizer_state}

    def save_sharded(self, folder: Path, model: nn.Module, optimizer, select: KeySelector) -> None:

        dcp.save(self.sharded_state(model, optimizer, select), checkpoint_id=Path(folder) / SHARDED_DIR)

    def load_sharded(self, folder: Path, model: nn.Module, optimizer, select: KeySelector) -> None:

        path = Path(folder) / SHARDED_DIR
        metadata = read_sharded_metadata(path)  # refuses a planted pickle; the reader reuses it
        state = self.sharded_state(model, optimizer, select)
        load_sharded_state(state, path, metadata, hint="Check that the model config and the fine-tuning settings "
                           "(e.g. lora_r) are those of the run that saved it.")
        orders = row_orders(unwrap(model))
        weights = {key: reorder(value, orders[key], to_stored=True) if key in orders else value
                   for key, value in state["model"].items()}
        set_model_state_dict(model, weights, options=StateDictOptions(strict=False))
        set_optimizer_state_dict(model, optimizer, reorder_rows(state["optimizer"], orders, to_stored=True))


def collecting(model: nn.Module) -> bool:
    """Whether this rank keeps the full tensors it gathers for a full checkpoint: rank zero, or under pipeline
    parallelism each pipeline rank's first data-parallel rank (it hands them on to rank zero)."""
    pipeline = pipeline_of(model)
    return is_rank_zero() if pipeline is None else pipeline.collects


def gather_optimizer_state_by_tensor(model: nn.Module, optimizer, peers: dict, group) -> dict:
    """The full optimizer state (keyed by parameter name) on the collecting rank (`collecting`): this rank's sharded
    state gathered tensor by tensor, under expert parallelism each expert's from the rank of the expert group that
    owns it (`peers`); {} on the other ranks."""
    sharded = get_optimizer_state_dict(model, optimizer)
    collects = collecting(unwrap(model))
    state: dict = {}
    for key, values in sharded["state"].items():  # the same order on every rank: the optimizer's parameters'
        for name, value in values.items():
            full = gather_full(value).detach() if torch.is_tensor(value) else value
            pieces = gather_across_experts(key, full, peers, group) if torch.is_tensor(full) else {
                peer: full for peer in peers.get(key, [key])}
            if collects:
                for peer, tensor in pieces.items():
                    state.setdefault(peer, {})[name] = tensor.cpu() if torch.is_tensor(tensor) else tensor
    groups = one_process_param_groups(sharded["param_groups"], peers, unwrap(model))
    return {"state": in_one_process_order(state, unwrap(model)), "param_groups": groups} if collects else {}


def without_keys(optimizer_state: dict, elsewhere: dict) -> dict:
    """A full optimizer state without the parameters other ranks hold (`elsewhere`: other ranks' experts)."""
    if not elsewhere:
        return optimizer_state
    state = {key: value for key, value in optimizer_state.get("state", {}).items() if key not in elsewhere}
    groups = [{**group, "params": [key for key in group["params"] if key not in elsewhere]}
              for group in optimizer_state.get("param_groups", [])]
    return {**optimizer_state, "state": state, "param_groups": groups}


def reorder_rows(optimizer_state: dict, orders: dict, to_stored: bool) -> dict:
    """A full optimizer state dict (keyed by parameter name) with the per-parameter tensors of the parameters stored
    with permuted rows (`orders`) put into their stored order (`to_stored`) or back into the checkpoint's."""
    if not orders:
        return optimizer_state
    state = dict(optimizer_state.get("state", {}))
    for key, order in orders.items():
        if key in state:
            state[key] = {name: reorder(value, order, to_stored) for name, value in state[key].items()}
    return {**optimizer_state, "state": state}


def reorder(value, order, to_stored: bool):
    """`value` (a whole tensor, or a DTensor: collective) with its rows put into their stored order (`to_stored`) or
    back into the checkpoint's; a DTensor stays split as it was, each rank keeping its piece of the reordered whole."""
    if not torch.is_tensor(value) or value.dim() == 0 or value.size(0) != order.numel():
        return value  # a step count
    if isinstance(value, DTensor):
        reordered = torch.empty_like(value)
        if to_stored:
            copy_into_shard(reordered, value.full_tensor(), order)
        else:
            copy_into_shard(reordered, gather_full(value, order))
        return reordered
    if to_stored:
        return value[order]
    restored = torch.empty_like(value)
    restored[order] = value
    return restored

"""Lightning Fabric strategies that compile the model with Thunder and train it on several processes.

`ThunderFSDPStrategy` shards every parameter over the processes with `thunder.distributed.fsdp` (ZeRO-2 or ZeRO-3,
with the collectives bucketed per block, per layer or not at all, as far as the installed thunder applies it: 0.2.6
does not, see the README); `ThunderDDPStrategy` replicates the model with
`thunder.distributed.ddp`. Both start and connect the processes as Lightning's DDP strategy does (NCCL on GPUs, gloo
on CPUs) and compile the module in `setup_module` (`thunder.jit`, then the distributed transform), so they plug into
`fabric.setup` and litgpt's shared training loop unchanged. `ThunderSingleDeviceStrategy` compiles for one device.
Each implements `litgpt.registry.ExtensionStrategy`: its checkpoint IO, the loss on whole logits, an eager model to
sample text with.

Thunder is imported only when a strategy sets up a module, so building one (and checking its options) needs no
thunder.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn

from extensions.thunder.eager import clean_before_every_trace, eager_copy, full_weights
from litgpt.checkpoint.fsdp_io import FSDPCheckpointIO
from litgpt.errors import UserError
from litgpt.distributed.fsdp import ReduceEveryMicroBatch

SHARDING_STRATEGIES = ("ZERO3", "ZERO2")
BUCKETING_STRATEGIES = ("BLOCK", "LAYER", "NONE")
STATE_DICT_TYPES = ("full", "sharded")
# litgpt's loop applies the output head chunk by chunk outside the model (`litgpt.train.loss.model_loss`); the compiled
# module runs as one trace whose parameters (thunder's shards) the head outside it cannot reach, so its loss takes the
# whole logits the module returns.
LOSS_ON_LOGITS = True


def check_choice(option: str, value, choices: Sequence[str]) -> str:
    name = getattr(value, "name", value)  # thunder's enums (FSDPType.ZERO3) or their names
    if name not in choices:
        raise UserError(f"{option} {value!r} is not one of {', '.join(choices)}.")
    return name


def default_executors(device: torch.device) -> Optional[list[str]]:
    """Thunder's own defaults on a GPU (nvFuser, cuDNN, SDPA where installed); on a CPU, where those do not run,
    the executors that do: SDPA and plain torch."""
    return None if device.type == "cuda" else ["sdpa", "torch"]


def compile_module(module: nn.Module, jit: bool, executors, device: torch.device, strategy: str):
    """The module compiled by `thunder.jit` (jit=True), or the ThunderModule that was passed in (jit=False)."""
    from extensions.thunder.compat import import_thunder

    thunder, _ = import_thunder()
    from thunder.core.module import ThunderModule

    if isinstance(module, ThunderModule):
        if jit:
            raise UserError(f"{strategy}(jit=True) compiles the module itself; it was given one already compiled "
                            "with thunder.jit: pass the plain module, or jit=False.")
        return module
    if not jit:
        raise UserError(
            f"{strategy}(jit=False) needs a module already compiled with thunder.jit (its distributed transform "
            f"applies to a compiled module), got {type(module).__name__}: pass jit=True to let the strategy compile "
            "it, or thunder.jit(model) to fabric.setup."
        )
    return thunder.jit(module, executors=executors if executors is not None else default_executors(device))


def sampling_model(compiled: nn.Module, gather: Callable[[str, torch.Tensor], torch.Tensor]) -> nn.Module:
    """What litgpt's loop samples text with (`strategy.sampling_model`, see `litgpt.registry.ExtensionStrategy`): an eager
    module of the original's class holding the compiled module's current weights, `gather(name, local)` making each
    full. The compiled module cannot decode (it is traced for whole sequences, not for KV-cache steps) and, under
    FSDP, the original module holds meta tensors."""
    weights = full_weights(dict(compiled.named_parameters(remove_duplicate=False)), gather)
    return eager_copy(compiled._model, weights)


class ThunderSingleDeviceStrategy(SingleDeviceStrategy):
    """One device: the model compiled by `thunder.jit`, nothing distributed."""

    litgpt_loss_on_logits = LOSS_ON_LOGITS

    def __init__(self, jit: bool = True, executors: Optional[Sequence[str]] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.jit = jit
        self.executors = list(executors) if executors is not None else None
        self.compiled: Optional[nn.Module] = None  # set up by setup_module
        # The compiled module keeps the plain module's parameter names: one device's checkpoints as without Thunder.
        self.litgpt_checkpoint_io = FSDPCheckpointIO()

    def setup_module(self, module: nn.Module) -> nn.Module:
        compiled = compile_module(module, self.jit, self.executors, self.root_device, type(self).__name__)
        clean_before_every_trace(compiled)
        self.compiled = compiled
        return compiled

    def sampling_model(self, module: nn.Module) -> nn.Module:
        """An eager module for litgpt's KV-cache decoding that shares the compiled module's weights (no copy)."""
        return sampling_model(self.compiled, lambda name, local: local)


class ThunderDDPStrategy(DDPStrategy):
    """Data parallel with Thunder: every process holds the whole model; rank 0's weights are broadcast at setup and
    the gradients are all-reduced in buckets of `bucket_size_in_mb` inside thunder's backward trace."""

    litgpt_loss_on_logits = LOSS_ON_LOGITS

    def __init__(
        self,
        jit: bool = True,
        executors: Optional[Sequence[str]] = None,
        bucket_size_in_mb: float = 25.0,
        timeout: Union[float, timedelta] = 600.0,
        **kwargs,
    ) -> None:
        super().__init__(timeout=as_timedelta(timeout), **kwargs)
        self.jit = jit
        self.executors = list(executors) if executors is not None else None
        self.bucket_size_in_mb = bucket_size_in_mb
        self.litgpt_checkpoint_io: Optional[ThunderShards] = None  # set up with the module, for litgpt's checkpoints
        # Thunder's traces carry the collectives; skipping them during accumulation needs a second trace per
        # micro-batch kind, so the gradients are reduced after every micro-batch.
        self._backward_sync_control = ReduceEveryMicroBatch()

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = compile_module(module, self.jit, self.executors, self.root_device, type(self).__name__)
        from thunder.distributed import ddp  # importable once compile_module has imported thunder

        replicated = ddp(module, broadcast_from=0, bucket_size_in_mb=self.bucket_size_in_mb)
        # The transform gives the compiled module parameters of its own: those are the ones that train.
        full_shapes = {name: p.shape for name, p in replicated.named_parameters(remove_duplicate=False)}
        self.litgpt_checkpoint_io = ThunderShards(replicated, full_shapes, "DDP", "full", self.options(),
                                                  sharded=False)
        clean_before_every_trace(replicated)
        return replicated

    def sampling_model(self, module: nn.Module) -> nn.Module:
        """An eager module for litgpt's KV-cache decoding that shares this rank's replica of the weights (no copy,
        no collective)."""
        return self.litgpt_checkpoint_io.sampling_model()

    def options(self) -> dict:
        return {"strategy": "ddp", "jit": self.jit, "executors": self.executors,
                "bucket_size_in_mb": self.bucket_size_in_mb, "timeout": self._timeout.total_seconds()}


class ThunderFSDPStrategy(DDPStrategy):
    """Fully sharded data parallel with Thunder.

    Args:
        sharding_strategy: ZERO3 gathers each parameter for its use in the forward and again in the backward pass;
            ZERO2 keeps it gathered from the forward to the backward (fewer all-gathers, more memory). Both keep
            1/world of every parameter, gradient and optimizer state at rest.
        bucketing_strategy: how many parameters one all-gather / reduce-scatter carries: BLOCK one per transformer
            block, LAYER one per layer (linear, norm, embedding), NONE one per parameter.
        state_dict_type: full: rank 0 writes one lit_model.pth; sharded: every rank writes its shards
            (torch.distributed.checkpoint, which `litgpt consolidate` and the plain entry points read).
        jit: compile the module with thunder.jit in `fabric.setup` (False: the module given is compiled already).
        executors: thunder executors by name (default: thunder's on a GPU; sdpa and torch on a CPU).
        timeout: seconds a collective may wait for the other ranks.
    """

    litgpt_loss_on_logits = LOSS_ON_LOGITS

    def __init__(
        self,
        sharding_strategy: str = "ZERO3",
        bucketing_strategy: str = "BLOCK",
        state_dict_type: str = "full",
        jit: bool = True,
        executors: Optional[Sequence[str]] = None,
        timeout: Union[float, timedelta] = 600.0,
        **kwargs,
    ) -> None:
        self.sharding_strategy = check_choice("sharding_strategy", sharding_strategy, SHARDING_STRATEGIES)
        self.bucketing_strategy = check_choice("bucketing_strategy", bucketing_strategy, BUCKETING_STRATEGIES)
        self.state_dict_type = check_choice("state_dict_type", state_dict_type, STATE_DICT_TYPES)
        super().__init__(timeout=as_timedelta(timeout), **kwargs)
        self.jit = jit
        self.executors = list(executors) if executors is not None else None
        self._backward_sync_control = ReduceEveryMicroBatch()  # a skipped reduce-scatter would need whole grads
        self.litgpt_checkpoint_io: Optional[ThunderShards] = None  # set up with the module, for litgpt's checkpoints

    def setup_module(self, module: nn.Module) -> nn.Module:
        compiled = compile_module(module, self.jit, self.executors, self.root_device, type(self).__name__)
        from thunder.distributed import FSDPBucketingStrategy, FSDPType, fsdp  # importable once thunder is

        full_shapes = {name: p.shape for name, p in compiled.named_parameters(remove_duplicate=False)}
        sharded = fsdp(
            compiled,
            device=self.root_device,
            sharding_strategy=FSDPType[self.sharding_strategy],
            bucketing_strategy=FSDPBucketingStrategy[self.bucketing_strategy],
        )
        # The shards live in the compiled module; the original keeps meta tensors of the full shapes, which thunder
        # traces. litgpt takes the parameters to optimize and the checkpoint functions from `litgpt_checkpoint_io`.
        self.litgpt_checkpoint_io = ThunderShards(sharded, full_shapes, self.sharding_strategy,
                                                  self.state_dict_type, self.options(), sharded=True)
        self.litgpt_checkpoint_io.zero_padding()
        clean_before_every_trace(sharded)
        return sharded

    def sampling_model(self, module: nn.Module) -> nn.Module:
        """An eager module for litgpt's KV-cache decoding with the full weights, all-gathered: collective, every rank
        calls it and gets the same model (which it drops after sampling)."""
        return self.litgpt_checkpoint_io.sampling_model()

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        """Clip by the norm of the whole gradient: every rank holds a disjoint piece of it."""
        self.precision.unscale_gradients(optimizer)
        parameters = [p for p in self.precision.main_params(optimizer) if p.grad is not None]
        if float(norm_type) != 2.0:
            raise UserError("ThunderFSDPStrategy clips gradients by their 2-norm only (norm_type=2).")
        grads = [p.grad for p in parameters]
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=self.root_device)
        squared = local.float().pow(2)
        torch.distributed.all_reduce(squared)
        total = squared.sqrt()
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of the gradients is {total.item()}: not finite.")
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total

    def options(self) -> dict:
        return {"strategy": "fsdp", "sharding_strategy": self.sharding_strategy,
                "bucketing_strategy": self.bucketing_strategy, "state_dict_type": self.state_dict_type,
                "jit": self.jit, "executors": self.executors, "timeout": self._timeout.total_seconds()}


def as_timedelta(timeout: Union[float, timedelta]) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


# ---- checkpoints of a thunder-sharded model -------------------------------------------------------------------------
class ThunderShards:
    """The parameters, and full and sharded checkpoints in litgpt's formats, of a model that thunder's FSDP sharded
    (or its DDP replicated: `sharded=False`, every rank holds everything).

    thunder splits every parameter along its first dimension into world-size chunks of ceil(rows / world) rows, the
    last ones padded. A full checkpoint gathers the chunks on rank 0; a sharded one writes each rank's rows as a
    DTensor piece with torch.distributed.checkpoint, so `litgpt consolidate`, `generate` and a resumed run of the
    plain entry points (any world size) read it as one of their own. It implements
    `litgpt.checkpoint.interface.CheckpointIO` (the strategy's `litgpt_checkpoint_io`, which litgpt's checkpoint
    manager uses); the `model` argument of its methods, the original module, holds meta tensors only, so they read the
    shards of `module` instead.
    """

    def __init__(self, module: nn.Module, full_shapes: dict, sharding_strategy: str, state_dict_type: str,
                 options: dict, sharded: bool) -> None:
        import torch.distributed as dist

        self.module = module  # the compiled ThunderModule, which holds the parameters that train
        self.full_shapes = full_shapes
        self.sharding_strategy = sharding_strategy
        self.state_dict_type = state_dict_type
        self.options = options
        # This rank's part of every parameter, of how many.
        self.part, self.parts = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
        self.rank = dist.get_rank()
        self._mesh = None

    # -- the rows of a parameter this rank holds
    def rows(self, name: str) -> tuple[int, int]:
        """(first row, number of rows) of `name` that this rank holds, padding excluded."""
        total = self.full_shapes[name][0]
        chunk = -(-total // self.parts)
        start = min(total, chunk * self.part)
        return start, max(0, min(chunk, total - start))

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The shards: what the optimizer updates (`model`, the original module, holds meta tensors only)."""
        return list(self.module.parameters())

    def shards(self) -> dict[str, torch.Tensor]:
        """Every parameter name (tied ones under each of their names) with this rank's shard."""
        return dict(self.module.named_parameters(remove_duplicate=False))

    def zero_padding(self) -> None:
        """thunder pads the last rank's rows uninitialized; zeros keep them out of norms and NaN checks."""
        with torch.no_grad():
            for name, param in self.shards().items():
                param[self.rows(name)[1]:].zero_()

    @staticmethod
    def is_sharded(value: torch.Tensor, param: torch.Tensor) -> bool:
        """Whether an optimizer state tensor is laid out like its (sharded) parameter, or e.g. a step count."""
        return value.dim() > 0 and value.shape == param.shape

    def gathered(self, name: str, local: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.parts == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(self.parts)]
        dist.all_gather(pieces, local.contiguous())
        return torch.cat(pieces).narrow(0, 0, self.full_shapes[name][0])

    def mesh(self, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            self._mesh = init_device_mesh(device.type, (self.parts,))
        return self._mesh

    def as_dtensor(self, name: str, local: torch.Tensor):
        """This rank's rows of `local` as a piece of the full tensor (sharing memory with `local`); a replicated
        tensor as it is (torch.distributed.checkpoint writes it once)."""
        from torch.distributed.tensor import DTensor, Shard

        if self.parts == 1:
            return local
        shape = self.full_shapes[name]
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local[: self.rows(name)[1]], self.mesh(local.device), [Shard(0)],
                                  run_check=False, shape=shape, stride=stride)

    def parameters_in_order(self, optimizer) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) in the optimizer's order: the same on every rank, which the collectives need."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]

    def named_optimizer_state(self, optimizer, convert: Callable) -> dict:
        """The optimizer state keyed by parameter names, as torch.distributed.checkpoint.state_dict lays it out, with
        `convert(name, tensor)` applied to every sharded state tensor."""
        ordered = self.parameters_in_order(optimizer)
        state = {}
        for name, param in ordered:
            if param in optimizer.state:
                state[name] = {
                    key: convert(name, value) if self.is_sharded(value, param) else value
                    for key, value in optimizer.state[param].items()
                }
        names = {id(p): n for n, p in ordered}
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
                  for group in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_named_optimizer_state(self, optimizer, saved: dict, local_piece: Callable) -> None:
        """Load a name-keyed optimizer state; `local_piece(name, tensor)` gives this rank's shard of a state tensor."""
        ordered = self.parameters_in_order(optimizer)
        index = {name: i for i, (name, _) in enumerate(ordered)}
        state = {}
        for name, values in saved["state"].items():
            state[index[name]] = {
                key: local_piece(name, value) if value.dim() > 0 and value.shape == self.full_shapes[name] else value
                for key, value in values.items()
            }
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [index[n] for n in group["params"]]}
                  for group in saved["param_groups"]]
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def padded_piece(self, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        start, count = self.rows(name)
        piece = torch.zeros_like(like)
        piece[:count].copy_(full[start:start + count])
        return piece

    def sampling_model(self) -> nn.Module:
        """An eager module with the full weights, on every rank (a collective when sharded): see `sampling_model`."""
        return sampling_model(self.module, lambda name, local: self.gathered(name, local))

    # -- litgpt.checkpoint.interface.CheckpointIO (FSDP2's is litgpt.checkpoint.fsdp_io.FSDPCheckpointIO)
    def gather_weights(self, model: nn.Module, select: Callable[[str], bool]) -> dict:
        weights = {}
        for name, value in self.shards().items():
            if select(name):
                full = self.gathered(name, value.detach())
                if self.rank == 0:
                    weights[name] = full.cpu()
        return weights

    def gather_optimizer_state(self, model: nn.Module, optimizer) -> dict:
        return self.named_optimizer_state(optimizer, lambda name, value: self.gathered(name, value).cpu())

    def copy_weights(self, model: nn.Module, state_dict: dict, source: str, select=lambda key: True, **names) -> None:
        from litgpt.checkpoint.model_files import check_weights_match

        targets = {name: value for name, value in self.shards().items() if select(name)}
        check_weights_match({name: self.full_shapes[name] for name in targets}, state_dict, source, **names)
        with torch.no_grad():
            for name, target in targets.items():
                target.copy_(self.padded_piece(name, state_dict[name], target))

    def load_optimizer_state(self, model: nn.Module, optimizer, state: dict) -> None:
        shards = self.shards()
        self.load_named_optimizer_state(
            optimizer, state, lambda name, value: self.padded_piece(name, value, shards[name].detach()))

    def sharded_layout(self, optimizer, select: Callable[[str], bool]) -> dict:
        weights = {name: self.as_dtensor(name, value.detach()) for name, value in self.shards().items()
                   if select(name)}
        return {"model": weights, "optimizer": self.named_optimizer_state(optimizer, self.as_dtensor)}

    def save_sharded(self, folder: Path, model: nn.Module, optimizer, select: Callable[[str], bool]) -> None:
        import torch.distributed.checkpoint as dcp

        from litgpt.checkpoint.store import SHARDED_DIR

        dcp.save(self.sharded_layout(optimizer, select), checkpoint_id=Path(folder) / SHARDED_DIR)

    def load_sharded(self, folder: Path, model: nn.Module, optimizer, select: Callable[[str], bool]) -> None:
        """Read a sharded checkpoint (this strategy's or FSDP2's, any world size) into the shards, in place."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from litgpt.checkpoint.sharded_reader import load_sharded_state
        from litgpt.checkpoint.store import SHARDED_DIR
        from litgpt.io import read_sharded_metadata

        path = Path(folder) / SHARDED_DIR
        metadata = read_sharded_metadata(path)  # refuses a planted pickle, as the core does; the reader reuses it
        stored = metadata.state_dict_metadata
        params = self.shards()
        # A fresh optimizer has no state yet: hold what the checkpoint stores, laid out like the parameters.
        pieces = {name: {} for name in params}
        for key, item in stored.items():
            if key.startswith("optimizer.state.") and isinstance(item, TensorStorageMetadata):
                name, _, state_key = key[len("optimizer.state."):].rpartition(".")
                if name in params and tuple(item.size) == tuple(self.full_shapes[name]):
                    local = torch.zeros_like(params[name], dtype=item.properties.dtype)
                    pieces[name][state_key] = (local, self.as_dtensor(name, local))
                elif name in params:
                    pieces[name][state_key] = (None, torch.zeros(item.size, dtype=item.properties.dtype))
        layout = self.sharded_layout(optimizer, select)
        layout["optimizer"]["state"] = {name: {k: v[1] for k, v in state.items()} for name, state in pieces.items()
                                        if state}
        load_sharded_state(layout, path, metadata, hint="Check that the model config is that of the run that saved it.")
        saved = {"state": {name: {k: (local if local is not None else value) for k, (local, value) in state.items()}
                           for name, state in pieces.items() if state},
                 "param_groups": layout["optimizer"]["param_groups"]}
        self.load_named_optimizer_state(optimizer, saved, lambda name, value: value)

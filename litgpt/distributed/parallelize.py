"""The one place that takes a model built on the meta device to its devices, in a fixed order: dtype, pipeline
stages (`--parallel.pipeline`; the steps that follow apply to each stage), float8 layers (fp8-mixed), tensor
parallelism (`--parallel.tensor`), context parallelism (`--parallel.context`), expert parallelism
(`--parallel.expert`), activation checkpointing, compilation, activation offloading, sharding (FSDP over the
data-parallel mesh), then materialization and initialization (torchtitan's order).

The model file knows nothing of this; recipes call `parallelize`.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from litgpt.args import ActivationCheckpointing
from litgpt.distributed.activation_checkpointing import selective_checkpoint_contexts
from litgpt.distributed.activation_offloading import offload_activations
from litgpt.distributed.context_parallel import apply_context_parallel
from litgpt.distributed.dtensor import FullTensorInit
from litgpt.distributed.expert_parallel import apply_expert_parallel, whole_experts
from litgpt.distributed.fsdp import FSDPStrategy, shard_model
from litgpt.distributed.pipeline import PipelineModel, StageModule, split_into_stages
from litgpt.distributed.runtime import print_once
from litgpt.distributed.tensor_parallel import apply_tensor_parallel, row_orders
from litgpt.model import numbered_blocks
from litgpt.precision import Precision


def parallelize(
    fabric,
    model: nn.Module,
    precision: Precision,
    initialize: Callable[[nn.Module], None],
    activation_checkpointing: Union[bool, int, str, ActivationCheckpointing],
    compile_blocks: bool = False,
    prepare_block: Optional[Callable[[int, nn.Module], None]] = None,
    dtype: Optional[torch.dtype] = None,
    offload: bool = False,
    pipelined: bool = True,
) -> nn.Module:
    """Take a model built on the meta device to `fabric.device`, in the fixed order: dtype, float8 layers
    (fp8-mixed, `litgpt.distributed.float8`), tensor parallelism (the strategy's tensor mesh,
    `litgpt.distributed.tensor_parallel`), context parallelism (each attention over the whole sequence of its share
    of heads, `litgpt.distributed.context_parallel`), expert parallelism (the strategy's expert mesh,
    `litgpt.distributed.expert_parallel`), activation checkpointing, compilation (`compile_blocks`), activation
    offloading (`offload`: the forward pass around the blocks saves for the backward pass in host memory,
    `litgpt.distributed.activation_offloading`), sharding, then materialization and initialization (`initialize`), so
    no process ever holds the full model.

    `activation_checkpointing` is any setting `ActivationCheckpointing.parse` reads (false, true, N, every:N, ops).
    Initialization is rank-aware: a sharded model gets the same weights as a single-process model from the same seed.
    `prepare_block(index, block)` (FSDP only) gives a block weights of its own just before it is sharded (QLoRA's
    NF4 base, see `litgpt.distributed.fsdp.shard_model`); materialization and initialization leave those as they are.
    The model is stored in `dtype` (default: `precision.weights_dtype`; a frozen model takes the compute dtype): the
    one cast it gets, on the meta device.

    Under pipeline parallelism (the strategy's `pipeline`, unless `pipelined` is False: a frozen model stays whole)
    the model is first cut into this rank's stages (`litgpt.distributed.pipeline`), the steps above apply to each
    stage, and a `PipelineModel` of them is returned.
    """
    dtype = dtype or precision.weights_dtype
    if dtype != torch.float32:
        model.to(dtype)
    strategy = fabric.strategy
    pipeline = strategy.pipeline if isinstance(strategy, FSDPStrategy) and pipelined else None
    if pipeline is None:
        parts = [model]
    else:  # what travels between stages: the residual stream in FSDP's compute dtype
        parts = split_into_stages(model, pipeline, precision.sharded_compute_dtype or dtype)
        one_process_keys = list(model.state_dict(keep_vars=True))  # before expert parallelism splits the experts
    for part in parts:
        parallelize_part(fabric, part, precision, activation_checkpointing, compile_blocks, prepare_block, offload)
    orders = row_orders(model)  # the permuted rows draw what one process draws, in their stored order
    params = dict(model.named_parameters())
    rows = {id(params[key]): order for key, order in orders.items()}
    # The whole model in one process's order: another stage's weights, still on the meta device, are drawn and dropped.
    with torch.no_grad(), FullTensorInit(rows, fabric.device), whole_experts(model):
        initialize(model)
    if pipeline is None:
        return model
    model = PipelineModel(model, parts, pipeline, one_process_keys)
    if model.tie is not None:
        model.tie.copy_embedding()
    return model


def parallelize_part(fabric, model: nn.Module, precision: Precision,
                     activation_checkpointing: Union[bool, int, str, ActivationCheckpointing], compile_blocks: bool,
                     prepare_block: Optional[Callable[[int, nn.Module], None]], offload: bool) -> None:
    """`parallelize`'s steps from float8 layers to materialization, on the model or one pipeline stage of it."""
    if precision.float8:  # before tensor parallelism, whose styles must wrap the float8 layers themselves
        from litgpt.distributed.float8 import convert_to_float8

        convert_to_float8(model, precision.float8_recipe)
    strategy = fabric.strategy
    tensor_mesh = strategy.tensor_mesh if isinstance(strategy, FSDPStrategy) else None
    if tensor_mesh is not None:
        stage = isinstance(model, StageModule)
        apply_tensor_parallel(model, tensor_mesh, pad_sequences=not stage)
        if stage:  # between its blocks, and to the next stage, the residual stream is split over the sequence
            model.sequence_shards = tensor_mesh.size()
    context = strategy.context_parallel if isinstance(strategy, FSDPStrategy) else None
    if context is not None:
        apply_context_parallel(model, context)
    expert_mesh = strategy.expert_mesh if isinstance(strategy, FSDPStrategy) else None
    if expert_mesh is not None:
        apply_expert_parallel(model, expert_mesh["expert"])
    checkpointing = ActivationCheckpointing.parse(activation_checkpointing)
    if checkpointing:
        apply_activation_checkpointing(model, checkpointing)
    if compile_blocks:
        compile_each_block(model)
    if offload:
        apply_activation_offloading(model, fabric.device)
    if isinstance(strategy, FSDPStrategy):
        shard_model(model, strategy.data_mesh, strategy.fsdp, precision, fabric.device, prepare_block, expert_mesh,
                    pipeline_stage=isinstance(model, StageModule))
    elif prepare_block is not None:
        raise RuntimeError("prepare_block is applied just before sharding: it needs the FSDP strategy.")
    materialize_meta_tensors(model, fabric.device)


def materialize_meta_tensors(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device=device)` for the tensors still on the meta device: allocated, not initialized. Tensors
    that already hold data (loaded before sharding) stay as they are; ties are kept (each parameter is swapped in
    place, as `to_empty` does for sharded parameters)."""
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and param.is_meta:
                fresh = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, fresh)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def apply_activation_offloading(model: nn.Module, device: torch.device) -> None:
    """The model's forward pass saves its activations in host memory (`offload_activations`), around the compiled
    and checkpointed blocks; on a CPU, where the host is the device, a note that this saves nothing."""
    if device.type == "cpu":
        print_once("--train.offload_activations on a CPU: the host is the device, so it saves no memory (the "
                   "activations are copied within it); it matters on a GPU.")
    offload_activations(model)


def compile_each_block(model: torch.nn.Module) -> None:
    """`torch.compile` every transformer block in place (`--compiler torch`): after activation checkpointing and
    before sharding, torchtitan's order, so each graph is one block with its recomputation and FSDP's hooks stay
    around it; compiled in place, the blocks keep their parameter names."""
    for block in model.transformer.h:
        block.compile()


# Below this many optimizer steps --compiler auto leaves a CPU run eager: compiling the blocks takes 15-60 s on a
# 2-core CPU with an empty inductor cache, which a short run would not earn back.
AUTO_COMPILE_MIN_STEPS_CPU = 100


def auto_compiles(device: torch.device, config, planned_steps: Optional[int]) -> bool:
    """What `--compiler auto` picks: compile each block on CUDA GPUs; on a CPU too when the run is long enough
    (`planned_steps` None: as long as its epochs make it) and inductor can build CPU kernels (a C++ compiler), except
    for mixture-of-experts layers (their routing gives every step new shapes)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu" or config.mlp_class_name == "LLaMAMoE":
        return False
    if planned_steps is not None and planned_steps < AUTO_COMPILE_MIN_STEPS_CPU:
        return False
    return cpp_compiler_found()


def cpp_compiler_found() -> bool:
    """Whether the C++ compiler inductor builds CPU kernels with (its $CXX, else g++/clang++) is on the PATH."""
    import shutil

    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return shutil.which(get_cpp_compiler()) is not None
    except RuntimeError:  # inductor found none
        return False


def apply_activation_checkpointing(
    model: torch.nn.Module, checkpointing: Union[bool, int, str, ActivationCheckpointing] = "full"
) -> None:
    """Recompute transformer blocks' activations during the backward pass instead of storing them: every block
    (full), one block in N (every:N), or inside every block all but the outputs of matmuls and attention (ops)."""
    checkpointing = ActivationCheckpointing.parse(checkpointing)
    options = dict(use_reentrant=False)
    if checkpointing.mode == "ops":
        options["context_fn"] = selective_checkpoint_contexts
    for index, block in numbered_blocks(model.transformer.h):
        if checkpointing.checkpoints(index):
            block.forward = checkpointed(block.forward, options)


def checkpointed(forward: Callable, options: dict) -> Callable:
    """`forward` run through `torch.utils.checkpoint.checkpoint`, as a function of its own: a compiled block traces
    it and the checkpoint inside it. (With `functools.partial(checkpoint, ...)` as the forward, torch.compile of the
    block starts at `checkpoint`, which is excluded from tracing: no graph at all, every step eager.)"""

    def forward_with_checkpoint(*args, **kwargs):
        return checkpoint(forward, *args, **options, **kwargs)

    return forward_with_checkpoint

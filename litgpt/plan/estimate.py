"""The memory one training step needs on each device, worked out before anything is allocated.

`estimate` takes what training takes (the `Recipe`, `TrainArgs`, `FSDPArgs`, the `Precision`) and the world layout,
and returns a `MemoryPlan`: bytes per device, with the peak and where in the step it falls. The options go through
the training commands' own checks first. The model is the recipe's (`Recipe.build_model`): its parameters are laid
out by `litgpt.plan.layout`, its saved activations measured by `litgpt.plan.measure`, quantized weights counted by
`litgpt.plan.quantized`.

What is counted, per device:

- parameters: the resident (sharded) copy. Trainable ones in the master dtype (float32 for 32-true and the -mixed
  precisions, 16 bits for the -true ones). Frozen LoRA base weights too, since the training entry points cast the
  whole model to the master dtype; with --quantize the blocks' linear weights (`litgpt.quantize.quantize_targets`)
  are stored in 4 or 8 bits instead: bitsandbytes' layout on one device, torchao's NF4 under FSDP (bnb.nf4 and
  bnb.nf4-dq are stored so there), which is sharded like any weight. The base is quantized from the memory-mapped
  file one weight at a time (under FSDP one block's whole NF4 weights before the block is sharded): that moment,
  `loading`, is planned too.
- gradients: one per trainable parameter, in the master dtype, sharded like it. With gradient accumulation the
  earlier micro-batches' gradients are held while the next one runs forward (sharded: the sharded strategies
  reduce-scatter after every micro-batch). With --train.optimizer_in_backward each parameter is stepped as soon as
  its gradient is ready and the gradient freed: the largest one parameter's gradient on one device, one unit's sharded
  gradients under FSDP (they share the reduce-scatter's output until the unit's last parameter is stepped).
- optimizer state: AdamW's two moments per trainable parameter, in the master dtype, sharded.
- gathered parameters: FSDP2 (`fully_shard` per Block, the embedding and the head unless tied, then the root)
  all-gathers a unit's parameters in the compute dtype (NF4 weights in their 4-bit layout) before it runs: two
  blocks at a time (one running, one prefetched), the embedding for its forward and at the end of the backward
  pass, the head for the loss and again for its backward pass, and the root (final norm; a tied head) throughout
  the backward pass; with SHARD_GRAD_OP every unit stays gathered
  from its forward until its backward. The shard group comes from
  `litgpt.distributed.topology.Topology`, as in training.
  On a single device (no FSDP) with a -mixed precision, the fake run goes under CPU autocast over float32 weights:
  autocast's 16-bit copies of the weights (recognized as casts of a parameter) that autograd saves take this row
  instead of the activations.
- activations: what `litgpt.plan.measure` saw autograd save, per block and for the rest of the model (the
  embedding's indices, the final norm, the head's input). With activation checkpointing a checkpointed block keeps
  only its input (as the hooks saw it) and, with `ops`, the outputs of its matmuls and attention kernels
  (`litgpt.distributed.activation_checkpointing`'s list of operations, recorded in the same fake run); the others
  (every:N) keep everything. In the backward pass one checkpointed block at a time recomputes the rest (a work
  buffer). With --train.offload_activations what the blocks save goes to host memory in the forward pass (pinned,
  `litgpt.distributed.activation_offloading`) and comes back in the backward pass: the device keeps the rest of
  the model's (counted whole, the head's input among it), with `ops` the outputs that checkpointing keeps (eager
  blocks hold them outside autograd), and in the backward pass one block's saved tensors brought back (all of them
  at once: an upper bound, each operation's come back as it runs); the host holds the blocks' (a view saved beside
  its base is copied apart, which can add more).
- logits and loss: training never holds the whole logits (`litgpt.train.loss.chunked_head_loss`): the head and the
  loss run over chunks of positions (`loss_chunk_size`, by default `litgpt.train.loss.auto_chunk_size`, the rule
  training uses), each chunk's gradients taken in the forward pass while its logits exist (a per-position loss, as
  preference optimization's, makes them again in the backward pass). At the loss one chunk is alive:
  its float32 logits, which become their gradient in place (4 bytes per position and vocabulary row), their 16-bit
  copy with a 16-bit compute dtype (2 more), the tanh of a final soft-capping (4 more); beside it, for the whole
  chunk loop, the hidden states' gradient and the gradients of the head's trainable weights (under autocast also
  each chunk's 16-bit product before it is added to the float32 one).
- work buffers: what one block's backward pass allocates on top (activation gradients, estimated from the widest of
  its layers, its weight gradients, FSDP's reduce-scatter input) and, with --quantize, what dequantizing a slice of
  one weight's columns holds (`litgpt.sliced_linear`; `litgpt.plan.quantized.dequantize_bytes`).

Tensor parallelism (--parallel.tensor N, `litgpt.distributed.plans.dense`): every row is one rank's. Its parameters,
gradients and optimizer state are those of its piece of the model (`litgpt.plan.layout.rank_recipe`: 1/N of the
heads, the MLP width and the vocabulary rows, norms whole), sharded by FSDP over the data-parallel rest of the world;
its activations are measured on that piece, except that the norms' (and each block's input) are split over the
positions by sequence parallelism (`SavedActivations.split_over_sequence`); the loss runs on the rank's vocabulary
rows of the head (`litgpt.train.loss.VocabularyShard`): its chunks' logits are (chunk, vocabulary / N).

Expert parallelism (--parallel.expert N, `litgpt.distributed.expert_parallel`): a rank holds n_expert / N routed
experts of every MoE layer (`litgpt.plan.layout.parameter_layout`), FSDP-sharded over the ranks holding the same ones
(the expert mesh's shard dimension, `Topology.expert_mesh_shape`), the rest of the model sharded as without it. Its
activations are one process's on its own micro-batch: with balanced routing as many routed rows (k per token) come in
as go out. The all-to-all's received and returned rows are work buffers of the backward pass.

Context parallelism (--parallel.context N, `litgpt.distributed.context_parallel`): a rank runs its slice of every
sequence (padded to a multiple of N x the tensor degree), so its activations and logits are measured on that many
positions; the head scatter keeps (all positions, 1/N of the heads), the same bytes. FSDP shards over the shard and
context ranks. The contiguous copy of the local queries, keys and values sent and what comes back are work buffers
(latent attention sends its queries and gathers the group's latents instead of keys and values).

Frozen models (`Recipe.frozen_configs`: a distillation teacher): their weights, final hidden states, chunk of logits
and forward pass are added as `_add_frozen` describes.

The peak is the largest of three moments: the start of the backward pass (all activations and the loss tensors
alive), the backward pass of the last block (its work buffers on top of the activations), and the optimizer step
(all gradients and optimizer state); with autocast and checkpointing also the end of the forward pass, while
autocast's cache still holds 16-bit copies of every trainable weight. Every row of the table gives its own largest
size and its size at the peak.
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from litgpt.args import ActivationCheckpointing, FSDPArgs, ParallelArgs, TrainArgs
from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.model import MatmulAttention
from litgpt.plan.layout import Layout, Param, frozen_layout, parameter_layout, rank_config, rank_recipe
from litgpt.plan.measure import SavedActivations, math_attention, matmul_attention, saved_activation_bytes
from litgpt.plan.quantized import dequantize_bytes, nf4_bytes, quantize_work_bytes, stored_bytes
from litgpt.plan.report import GiB, ROWS, count, fmt
from litgpt.precision import Precision

if TYPE_CHECKING:
    from litgpt.train.recipe import Recipe

PLAN_DEVICES = ("cuda", "cpu")

# What a device needs beyond the tensors counted here.
CUDA_CONTEXT_BYTES = 1 * GiB  # CUDA context and library workspaces (0.82 GiB measured on an H100, torch 2.11)
CUDA_FRAGMENTATION = 0.10  # the caching allocator reserves more than it hands out: a share of the peak
CPU_RUNTIME_BYTES = GiB // 2  # resident size of Python + torch + litgpt before the model (0.42 GiB, torch 2.13)


@dataclass
class MemoryPlan:
    """Memory of one training step on one device, in bytes; see the module docstring for what each field holds.

    `parameters` ... `buffers` are each row's largest size during the step; `at_peak` holds the same rows at the
    moment of the peak (`peak_phase`), which is what `peak` adds up. `total` = `peak` + `overhead`.
    """

    model_name: str
    method: str
    precision: str
    sharding_strategy: str
    device: str
    devices: int
    num_nodes: int
    micro_batch_size: int
    seq_length: int
    activation_checkpointing: str  # none, full, every:N or ops
    offload_activations: bool
    cpu_offload: bool
    accumulate_gradients: bool
    quantize: Optional[str]
    lora_r: Optional[int]
    lora_targets: list[str]
    # layout
    world_size: int
    shard_group_size: int
    replicate_groups: int
    fsdp: bool
    # counts
    total_params: int
    trainable_params: int
    n_layer: int
    # bytes per device: each row's largest size
    parameters: int
    gradients: int
    optimizer_state: int
    gathered_params: int
    activations: int
    logits_loss: int
    buffers: int
    # the peak
    at_peak: dict[str, int]
    peak_phase: str
    peak: int
    overhead: int
    total: int
    device_memory: int
    fits: bool
    margin: int  # device_memory - what is needed (the total, or the loading): what is left (negative: missing)
    loading: int  # with --quantize: the base in the master dtype on the device, before it is quantized
    host_memory_per_node: int  # with cpu_offload and offload_activations: the node's devices' part in CPU memory
    host_activations: int  # with offload_activations: one device's saved activations in CPU memory
    activations_per_layer: int  # one (typical) block's saved activations without checkpointing
    attention: str  # which attention kernel the activations assume
    row_details: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    loss_chunk_size: int = 0  # positions per chunk of the head and loss
    teacher_params: int = 0  # frozen models' parameters (a teacher, a reference; counted in the rows, not above)
    teacher_bytes: int = 0  # their weights as they stay on the device
    summary: str = ""  # what the recipe adds to the plan's first line (`Recipe.plan_summary`)
    kv_cache_bytes_per_token: int = 0  # generation (not training): one sequence's KV cache per position, all layers
    tensor_parallel: int = 1  # devices that split each layer (--parallel.tensor); the rows are one device's
    expert_parallel: int = 1  # devices that split each MoE layer's experts (--parallel.expert)
    context_parallel: int = 1  # devices that split each sequence's positions (--parallel.context)
    pipeline_parallel: int = 1  # devices that run the model's stages one after the other (--parallel.pipeline)
    pipeline_schedule: str = ""  # their schedule (--parallel.pipeline_schedule)
    pipeline_rank: int = 0  # the pipeline rank whose device the rows are: the one that peaks
    microbatches: int = 1  # micro-batches per optimizer step (with pipeline parallelism, through the schedule)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Run:
    """The planned run, checked, and what follows from it (sizes in bytes per element)."""

    recipe: "Recipe"
    precision: Precision
    sharding_strategy: str
    device: str
    devices: int
    num_nodes: int
    micro_batch_size: int
    seq_length: int
    activation_checkpointing: ActivationCheckpointing
    offload_activations: bool
    cpu_offload: bool
    accumulate_gradients: bool
    optimizer_in_backward: bool  # each gradient stepped and freed in the backward pass
    shard: int  # the shard group: how many devices one copy of the state is split over
    loss_chunk_size: int  # positions per chunk of the head and loss
    backward_prefetch: int  # blocks a block's backward pass gathers ahead (0: FSDP2's implicit one)
    tensor: int = 1  # the tensor-parallel degree
    rank_recipe: Optional["Recipe"] = None  # one rank's piece of the model (`rank_recipe`); the recipe without TP
    expert: int = 1  # the expert-parallel degree
    expert_shard: int = 1  # the devices FSDP shards a routed expert over: those holding the same experts
    context: int = 1  # the context-parallel degree (`seq_length` is then each device's slice of the sequence)
    whole_seq_length: int = 0  # the sequence's positions, all devices of a context-parallel group together
    pipeline: int = 1  # the pipeline-parallel degree
    pipeline_schedule: str = "1F1B"
    stages_per_rank: int = 1
    microbatches: int = 1  # micro-batches per optimizer step

    @property
    def config(self) -> Config:
        return self.recipe.config

    @property
    def rank_config(self) -> Config:
        """The sizes of one rank's piece of the model: its heads, MLP width and vocabulary rows."""
        return self.rank_recipe.config

    @property
    def lora(self):
        return self.recipe.lora

    @property
    def quantize(self) -> Optional[str]:
        return self.recipe.quantize

    @property
    def method(self) -> str:
        return "full" if self.lora is None else "lora"

    @property
    def stored_quantize(self) -> Optional[str]:  # how the training commands store the quantized base
        from litgpt.quantize import storage_mode

        return storage_mode(self.quantize, self.fsdp) if self.quantize else None

    @property
    def world(self) -> int:
        return self.devices * self.num_nodes

    @property
    def fsdp(self) -> bool:
        return self.world > 1

    @property
    def master(self) -> int:  # stored parameters, gradients, optimizer state
        return self.precision.weights_dtype.itemsize

    @property
    def compute(self) -> int:  # what the math runs in
        return self.precision.compute_dtype.itemsize

    @property
    def autocast(self) -> bool:  # single device: Fabric's autocast over float32 weights
        return self.precision.mixed and not self.fsdp

    @property
    def param_compute(self) -> int:  # the dtype a module sees its weights in
        return self.compute if self.fsdp else self.master

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_length


def estimate(recipe: "Recipe", train: TrainArgs, fsdp: FSDPArgs, precision: Precision, *, devices: int = 1,
             num_nodes: int = 1, device: str = "cuda", device_memory_gb: float = 80.0,
             accumulate_gradients: bool = True, parallel: ParallelArgs = ParallelArgs()) -> MemoryPlan:
    """The per-device memory of one training step of `recipe` with these arguments, on `num_nodes` nodes of `devices`
    devices of type `device` (cuda or cpu) with `device_memory_gb` GiB each. `accumulate_gradients`: the gradients of
    earlier micro-batches are held while the next one runs. `parallel`: the --parallel degrees. `tensor`: tensor
    parallelism's degree (--parallel.tensor):
    the parameters and activations are those of one rank's piece of the model (`rank_recipe`), the norms' saved
    activations split over the positions, and the loss gathers the head whole. `expert`: expert parallelism's
    (--parallel.expert): a rank's routed experts (`parameter_layout`) sharded over the ranks holding the same ones,
    the all-to-all's buffers. `context`: context parallelism's (--parallel.context): a rank's slice of every
    sequence, attention's all-to-all buffers. `pipeline`: pipeline parallelism's (--parallel.pipeline): the
    device that peaks, its stages' parameters and in-flight micro-batches (`_pipeline_device`)."""
    run = _check_run(recipe, train, fsdp, precision, devices, num_nodes, device, device_memory_gb,
                     accumulate_gradients, parallel)
    model = run.rank_recipe.build_model()  # laid out, then measured (its parameters replaced by fakes)
    layout = parameter_layout(run.rank_recipe, run.expert, model)
    saved = saved_activation_bytes(run.rank_recipe, micro_batch_size=run.micro_batch_size,
                                   seq_length=run.seq_length, precision=precision, sharded=run.fsdp,
                                   device=run.device, model=model).split_over_sequence(run.tensor)
    if run.pipeline > 1:
        layout, state, activations, gathered, backward, moments = _pipeline_device(run, saved)
    else:
        state = _resident_state(run, layout)
        activations = _activation_rows(run, saved)
        gathered = _gathered_params(run, layout, saved)
        backward = _block_backward(run, layout)
        moments = _moments(run, state, activations, gathered, backward)
    host_activations = activations["host"] + gathered.get("host", 0)  # offloaded: what the blocks saved
    # A frozen model is split by tensor parallelism as the trained one is: the rank's piece.
    pieces = {name: rank_config(config, run.tensor) for name, config in recipe.frozen_configs().items()}
    frozen = {name: (piece, frozen_layout(piece)) for name, piece in pieces.items()}
    frozen_bytes = {name: _add_frozen(run, name, *frozen[name], moments, recipe.frozen_outputs_reach_the_loss)
                    for name in frozen}
    peak_phase, peak_rows = max(moments.items(), key=lambda item: sum(item[1].values()))
    at_peak = {key: peak_rows.get(key, 0) for key, _ in ROWS}
    largest = {key: max(m.get(key, 0) for m in moments.values()) for key, _ in ROWS}
    peak = sum(at_peak.values())
    overhead = _overhead(peak, run.device)
    device_memory = int(device_memory_gb * GiB)
    loading = _quantized_loading(run, layout) if run.quantize else 0
    needed = max(peak + overhead, loading + _overhead(loading, run.device) if loading else 0)
    details, notes = _describe(run, layout, state, activations, gathered, backward, loading)
    kv_cache_per_token, kv_cache_note = _kv_cache_per_token(recipe.config, precision.compute_dtype)
    notes.append(kv_cache_note)
    for name, (config, frozen_model) in frozen.items():
        details["parameters"] += f" + the {name}'s {fmt(frozen_bytes[name])}"
        notes.append(_frozen_note(recipe, name, config, frozen_model.total_params, frozen_bytes[name]))
    frozen_params = sum(frozen_model.total_params for _, frozen_model in frozen.values())
    if recipe.sequences_per_sample > 1:
        notes.append(f"{recipe.name}: each sample is {recipe.sequences_per_sample} sequences, so the micro batch of "
                     f"{train.micro_batch_size} is {run.micro_batch_size} sequences in one forward pass.")
    return MemoryPlan(
        model_name=recipe.config.name or "model_config", method=run.method, precision=precision.name,
        sharding_strategy=run.sharding_strategy if run.fsdp else "none (1 device)", device=run.device,
        devices=run.devices, num_nodes=run.num_nodes, micro_batch_size=run.micro_batch_size,
        seq_length=run.whole_seq_length, activation_checkpointing=str(run.activation_checkpointing),
        offload_activations=run.offload_activations, cpu_offload=run.cpu_offload,
        accumulate_gradients=run.accumulate_gradients, quantize=run.quantize,
        lora_r=run.lora.r if run.lora else None, lora_targets=_lora_targets(run.lora), world_size=run.world,
        shard_group_size=run.shard, replicate_groups=run.world // run.tensor // run.pipeline // run.shard,
        fsdp=run.fsdp,
        tensor_parallel=run.tensor, expert_parallel=run.expert, context_parallel=run.context,
        pipeline_parallel=run.pipeline, pipeline_schedule=run.pipeline_schedule if run.pipeline > 1 else "",
        pipeline_rank=activations.get("pipeline_rank", 0), microbatches=run.microbatches,
        total_params=layout.total_params, trainable_params=layout.trainable_params, n_layer=recipe.config.n_layer,
        **largest, at_peak=at_peak, peak_phase=peak_phase, peak=peak, overhead=overhead, total=peak + overhead,
        device_memory=device_memory, fits=needed <= device_memory, margin=device_memory - needed, loading=loading,
        host_memory_per_node=state["host_per_node"] + run.devices * host_activations,
        host_activations=host_activations, activations_per_layer=max(saved.per_layer, default=0),
        attention=backward["attention"], row_details=details, notes=notes, loss_chunk_size=run.loss_chunk_size,
        teacher_params=frozen_params, teacher_bytes=sum(frozen_bytes.values()),
        kv_cache_bytes_per_token=kv_cache_per_token, summary=recipe.plan_summary(count(frozen_params)),
    )


def _frozen_note(recipe: "Recipe", name: str, config: Config, params: int, nbytes: int) -> str:
    kind = "Distillation" if recipe.frozen_outputs_reach_the_loss else "Reference"
    outputs = ("its final hidden states and its chunk of logits are counted with the model's"
               if recipe.frozen_outputs_reach_the_loss else "its forward pass keeps nothing for the backward pass")
    return (
        f"{kind}: the frozen {name} ({config.name or f'{name}_config'}, {count(params)} parameters) in the "
        f"compute dtype, sharded like the model, its final norm and head kept gathered: {fmt(nbytes)}; {outputs}."
    )


def _kv_cache_per_token(config: Config, dtype: torch.dtype) -> tuple[int, str]:
    """Bytes per position of the KV cache generation allocates (the model's own caches, built on the meta device),
    and a note saying so; latent attention caches its compressed latent, set against full keys and values."""
    from litgpt.model import build_attention

    with torch.device("meta"):
        attn = build_attention(config, 0)

    def per_token(**kwargs) -> int:
        cache = attn.new_kv_cache(1, 1, device="meta", dtype=dtype, **kwargs)
        return config.n_layer * sum(t.numel() * t.element_size() for t in (cache.k, cache.v))

    def words(nbytes: int) -> str:
        return f"{nbytes:,} bytes per position, {fmt(nbytes * config.block_size)} for {config.block_size:,} positions"

    nbytes = per_token()
    note = f"Generation (not in this training plan): one sequence's KV cache takes {words(nbytes)}"
    if config.kv_lora_rank is not None:
        full = words(per_token(latent=False))
        note += f" (latent attention's compressed latent; full keys and values would take {full})"
    return nbytes, note + "."


def _check_run(recipe: "Recipe", train: TrainArgs, fsdp: FSDPArgs, precision: Precision, devices: int,
               num_nodes: int, device: str, device_memory_gb: float, accumulate_gradients: bool,
               parallel: ParallelArgs) -> _Run:
    """The options checked (by the training commands' own checks where they have one) and completed."""
    from litgpt.distributed.topology import check_sharding_strategy

    tensor, expert, context = parallel.tensor, parallel.expert, parallel.context

    if device not in PLAN_DEVICES:
        raise UserError(f"--device {device!r} is not one of {', '.join(PLAN_DEVICES)}.")
    check_sharding_strategy(fsdp.sharding_strategy)
    whole_numbers = (("--devices", devices), ("--num_nodes", num_nodes),
                     ("--train.micro_batch_size", train.micro_batch_size))
    for option, value in whole_numbers:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{option} must be a whole number >= 1, got {value!r}.")
    train.check()
    world = devices * num_nodes
    precision.check_devices(on_cpu=device == "cpu", sharded=world > 1)
    seq_length = train.seq_length(recipe.config)
    if not (isinstance(device_memory_gb, (int, float)) and device_memory_gb > 0):
        raise UserError(f"--device_memory_gb must be a number > 0, got {device_memory_gb!r}.")
    if recipe.quantize is not None:
        _check_quantize_mode(recipe, world)
    if fsdp.cpu_offload and world == 1:
        raise UserError(
            "--fsdp.cpu_offload is an FSDP option: it needs more than one device (devices x num_nodes > 1)."
        )
    _check_tensor_parallel(recipe, tensor, world)
    _check_expert_and_context_parallel(recipe, expert, context, tensor, world)
    shard, expert_shard = _shard_groups(devices, num_nodes, fsdp.sharding_strategy, parallel)
    microbatches = _check_pipeline(recipe, train, parallel, world)
    whole_seq_length = seq_length
    if context > 1:  # each rank's slice of the sequence padded to a multiple of the group (x the tensor degree)
        seq_length = (seq_length + -seq_length % (context * tensor)) // context
    if recipe.quantize is not None:
        _check_quantized_layout(recipe, precision, fsdp, world, shard)
    rows = train.micro_batch_size * recipe.sequences_per_sample  # a preference pair is two sequences
    pieces = rank_recipe(recipe, tensor)  # one rank's piece of the model: its chunks are its vocabulary rows
    return _Run(
        recipe=recipe, precision=precision, sharding_strategy=fsdp.sharding_strategy, device=device,
        devices=devices, num_nodes=num_nodes, micro_batch_size=rows, seq_length=seq_length,
        activation_checkpointing=ActivationCheckpointing.parse(train.activation_checkpointing),
        # Training refuses accumulation with the optimizer in the backward pass: one micro-batch per step.
        offload_activations=train.offload_activations, cpu_offload=fsdp.cpu_offload,
        accumulate_gradients=(accumulate_gradients and not train.optimizer_in_backward) or microbatches > 1,
        optimizer_in_backward=train.optimizer_in_backward, shard=shard,
        loss_chunk_size=_loss_chunk(pieces.config, rows * seq_length, train.loss_chunk_size),
        backward_prefetch=fsdp.backward_prefetch, tensor=tensor, rank_recipe=pieces,
        expert=expert, expert_shard=expert_shard, context=context, whole_seq_length=whole_seq_length,
        pipeline=parallel.pipeline, pipeline_schedule=parallel.pipeline_schedule,
        stages_per_rank=parallel.stages_per_rank, microbatches=microbatches,
    )


def _check_pipeline(recipe: "Recipe", train: TrainArgs, parallel: ParallelArgs, world: int) -> int:
    """Training's checks of --parallel.pipeline (`check_pipeline_model`, the mesh's in `Topology`, the schedule's
    `check_microbatches`), and what the plan does not cover yet; returns the micro-batches per optimizer step."""
    from litgpt.distributed.pipeline import check_microbatches
    from litgpt.train.launch import check_pipeline_model

    degree = parallel.pipeline
    if degree == 1:
        return 1
    if degree > world:
        raise UserError(f"--parallel.pipeline {degree} runs the model's stages on {degree} devices: plan for at least "
                        "that many (--devices).")
    check_pipeline_model(recipe, train, parallel)
    if recipe.frozen_configs() or recipe.sequences_per_sample > 1 or recipe.name in ("dpo", "grpo"):
        raise UserError(f"litgpt plan --parallel.pipeline {degree}: plans of {recipe.name} (frozen models, preference "
                        "pairs, sampled groups) under pipeline parallelism are not supported yet.")
    # The data-parallel devices: the world over the pipeline, tensor and context-parallel groups.
    microbatches = train.gradient_accumulation_iters(world // (degree * parallel.tensor * parallel.context))
    check_microbatches(parallel.pipeline_schedule, parallel.pipeline_stages, degree, microbatches)
    return microbatches


def _check_tensor_parallel(recipe: "Recipe", tensor: int, world: int) -> None:
    """Training's checks of --parallel.tensor (`check_tensor_parallel`), and what the plan does not cover yet."""
    from litgpt.distributed.plans import check_tensor_parallel

    if tensor == 1:
        return
    if tensor > world:
        raise UserError(f"--parallel.tensor {tensor} splits each layer over {tensor} devices: plan for at least that "
                        "many (--devices).")
    check_tensor_parallel(recipe.config, tensor, quantized=recipe.quantize is not None)
    for config in recipe.frozen_configs().values():  # split as the trained model is (`rank_config`)
        check_tensor_parallel(config, tensor)


def _check_expert_and_context_parallel(recipe: "Recipe", expert: int, context: int, tensor: int, world: int) -> None:
    """Training's checks of --parallel.expert and --parallel.context (`check_expert_parallel`,
    `check_context_parallel`; the mesh's own in `Topology`), and what the plan does not cover yet."""
    from litgpt.distributed.plans import check_context_parallel, check_expert_parallel

    splits = ((expert, "expert", "splits the experts"), (context, "context", "splits each sequence"))
    for degree, option, what in splits:
        if degree == 1:
            continue
        if degree * tensor > world:
            over = (f"{degree} devices: plan for at least that many" if tensor == 1 else
                    f"{degree} tensor-parallel groups of {tensor}: plan for at least {degree * tensor} devices")
            raise UserError(f"--parallel.{option} {degree} {what} over {over} (--devices).")
        if recipe.frozen_configs():
            raise UserError(f"litgpt plan --parallel.{option} {degree}: plans with frozen models (a teacher, a "
                            f"reference) under {option} parallelism are not supported yet.")
    check_expert_parallel(recipe.config, expert)
    check_context_parallel(recipe.config, context, tensor)


def _check_quantize_mode(recipe: "Recipe", world: int) -> None:
    from litgpt.quantize import check_quantize_mode

    check_quantize_mode(recipe.quantize, sharded=world > 1)
    if recipe.lora is None:
        raise UserError("--quantize stores frozen base weights: it needs --method lora.")


def _check_quantized_layout(recipe: "Recipe", precision: Precision, fsdp: FSDPArgs, world: int, shard: int) -> None:
    """The training commands' checks of a quantized base against the FSDP layout (`quantization_for`)."""
    from litgpt.quantize import check_nf4_precision, check_quantized_offload, storage_mode

    if world > 1:
        check_quantized_offload("--fsdp.cpu_offload", fsdp.cpu_offload, shard, fsdp.sharding_strategy)
    if storage_mode(recipe.quantize, world > 1) == "ao.nf4":
        check_nf4_precision(precision, sharded=shard > 1)


def _loss_chunk(config: Config, tokens: int, loss_chunk_size: Optional[int]) -> int:
    """Positions per chunk of the head and loss: --train.loss_chunk_size, or training's automatic rule."""
    from litgpt.train.loss import auto_chunk_size

    if loss_chunk_size is None:
        return auto_chunk_size(tokens, config.n_embd, config.padded_vocab_size)
    return min(loss_chunk_size, tokens)


def _shard_groups(devices: int, num_nodes: int, strategy: str, parallel: ParallelArgs) -> tuple[int, int]:
    """The devices one copy of the sharded state spans, as training's mesh (`Topology`) lays them out: (FSDP's shard
    group: the shard dimension, times the context one with context parallelism; a routed expert's: the expert mesh's
    shard dimension, the ranks holding the same experts)."""
    if devices * num_nodes == 1:
        return 1, 1
    from litgpt.distributed.topology import Topology

    expert = parallel.expert
    with contextlib.redirect_stderr(io.StringIO()):  # Topology's note on HYBRID_SHARD: the plan has its own
        topology = Topology(devices, num_nodes, strategy, parallel.tensor, expert, parallel.context,
                            parallel.pipeline, parallel.stages_per_rank, parallel.pipeline_schedule)
    return topology.fsdp_shard_size, topology.expert_mesh_shape[1] if expert > 1 else topology.fsdp_shard_size


def _resident_state(run: _Run, layout: Layout) -> dict:
    """Parameters, gradients and optimizer state as they stay on the device (or, offloaded, in host memory)."""

    parameters = sum(_resident_bytes(run, p) for p in layout.params)
    trainable = [p for p in layout.params if p.trainable]
    gradients = sum(_shard_numel(p.shape, _shard_of(run, p)) for p in trainable) * run.master
    optimized = [p for p in trainable if p.optimized]  # a tied head's copy has a gradient, not an optimizer state
    optimizer_state = (2 * sum(_shard_numel(p.shape, _shard_of(run, p)) for p in optimized) * run.master
                       + 4 * len(optimized))  # exp_avg, exp_avg_sq, and a step count per tensor
    state = dict(
        parameters=parameters, gradients=gradients, optimizer_state=optimizer_state, host_per_node=0,
        # Sharded strategies reduce-scatter after every micro-batch, so accumulation holds sharded gradients
        # (NO_SHARD holds them unsharded, which is the same size there).
        gradients_held=gradients if run.accumulate_gradients else 0,
        resident=dict(parameters=parameters, gradients=gradients, optimizer_state=optimizer_state),
    )
    if run.optimizer_in_backward:
        state["resident"]["gradients"] = _gradients_in_flight(run, layout)
    if run.cpu_offload:
        state["host_per_node"] = run.devices * (parameters + gradients + optimizer_state)
        state["resident"] = dict(parameters=0, gradients=0, optimizer_state=0)
        state["gradients_held"] = 0  # FSDP2 moves each reduce-scattered gradient to CPU memory
    return state


def _gradients_in_flight(run: _Run, layout: Layout) -> int:
    """With --train.optimizer_in_backward, the most gradient bytes that exist at once after autograd (or FSDP's
    reduce-scatter) made them: one parameter's on one device, one FSDP unit's shards."""
    if run.fsdp:  # the embedding's and the head's units (unless tied), the root's and each block's
        units = [*_root_units(run, layout, run.config.tie_embeddings), *layout.blocks]
    else:
        units = [[p] for p in layout.params]
    shards = [sum(_shard_numel(p.shape, _shard_of(run, p)) for p in unit if p.trainable) for unit in units]
    return max(shards) * run.master


def _activation_rows(run: _Run, saved: SavedActivations, layers: Optional[list[int]] = None) -> dict:
    """The activations held at the start of the backward pass, and the loss' float32 tensors; and, for the block
    whose backward pass holds the most, what is held then (its own and the earlier blocks' activations) and what
    it recomputes on top. `layers`: the model's indices of the blocks `saved` holds (default: all of them)."""
    checkpointing = run.activation_checkpointing
    saved_by_autograd, cached, recomputed = [], [], []  # per block
    for index, layer in enumerate(saved.per_layer):
        if not checkpointing.checkpoints(layers[index] if layers else index):
            saved_by_autograd.append(layer)
            cached.append(0)
            recomputed.append(0)
        elif checkpointing.mode == "ops":  # the input and the cached outputs; the rest is recomputed
            saved_by_autograd.append(saved.block_inputs[index])
            cached.append(saved.kept_outputs[index])
            recomputed.append(layer - saved.kept_outputs_saved[index])
        else:  # only the input; the whole block is recomputed
            saved_by_autograd.append(saved.block_inputs[index])
            cached.append(0)
            recomputed.append(layer)
    if run.offload_activations:  # what autograd saves waits on the host; a block's comes back for its backward
        device, host = cached, saved_by_autograd
    else:
        device, host = [s + c for s, c in zip(saved_by_autograd, cached)], [0] * len(cached)
    # The backward pass runs the blocks last to first, freeing each one's activations when it is done.
    held = [sum(device[: index + 1]) + host[index] + recomputed[index] for index in range(len(device))]
    worst = max(range(len(device)), key=held.__getitem__, default=None)
    chunk_logits, loss_gradients = _chunked_loss_bytes(run)
    return dict(
        activations=saved.root + sum(device), root=saved.root, logits_loss=chunk_logits + loss_gradients,
        chunk_logits=chunk_logits, host=sum(host),
        backward=sum(device[: worst + 1]) + host[worst] if worst is not None else 0,
        recompute=recomputed[worst] if worst is not None else 0,
        largest_layer=max(saved.per_layer, default=0),
    )


def _resident_bytes(run: _Run, p: Param) -> int:
    """One parameter as it stays on a device: its shard in the master dtype, or its quantized layout."""
    if p.quantized:
        return stored_bytes(p.shape, run.stored_quantize, run.compute, _shard_of(run, p))
    return _shard_numel(p.shape, _shard_of(run, p)) * run.master


def _shard_of(run: _Run, p: Param) -> int:
    """The devices FSDP shards `p` over: a routed expert's over the ranks holding the same experts."""
    return run.expert_shard if p.expert else run.shard


def _chunked_loss_bytes(run: _Run) -> tuple[int, int]:
    """(one chunk's logits as the head and loss hold them, the gradients the chunk loop accumulates): see the module
    docstring."""
    config = run.config
    # Under tensor parallelism each rank's chunk is its vocabulary rows' (a vocabulary-parallel loss).
    vocab, width = run.rank_config.padded_vocab_size, config.n_embd
    per_row = 4 + (2 if run.compute == 2 else 0) + (4 if config.final_logit_softcapping is not None else 0)
    chunk_logits = run.loss_chunk_size * vocab * per_row
    hidden_grad = run.tokens * width * run.param_compute
    if run.lora is None:  # the head's weight (or the tied embedding) trains
        head_grads = vocab * width * run.param_compute
        if run.param_compute != run.compute:  # autocast: each chunk's 16-bit product, then added in float32
            head_grads += vocab * width * run.compute
    else:
        head_grads = vocab * run.lora.r * run.param_compute if run.lora.head else 0
    return chunk_logits, hidden_grad + head_grads


def _gathered_params(run: _Run, layout: Layout, saved: SavedActivations) -> dict:
    """FSDP's gathered units, or on one device autocast's 16-bit weight copies, at each moment of the step."""
    unsharded = lambda params: sum(math.prod(p.shape) for p in params)  # noqa: E731
    block_bytes = sorted(sum(_gathered_bytes(run, p) for p in ps) for ps in layout.blocks)
    embedding, head, root = _root_units(run, layout, run.config.tie_embeddings)
    root_bytes = unsharded(root) * run.compute
    head_bytes = unsharded(head) * run.compute
    gathered = dict(root=root_bytes if run.fsdp else 0, forward_end=0)
    if run.fsdp:
        # `shard_model` keeps the root (final norm; the head and embedding when tied) gathered from its forward to
        # its backward; the head, a unit of its own unless tied, for the loss and again for the loss's backward, at
        # the start of the backward pass; the embedding, one too, for its forward and at the end of the backward
        # pass. A block is gathered for its forward and again for its backward, the next one prefetched (a shard
        # group of one copies each block as it runs, without prefetching). SHARD_GRAD_OP
        # (reshard_after_forward=False) keeps every unit gathered from its forward to its backward.
        ahead = max(1, run.backward_prefetch) if run.shard > 1 else 0
        gathered["backward"] = root_bytes + sum(block_bytes[-(1 + ahead):])
        blocks = f"{1 + max(1, run.backward_prefetch)} blocks at a time"
        if run.sharding_strategy == "SHARD_GRAD_OP" and run.shard > 1:
            embedding_bytes = unsharded(embedding) * run.compute
            gathered["backward"] += embedding_bytes
            gathered.update(start=root_bytes + head_bytes + embedding_bytes + sum(block_bytes),
                            detail="every block + root, from forward to backward")
        else:
            gathered.update(start=root_bytes + head_bytes, detail=(
                f"root + {blocks}, head for the loss, compute dtype" if head else f"root + {blocks}, compute dtype"))
    elif run.autocast:
        gathered.update(_autocast_copies(run, saved), detail="autocast's 16-bit copies of the linear weights")
    else:
        gathered.update(start=0, backward=0, detail="none on a single device")
    return gathered


def _root_units(run: _Run, layout: Layout, tied: bool,
                trains: bool = True) -> tuple[list[Param], list[Param], list[Param]]:
    """The parameters of the embedding's unit, the head's and the root's (final norm, and what is not apart), as
    `litgpt.distributed.fsdp.embedding_unit` and `head_unit` make them under FSDP: neither apart on one device, for
    an embedding `tied` to the head, or in a pipeline stage's layout; no head unit under tensor parallelism (the head
    split by vocabulary rows) or for a frozen model (`trains` False)."""
    if not run.fsdp or tied:
        return [], [], layout.root
    head = layout.head if trains and run.tensor == 1 else []
    apart = {id(p) for p in layout.embedding + head}
    return layout.embedding, head, [p for p in layout.root if id(p) not in apart]


def _autocast_copies(run: _Run, saved: SavedActivations) -> dict:
    """Autocast's 16-bit copies of the weights that autograd saved, at each moment; with checkpointing only the
    head's and the recomputed block's are saved, but the cached copies of trainable weights last until the forward
    pass ends. Offloaded, the blocks' saved copies wait on the host (`host`) and one block's come back; the head's
    are saved outside the model's forward pass and stay."""
    if not (run.activation_checkpointing or run.offload_activations):
        return dict(start=saved.weight_copies, backward=saved.weight_copies, forward_end=0, host=0)
    checkpointed = run.activation_checkpointing.checkpoints
    layer_copies = list(enumerate(saved.layer_weight_copies))
    # the head's, and those of the blocks not checkpointed (every:N)
    kept = saved.weight_copies - sum(copies for index, copies in layer_copies if checkpointed(index))
    if run.offload_activations:
        head = saved.weight_copies - sum(saved.layer_weight_copies)
        return dict(start=head, backward=head + max(saved.layer_weight_copies, default=0), host=kept - head,
                    forward_end=max(saved.cached_weight_copies, head))
    return dict(start=kept, backward=kept + max((c for i, c in layer_copies if checkpointed(i)), default=0),
                forward_end=max(saved.cached_weight_copies, kept), host=0)


def _block_backward(run: _Run, layout: Layout) -> dict:
    """What the backward pass of one block allocates on top of the activations, and the root's gradients."""
    config = run.rank_config
    unsharded = lambda params: sum(math.prod(p.shape) for p in params)  # noqa: E731
    grad_itemsize = run.compute if (run.autocast or run.fsdp) else run.param_compute
    widest = max(config.qkv_size, _mlp_width(config), config.n_embd)
    activation_grads = 3 * run.tokens * widest * grad_itemsize + 2 * run.tokens * config.n_embd * run.param_compute
    math_path = math_attention(config, run.device, run.precision)
    by_matmuls = matmul_attention(config, run.device, run.precision, run.seq_length)
    if config.attention_logit_softcapping is not None:
        attention = "soft-capped attention, materialized"
    elif math_path:
        attention = "math attention: no fused float32 kernel takes grouped keys"
    elif by_matmuls:
        attention = "matmul attention (the CPU's, short sequences)"
    else:
        attention = "flash attention" if run.device == "cuda" else "CPU flash attention"
    if math_path or config.attention_logit_softcapping is not None:
        # The attention weights' gradient and the scores' gradient: (B, H, T, T) each.
        activation_grads += 2 * run.micro_batch_size * config.n_head * run.seq_length**2 * run.compute
    elif by_matmuls:  # the same for the last block of queries (`MatmulAttention.query_block`), in float32
        rows = min(MatmulAttention.query_block, run.seq_length)
        activation_grads += 2 * run.micro_batch_size * config.n_head * rows * run.seq_length * 4
    top_trainable = unsharded(layout.top_block_trainable)
    reduce_bytes = run.master  # FSDP's reduce dtype: float32 for -mixed (and 32-true), 16 bits for -true
    if run.fsdp:
        # The block's unsharded gradients in the compute dtype, and the reduce-scatter input in the reduce dtype.
        weight_grads = top_trainable * (run.compute + reduce_bytes)
    elif run.optimizer_in_backward:  # each weight's gradient is stepped and freed as soon as it is made
        weight_grads = max((math.prod(p.shape) for p in layout.top_block_trainable), default=0) * run.master
    else:
        weight_grads = 0 if run.accumulate_gradients else top_trainable * run.master
    dequantized = 0
    if run.quantize and layout.quantized_shapes:
        dequantized = max(dequantize_bytes(shape, run.stored_quantize, run.compute, run.param_compute)
                          for shape in set(layout.quantized_shapes))
    root_trainable = unsharded([p for p in _root_units(run, layout, run.config.tie_embeddings)[2] if p.trainable])
    if run.fsdp:
        # the root reduces its gradients after the whole backward (the embedding's unit its own, made last; the
        # head's its own, reduce-scattered before the blocks' backward passes)
        root_grads = root_trainable * run.compute
    else:  # with the optimizer in the backward pass the head's gradient is gone before the blocks' backward
        root_grads = 0 if run.accumulate_gradients or run.optimizer_in_backward else root_trainable * run.master
    return dict(
        activation_grads=activation_grads, weight_grads=weight_grads, dequantized=dequantized, root_grads=root_grads,
        attention=attention, math_attention=math_path, all_to_all=_all_to_all_bytes(run),
    )


def _all_to_all_bytes(run: _Run) -> int:
    """What one layer's all-to-all holds beyond what autograd saves, in the backward pass (its gradients travel the
    same way): under expert parallelism the routed rows (k per token: as many come in as go out when the routing is
    balanced) received and sent back; under context parallelism the contiguous copy of the local queries, keys and
    values sent and what comes back (latent attention: the queries, and the latents with their rotary keys, sent to
    and gathered from each of the N ranks)."""
    config = run.rank_config
    if run.expert > 1:
        return 2 * config.n_expert_per_token * run.tokens * config.n_embd * run.compute
    if run.context > 1 and config.kv_lora_rank is not None:
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        return 2 * run.tokens * (config.n_head * config.head_size + run.context * latent) * run.compute
    if run.context > 1:
        return 2 * run.tokens * config.qkv_size * run.compute
    return 0


def _moments(run: _Run, state: dict, activations: dict, gathered: dict, backward: dict) -> dict[str, dict]:
    """Every row's size at each moment of the step that can be the peak."""
    held = state["gradients_held"]
    buffers = activations["recompute"] + backward["activation_grads"] + backward["weight_grads"]
    buffers += backward["dequantized"] + backward["all_to_all"]
    root_grads = backward["root_grads"]
    moments = {}
    if run.autocast and (run.activation_checkpointing or run.offload_activations):
        moments["end of the forward pass"] = dict(
            gradients=held, gathered_params=gathered["forward_end"], activations=activations["activations"],
            logits_loss=activations["chunk_logits"], buffers=backward["dequantized"],
        )
    moments["start of the backward pass"] = dict(
        gradients=held, gathered_params=gathered["start"], activations=activations["activations"],
        logits_loss=activations["logits_loss"], buffers=backward["dequantized"],
    )
    moments["backward pass of the last block"] = dict(
        gradients=held + root_grads, gathered_params=gathered["backward"],
        activations=activations["backward"], buffers=buffers,
    )
    # Under FSDP the root's parameters stay gathered and its gradients unsharded until the backward pass ends.
    moments["optimizer step"] = dict(
        gradients=state["resident"]["gradients"] + (root_grads if run.fsdp else 0), gathered_params=gathered["root"]
    )
    for moment in moments.values():
        moment.update(
            parameters=state["resident"]["parameters"], optimizer_state=state["resident"]["optimizer_state"]
        )
    return moments


def _pipeline_device(run: _Run, saved: SavedActivations) -> tuple:
    """Under pipeline parallelism, the rows of the pipeline rank whose device peaks (every rank planned by
    `_pipeline_rank`), as (layout, state, activations, gathered, backward, moments) of that device."""
    from litgpt.plan.pipeline import schedule_actions

    actions = schedule_actions(run.pipeline_schedule, run.pipeline, run.stages_per_rank, run.microbatches)
    planned = [_pipeline_rank(run, saved, rank, actions[rank]) for rank in range(run.pipeline)]
    return max(planned, key=lambda rows: max(sum(moment.values()) for moment in rows[-1].values()))


def _pipeline_rank(run: _Run, saved: SavedActivations, rank: int, actions: list[tuple[str, int]]) -> tuple:
    """One pipeline rank's device: its stages' parameters (FSDP-sharded over the data-parallel devices; each stage
    kept gathered from its first forward pass to the end of the step, and its gradients accumulated unsharded until
    the schedule reduces them after the last micro-batch, as torch.distributed.pipelining sets FSDP up), and at
    each action of its schedule (`litgpt.plan.pipeline.held_at_each_action`) the activations of the micro-batches
    each stage holds. A stage's micro-batch keeps what its blocks save (`_activation_rows`), a non-last stage's
    output until its backward pass, less the input of a non-first stage, which is a receive buffer: the stage
    allocates one per micro-batch of the step for the activations it receives (all but the first stage) and one for
    the gradients (all but the last), kept across steps. A zero-bubble I pass keeps the whole micro-batch until its
    W pass (retain_graph), and the gradients of the outputs of its blocks' trainable weights (the W pass starts
    from them). The last stage's loss tensors and a block's backward pass come on top."""
    from litgpt.plan.layout import stage_layout
    from litgpt.plan.pipeline import BACKWARD_WEIGHT, FORWARD, device_stages, held_at_each_action

    stages = device_stages(rank, run.pipeline, run.stages_per_rank, run.pipeline_schedule, run.config.n_layer)
    layout = stage_layout(run.rank_recipe, stages, run.expert)
    state, backward = _resident_state(run, layout), _block_backward(run, layout)
    # What travels between stages, in the compute dtype: under tensor parallelism the device's share of the positions.
    hidden = -(-run.tokens // run.tensor) * run.config.n_embd * run.compute
    ends = sum(math.prod(p.shape) for p in layout.root if p.trainable)  # the embedding's or the head's
    per_stage, blocks = {}, iter(layout.blocks)
    for stage in stages:
        rows = _activation_rows(run, saved.of_stage(stage.layers, stage.first, stage.last), list(stage.layers))
        rows["micro_batch"] = rows["activations"] + (0 if stage.last else hidden) - (0 if stage.first else hidden)
        trainable = [p for _ in stage.layers for p in next(blocks) if p.trainable]
        rows["weights_inputs"] = sum(p.shape[0] for p in trainable) * run.tokens * run.compute
        rows["gradients"] = (sum(math.prod(p.shape) for p in trainable)
                             + (ends if stage.first or stage.last else 0)) * run.master
        per_stage[stage.index] = rows
    receive = run.microbatches * hidden * sum((not stage.first) + (not stage.last) for stage in stages)
    fixed = dict(parameters=state["resident"]["parameters"], optimizer_state=state["resident"]["optimizer_state"],
                 gathered_params=sum(_gathered_bytes(run, p) for p in layout.params))
    timeline = held_at_each_action(actions)
    busiest = {"most activations held in the schedule": {}, "backward pass of a block in the schedule": {}}
    for held in timeline:
        rows = per_stage[held.stage]
        activations = sum(count * per_stage[index]["micro_batch"] for index, count in held.activations.items())
        activations += sum(count * per_stage[index]["weights_inputs"] for index, count in held.awaiting_weights.items())
        gradients = sum(per_stage[index]["gradients"] for index in held.with_gradients)
        loss = rows["logits_loss"] if held.stage == stages[-1].index and stages[-1].last else 0
        moments = {"most activations held in the schedule": dict(
            fixed, gradients=gradients, activations=activations, buffers=receive,
            logits_loss=loss if held.kind != BACKWARD_WEIGHT else 0)}
        if held.kind != FORWARD:  # the backward pass of one of its blocks (a W pass's recomputes what it needs too)
            moments["backward pass of a block in the schedule"] = dict(
                fixed, gradients=gradients, activations=activations - rows["micro_batch"] + rows["backward"],
                buffers=receive + rows["recompute"] + backward["activation_grads"] + backward["weight_grads"])
        for name, moment in moments.items():
            if sum(moment.values()) > sum(busiest[name].values()):
                busiest[name] = moment
    busiest["optimizer step"] = dict(fixed, gathered_params=0, gradients=state["resident"]["gradients"],
                                     buffers=receive)
    in_flight = {index: max(held.activations.get(index, 0) for held in timeline) for index in per_stage}
    activations = dict(per_stage[stages[-1].index], pipeline_rank=rank, stages=stages, receive=receive,
                       in_flight=in_flight)
    gathered = dict(detail=f"the device's {len(stages)} stage(s) whole, compute dtype, from forward to the step's end")
    return layout, state, activations, gathered, backward, {name: rows for name, rows in busiest.items() if rows}


def _add_frozen(run: _Run, name: str, frozen: Config, layout: Layout, moments: dict[str, dict],
                outputs_reach_the_loss: bool = True) -> int:
    """Add the frozen model `name` (a distillation teacher, a preference reference:
    `litgpt.train.recipe.Recipe.frozen_model`) of config `frozen` and parameters `layout` to every moment; returns
    its weights' bytes on the device. A reference (`outputs_reach_the_loss` False) reduces its outputs to
    log-probabilities in its own forward pass: only its weights and that pass count.

    Its weights are in the compute dtype, sharded like the model's; its final norm and head (and a tied embedding)
    stay gathered after its first forward pass, beside its shard. Its final hidden states live from its forward pass to
    the end of the model's backward pass, and one chunk of the loss holds, beside the model's logits, the teacher's
    (their 16-bit product and float32 copy) and at most three more float32 (positions, vocab) buffers of the KD loss
    (the student's softened log-probabilities and two temporaries: `litgpt.train.loss.distillation_chunk`). Its
    own forward pass, which comes first, is a moment of its own: two of its blocks gathered and one block's
    intermediate activations (none are saved: no gradient)."""
    numel = lambda params: sum(math.prod(p.shape) for p in params)  # noqa: E731
    if run.fsdp:
        shards = sum(_shard_numel(p.shape, run.shard) for p in layout.params) * run.compute
        embedding, _, _ = _root_units(run, layout, frozen.tie_embeddings, trains=False)  # resharded after each forward
        resident = (0 if run.cpu_offload else shards) + (numel(layout.root) - numel(embedding)) * run.compute
    else:
        resident = layout.total_params * run.compute
    hidden = run.tokens * frozen.n_embd * run.compute
    per_row = (2 if run.compute == 2 else 0) + 4 + 3 * 4 + (4 if frozen.final_logit_softcapping is not None else 0)
    for phase, moment in moments.items():
        moment["parameters"] += resident
        if not outputs_reach_the_loss:
            continue
        if phase != "optimizer step":
            moment["activations"] = moment.get("activations", 0) + hidden
        if "logits_loss" in moment and phase == "start of the backward pass":
            moment["logits_loss"] += run.loss_chunk_size * frozen.padded_vocab_size * per_row
    blocks = sorted(numel(block) for block in layout.blocks)[-2:] if run.fsdp and run.shard > 1 else []
    widest = max(frozen.qkv_size, _mlp_width(frozen), frozen.n_embd)
    first = moments["optimizer step"]
    moments[f"{name}'s forward pass"] = dict(
        parameters=first["parameters"], optimizer_state=first["optimizer_state"],
        gradients=moments["start of the backward pass"]["gradients"], gathered_params=sum(blocks) * run.compute,
        activations=hidden, buffers=3 * run.tokens * widest * run.compute,
    )
    return resident


def _describe(run: _Run, layout: Layout, state: dict, activations: dict, gathered: dict, backward: dict,
              loading: int) -> tuple[dict[str, str], list[str]]:
    """The table's detail column and the notes under it."""
    dtype_name = {4: "float32", 2: "16-bit"}
    master, config = dtype_name[run.master], run.config
    placement = f"1/{run.shard} shard" if run.shard > 1 else ("replicated" if run.fsdp else "one device")
    if run.cpu_offload:
        placement = "in CPU memory"
    elif run.expert > 1:
        placement += f" (routed experts 1/{run.expert_shard})"
    details = {
        "parameters": f"{placement}, {master}" + (f", blocks' linears {run.stored_quantize}" if run.quantize else ""),
        "gradients": f"{placement}, {master}"
        + (" (+ the root's unsharded in the backward pass)" if run.fsdp and backward["root_grads"] else ""),
        "optimizer_state": f"2 moments, {placement}, {master}",
        "gathered_params": gathered["detail"],
        "activations": _activations_detail(run, activations),
        "logits_loss": f"1 chunk of {run.loss_chunk_size:,} of {run.tokens:,} positions x "
        + (f"{run.rank_config.padded_vocab_size:,} of {config.padded_vocab_size:,} vocab rows"
           if run.tensor > 1 else f"{config.padded_vocab_size:,} vocab") + ", + head and hidden gradients",
        "buffers": ("1 block recomputed + " if activations["recompute"] else "")
        + "1 block's backward" + (" + dequantizing a slice of 1 weight" if run.quantize else "")
        + (" + its all-to-all" if backward["all_to_all"] else "")
        + (f" + the stages' receive buffers ({run.microbatches} micro-batches)" if activations.get("receive") else ""),
    }
    if run.pipeline > 1:
        details["gradients"] = f"the stages' unsharded until the step's last backward pass, then {placement}, {master}"
    notes = _parallel_notes(run, activations)
    if loading:
        steps = "each block's whole NF4 weights, then only its shards" if run.fsdp else "one weight at a time"
        notes.append(
            f"--quantize: the base is quantized from the memory-mapped file onto the device ({steps}): at most "
            f"{fmt(loading)} (+ overhead) at that moment, before training starts."
        )
    if run.quantize and run.stored_quantize != run.quantize:
        notes.append(
            f"--quantize {run.quantize} on several devices: planned as torchao NF4 (ao.nf4), as the training commands "
            "store it (FSDP2 shards it and all-gathers it in 4 bits)."
        )
    if run.method == "lora" and run.quantize is None:
        notes.append(
            f"The frozen base weights are stored in {master} (the training commands cast the whole model "
            "to the master dtype); --quantize stores the blocks' linear weights in 4 or 8 bits."
        )
    if run.optimizer_in_backward:
        unit = "one FSDP unit's sharded gradients" if run.fsdp else "one parameter's gradient"
        details["gradients"] = f"{unit} at a time, {master} (stepped in the backward pass)"
        notes.append("--train.optimizer_in_backward: each parameter is stepped as soon as its gradient is ready and "
                     "the gradient freed, so the gradients are never all held; one micro-batch per step.")
    if run.fsdp and run.sharding_strategy == "HYBRID_SHARD" and run.num_nodes == 1:
        notes.append("HYBRID_SHARD on one node shards over its devices, as FULL_SHARD does.")
    if run.cpu_offload:
        notes.append(
            f"CPU offload: the sharded parameters, gradients and optimizer state take {fmt(state['host_per_node'])} "
            f"of host memory per node ({run.devices} device(s)); the optimizer step runs on the CPU."
        )
    if run.device == "cuda":
        notes.append(
            f"Overhead assumed: {fmt(CUDA_CONTEXT_BYTES)} for the CUDA context and library workspaces, plus "
            f"{CUDA_FRAGMENTATION:.0%} of the peak for the caching allocator's fragmentation."
        )
    else:
        notes.append(f"Overhead assumed: {fmt(CPU_RUNTIME_BYTES)}, the resident size of Python and torch themselves.")
    if config.mlp_class_name == "LLaMAMoE":
        notes.append("Mixture of experts: the routed rows (k per token, sorted by expert) have fixed shapes: the plan "
                     "holds whatever the routing.")
    if backward["math_attention"]:
        notes.append(
            "No fused CUDA attention kernel takes float32 with grouped keys: the math path keeps a (batch, heads, seq, "
            "seq) softmax per layer; a 16-bit precision runs flash attention instead."
        )
    return details, notes


def _parallel_notes(run: _Run, activations: dict) -> list[str]:
    """What expert, context and pipeline parallelism change in the rows, said once."""
    notes, config = [], run.config
    if run.pipeline > 1:
        notes.append(_pipeline_note(run, activations))
    if run.expert > 1:
        layers = config.n_layer - config.moe_first_dense_layers
        width = f", 1/{run.tensor} of each one's width (--parallel.tensor {run.tensor})" if run.tensor > 1 else ""
        notes.append(
            f"Expert parallelism: each device holds {config.n_expert // run.expert} of the {config.n_expert} experts "
            f"of each of {layers} MoE layers{width}, sharded over the {run.expert_shard} device(s) holding the same "
            "experts; the router, the shared experts and the rest of the model are sharded over the data-parallel "
            f"devices. The all-to-all buffers assume balanced routing ({config.n_expert_per_token} rows per token in "
            "and out)."
        )
    if run.context > 1:
        notes.append(
            f"Context parallelism: each device runs {run.seq_length:,} of the {run.whole_seq_length:,} positions of "
            f"every sequence (activations, logits), attention over the whole sequence for 1/{run.context} of its heads "
            f"(all-to-all buffers); FSDP shards over the shard and context devices ({run.shard})."
        )
    return notes


def _pipeline_note(run: _Run, activations: dict) -> str:
    """Which device the rows are, what it runs and how many micro-batches its schedule keeps in flight."""
    def stage_words(stage) -> str:
        ends = (["the embedding"] if stage.first else []) + (["the final norm and head"] if stage.last else [])
        blocks = f"blocks {stage.layers.start}-{stage.layers.stop - 1}" if len(stage.layers) > 1 \
            else f"block {stage.layers.start}"
        return f"stage {stage.index} ({', '.join([blocks, *ends])})"

    stages = activations["stages"]
    in_flight = ", ".join(f"{activations['in_flight'][stage.index]} on stage {stage.index}" for stage in stages)
    return (
        f"Pipeline parallelism: the rows are pipeline rank {activations['pipeline_rank']}'s device (of "
        f"{run.pipeline}; the one that peaks), running {'; '.join(map(stage_words, stages))}. {run.pipeline_schedule} "
        f"over {run.microbatches} micro-batches per step (--train.global_batch_size) keeps at most {in_flight} in "
        f"flight (torch.distributed.pipelining's order), each padded to {run.seq_length:,} positions"
        + ("; a zero-bubble schedule keeps a micro-batch whole until its weights' gradients are taken"
           if "ZeroBubble" in run.pipeline_schedule else "")
        + f". FSDP shards each stage over the {run.shard} data-parallel device(s) and keeps it gathered for the "
        "whole step, its gradients unsharded until the last micro-batch; every stage but the first receives its "
        "activations, every stage but the last its gradients, into a buffer per micro-batch."
    )


def _activations_detail(run: _Run, activations: dict) -> str:
    if run.pipeline > 1:
        held = sum(activations["in_flight"].values())
        return f"{held} micro-batch(es) of the device's stage(s) in flight at most"
    if run.offload_activations:
        kept = " + matmul and attention outputs" if run.activation_checkpointing.mode == "ops" else ""
        return f"head{kept} + 1 block's brought back; the blocks' saved tensors on the host"
    checkpointing, n_layer = run.activation_checkpointing, run.config.n_layer
    every_block = f"{n_layer} blocks x {fmt(activations['largest_layer'])} + head"
    if checkpointing.mode == "every":
        checkpointed = sum(map(checkpointing.checkpoints, range(n_layer)))
        return f"{checkpointed} block inputs + {n_layer - checkpointed} blocks + head"
    if checkpointing.mode == "ops":
        return f"{n_layer} block inputs + matmul and attention outputs + head"
    return f"{n_layer} block inputs + head" if checkpointing else every_block


def _overhead(peak: int, device: str) -> int:
    if device == "cuda":
        return CUDA_CONTEXT_BYTES + int(CUDA_FRAGMENTATION * peak)
    return CPU_RUNTIME_BYTES


def _lora_targets(lora) -> list[str]:
    if lora is None:
        return []
    return [name for name in ("query", "key", "value", "projection", "mlp", "head") if getattr(lora, name)]


def _shard_numel(shape: tuple[int, ...], shard: int) -> int:
    """Elements of the largest shard: FSDP2 splits dim 0 into `shard` equal chunks, padding the last."""
    if not shape:
        return 1
    return -(-shape[0] // shard) * math.prod(shape[1:])


def _gathered_bytes(run: _Run, p: Param) -> int:
    """One parameter as FSDP all-gathers it: in the compute dtype, an NF4 weight in its own 4-bit layout (kept out of
    FSDP, never gathered, over a shard group of one)."""
    if p.quantized:
        return nf4_bytes(p.shape, run.compute, run.shard, gathered=True) if run.shard > 1 else 0
    return math.prod(p.shape) * run.compute


def _quantized_loading(run: _Run, layout: Layout) -> int:
    """The device's peak while the training commands quantize the base from the memory-mapped file, one weight at a
    time: the quantized weights so far (none with cpu_offload: FSDP moves each block's shards to CPU memory as it
    shards the block), under FSDP the whole NF4 weights of the block about to be sharded, and the work of quantizing
    the largest weight."""
    quantized = [p for p in layout.params if p.quantized]
    largest = max((math.prod(shape) for shape in layout.quantized_shapes), default=0)
    so_far = 0 if run.cpu_offload else sum(_resident_bytes(run, p) for p in quantized)
    work = quantize_work_bytes(largest, run.stored_quantize, run.compute, run.master)
    whole_block = 0
    if run.fsdp:
        whole_block = max(sum(nf4_bytes(p.shape, run.compute, run.shard, gathered=True) for p in ps if p.quantized)
                          for ps in layout.blocks)
    return so_far + whole_block + work


def _mlp_width(config: Config) -> int:
    if config.mlp_class_name == "LLaMAMoE":  # k routed experts and the shared ones per token; dense first layers
        routed = config.moe_intermediate_size * config.n_expert_per_token + (config.moe_shared_intermediate_size or 0)
        return max(routed, config.intermediate_size) if config.moe_first_dense_layers else routed
    return config.intermediate_size


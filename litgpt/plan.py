"""`litgpt plan`: the memory one training step needs on each device, worked out before anything is allocated.

`estimate(config, ...)` returns a `MemoryPlan` (bytes per device, with the peak and where in the step it falls);
`main` is the command, which prints it as a table or as JSON. Its options go through the training commands' own
checks (`litgpt.precision.check_precision`, `litgpt.distributed.topology.check_sharding_strategy` and `Topology`,
`litgpt.quantize.check_quantize_mode`).

Nothing is allocated: the model is measured, not re-described. `saved_activation_bytes` builds `litgpt.model.GPT`
on the meta device, wraps it as the training commands do (`litgpt.lora.add_lora` and
`mark_only_lora_as_trainable`), gives it fake parameters (`torch._subclasses.fake_tensor.FakeTensorMode`: shapes,
dtypes and strides, no memory) and runs one forward pass under `torch.autograd.graph.saved_tensors_hooks`. The hooks
see every tensor autograd keeps for the backward pass; each distinct storage counts once (views share theirs), and
a saved parameter is not an activation (under FSDP the run's parameters stand for the gathered ones, a row of their
own). Forward hooks on the blocks say which block saved what, and what each block received as its input. The result
is kept per model config and settings for the rest of the process.

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
  reduce-scatter after every micro-batch).
- optimizer state: AdamW's two moments per trainable parameter, in the master dtype, sharded.
- gathered parameters: FSDP2 (`fully_shard` per Block, then the root) all-gathers a unit's parameters in the
  compute dtype (NF4 weights in their 4-bit layout) before it runs: two blocks at a time (one running, one
  prefetched) and, in the backward pass, the root (embedding, final norm, head) throughout; with SHARD_GRAD_OP
  every unit stays gathered from its forward until its backward. The shard group comes from
  `litgpt.distributed.topology.Topology`, as in training.
  On a single device (no FSDP) with a -mixed precision, the fake run goes under CPU autocast over float32 weights:
  autocast's 16-bit copies of the weights (recognized as casts of a parameter) that autograd saves take this row
  instead of the activations.
- activations: what the hooks saw, per block and for the rest of the model (the embedding's indices, the final norm,
  the head's input). With activation checkpointing a checkpointed block keeps only its input (as the hooks saw it)
  and, with `ops`, the outputs of its matmuls and attention kernels (`litgpt.distributed.activation_checkpointing`'s
  list of operations, recorded in the same fake run); the others (every:N) keep everything. In the backward pass
  one checkpointed block at a time recomputes the rest (a work buffer).
- logits and loss: training never holds the whole logits (`litgpt.train.loss.chunked_head_loss`): the head and the
  loss run over chunks of positions (`loss_chunk_size`, by default `litgpt.train.loss.auto_chunk_size`, the rule
  training uses), and the backward pass recomputes each chunk. At the start of the backward pass one chunk is alive:
  its float32 logits, which become their gradient in place (4 bytes per position and vocabulary row), their 16-bit
  copy with a 16-bit compute dtype (2 more), the tanh of a final soft-capping (4 more); beside it, for the whole
  chunk loop, the hidden states' gradient and the gradients of the head's trainable weights (under autocast also
  each chunk's 16-bit product before it is added to the float32 one).
- work buffers: what one block's backward pass allocates on top (activation gradients, estimated from the widest of
  its layers, its weight gradients, FSDP's reduce-scatter input) and, with --quantize, one dequantized weight (for
  torchao's NF4 what its dequantization holds at once: int64 codes, half-size lookups and the result).

The fake run executes the model's own code on fake CPU tensors. What it cannot decide by itself, and how the plan
adjusts for it (each adjustment is one rule in `_Kernels`, `_NativeDropout` or `_math_attention`):

- 16-bit compute is run in bfloat16 (float16 has the same sizes). A -mixed precision on one device runs under the
  CPU's autocast, whose op lists are taken for CUDA's: for the ops of this model they agree (linear layers, matmuls
  and attention in 16 bits; norms and float32 softmax as they are).
- --quantize: the fake run keeps the frozen base linears in floating point. bitsandbytes' quantized matmul and
  torchao's `linear_nf4` save what a frozen float linear saves: the weight (not an activation), never its input.
- mixture of experts: the routed rows are sorted by expert into tensors of fixed shape (k x tokens rows), so the
  memory does not depend on which expert a token goes to, and the fake run needs no routing of its own.
- --device cuda, where kernels differ from the CPU's:
  - attention: in float32 with grouped keys (n_query_groups < n_head) no fused CUDA kernel applies, and the fake run
    selects PyTorch's math path (`sdpa_kernel(SDPBackend.MATH)`), which keeps the (batch, heads, seq, seq) softmax.
    Otherwise the CPU's flash kernel saves what CUDA's flash and memory-efficient kernels save (q, k, v, output,
    log-sum-exp), except that the memory-efficient kernel (float32, or a mask such as a sliding window) lays its
    output out as (batch, seq, heads, head size), which changes whether the projection's reshape copies it; the
    kernels' 16-byte random-number state and the memory-efficient kernel's padding of the log-sum-exp to 32 rows
    are left out. Soft-capped attention (Gemma 2) is the model's own matmuls and softmax, on every device.
  - dropout (LoRA's): CUDA's fused kernel saves a one-byte mask, the CPU's the scaled noise in the input's dtype.
  - LayerNorm keeps its mean and reciprocal deviation in float32 on CUDA, in the input's dtype on the CPU.

Distillation (`--teacher_config`): the frozen teacher's weights, final hidden states, chunk of logits and forward
pass are added as `_add_teacher` describes.

The peak is the largest of three moments: the start of the backward pass (all activations and the loss tensors
alive), the backward pass of the last block (its work buffers on top of the activations), and the optimizer step
(all gradients and optimizer state); with autocast and checkpointing also the end of the forward pass, while
autocast's cache still holds 16-bit copies of every trainable weight. Every row of the table gives its own largest
size and its size at the peak.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from litgpt.args import FSDP1_BACKWARD, ActivationCheckpointing, prefetch_blocks
from litgpt.config import Config
from litgpt.distributed.activation_checkpointing import is_kept
from litgpt.errors import UserError

METHODS = ("full", "lora")
PLAN_DEVICES = ("cuda", "cpu")
GiB = 2**30

# What a device needs beyond the tensors counted here.
CUDA_CONTEXT_BYTES = 1 * GiB  # CUDA context and library workspaces (0.82 GiB measured on an H100, torch 2.11)
CUDA_FRAGMENTATION = 0.10  # the caching allocator reserves more than it hands out: a share of the peak
CPU_RUNTIME_BYTES = GiB // 2  # resident size of Python + torch + litgpt before the model (0.42 GiB, torch 2.13)
BNB_BLOCK = 64  # bitsandbytes' 4-bit quantization block (one absmax per 64 weights)
# torchao 0.18's NF4 dequantization holds, per weight: the 4-bit codes unpacked to int64 (8 bytes), then the looked-up
# values, their scaled copies and the interleaved result (3 in the compute dtype); measured in tests/test_plan.py.
NF4_DEQUANTIZE_INT64 = 8
NF4_DEQUANTIZE_COPIES = 3
# Quantizing one weight to NF4 on the device: the 16-bit weight from the file, its copy in the compute dtype, the
# uint8 codes before packing and two temporaries in the compute dtype per weight, plus the nearest-code search over
# chunks of 2**20 weights (16 codes: a distance and its absolute value) in the compute dtype.
NF4_QUANTIZE_FIXED = 2 + 1
NF4_QUANTIZE_COPIES = 3
NF4_QUANTIZE_CHUNK = 2 * 16 * 2**20

ROWS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state (AdamW)"),
    ("gathered_params", "gathered parameters"),
    ("activations", "activations"),
    ("logits_loss", "logits + loss (float32)"),
    ("buffers", "work buffers"),
)


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
    host_memory_per_node: int  # with cpu_offload: the sharded state of the node's devices in CPU memory
    activations_per_layer: int  # one (typical) block's saved activations without checkpointing
    attention: str  # which attention kernel the activations assume
    row_details: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    loss_chunk_size: int = 0  # positions per chunk of the head and loss
    teacher_params: int = 0  # distillation: the frozen teacher's parameters (counted in the rows, not above)
    teacher_bytes: int = 0  # its weights as they stay on the device
    kv_cache_bytes_per_token: int = 0  # generation (not training): one sequence's KV cache per position, all layers

    def to_dict(self) -> dict:
        return asdict(self)


# ---- the command ---------------------------------------------------------------------------------------------------
def main(
    model_name: Optional[str] = None,
    *,
    model_config: Optional[Config] = None,
    method: str = "full",
    precision: str = "bf16-mixed",
    sharding_strategy: str = "HYBRID_SHARD",
    devices: int = 1,
    num_nodes: int = 1,
    micro_batch_size: int = 1,
    seq_length: Optional[int] = None,
    lora_r: int = 8,
    lora_dropout: float = 0.05,
    lora_query: bool = True,
    lora_key: bool = False,
    lora_value: bool = True,
    lora_projection: bool = False,
    lora_mlp: bool = False,
    lora_head: bool = False,
    quantize: Optional[str] = None,
    activation_checkpointing: Union[bool, int, str] = False,
    cpu_offload: bool = False,
    accumulate_gradients: bool = True,
    device: str = "cuda",
    device_memory_gb: float = 80.0,
    json: bool = False,
    loss_chunk_size: Optional[int] = None,
    teacher_model_name: Optional[str] = None,
    teacher_config: Optional[Config] = None,
    backward_prefetch: Union[bool, int, str, None] = 0,
) -> None:
    """Print the memory a training run needs per device, and whether it fits, before anything is allocated.

    Args:
        model_name: A registered model name (`litgpt download list`), or leave out and give --model_config.
        model_config: The model's config fields (in YAML under `model_config:`), instead of a name.
        method: full (every weight trains) or lora (only the adapters train, as `litgpt finetune_lora`).
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or 16-true, as the training commands take it.
        sharding_strategy: How FSDP splits the model over the devices: HYBRID_SHARD (shard within a node,
            replicate across nodes), FULL_SHARD (shard over every device), SHARD_GRAD_OP (as FULL_SHARD, but the
            parameters stay gathered between forward and backward) or NO_SHARD (replicate). Unused on one device.
        devices: Devices per node.
        num_nodes: Nodes of the run.
        micro_batch_size: Samples per forward/backward pass on one device.
        seq_length: Tokens per sample (default: the model's block size).
        lora_r: The adapters' rank (method lora).
        lora_dropout: Dropout on the adapters' input (its masks are saved for the backward pass).
        lora_query: Adapt the query projection.
        lora_key: Adapt the key projection.
        lora_value: Adapt the value projection.
        lora_projection: Adapt the attention output projection.
        lora_mlp: Adapt the MLP.
        lora_head: Adapt the output head.
        quantize: QLoRA: the frozen base weights of the blocks in bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.int8 or ao.nf4
            (method lora). On several devices FSDP shards them as torchao NF4 (ao.nf4, and bnb.nf4 / bnb.nf4-dq
            stored so), as the training commands do; bnb.fp4 and bnb.int8 run on one device only.
        activation_checkpointing: What the backward pass recomputes, as --train.activation_checkpointing takes it:
            false, true (or full: every block), N or every:N (one block in N), or ops (every block keeps its matmul
            and attention outputs).
        cpu_offload: Keep the sharded parameters, gradients and optimizer state in CPU memory (FSDP only).
        accumulate_gradients: Gradients of earlier micro-batches are held while the next one runs (the global batch
            is larger than devices x micro batch, as in the recipes); false for one micro-batch per step.
        device: cuda or cpu: which attention kernels and dropout masks, and which fixed overhead, to assume.
        device_memory_gb: Memory of one device in GiB (2**30 bytes) to check the plan against.
        json: Print the plan as JSON instead of a table.
        loss_chunk_size: Positions per chunk of the output head and loss, as --train.loss_chunk_size (None:
            automatic, the training commands' rule).
        teacher_model_name: Distillation (`litgpt distill`): the frozen teacher's registered name.
        teacher_config: Or the teacher's config fields (in YAML under `teacher_config:`).
        backward_prefetch: As --fsdp.backward_prefetch: the blocks a block's backward pass gathers ahead (0 or 1:
            FSDP2's own one block ahead; N: N ahead, N - 1 more blocks gathered at once).
    """
    from litgpt.lora import LoRASettings

    config = resolve_config(model_name, model_config)
    lora = None
    if method == "lora":
        lora = LoRASettings(
            r=lora_r, dropout=lora_dropout, query=lora_query, key=lora_key, value=lora_value,
            projection=lora_projection, mlp=lora_mlp, head=lora_head,
        )
    teacher = None
    if teacher_model_name is not None or teacher_config is not None:
        teacher = resolve_config(teacher_model_name, teacher_config)
    plan = estimate(
        config, method=method, precision=precision, sharding_strategy=sharding_strategy, devices=devices,
        num_nodes=num_nodes, micro_batch_size=micro_batch_size, seq_length=seq_length, lora=lora, quantize=quantize,
        activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
        accumulate_gradients=accumulate_gradients, device=device, device_memory_gb=device_memory_gb,
        loss_chunk_size=loss_chunk_size, teacher=teacher,
        backward_prefetch=backward_prefetch,
    )
    if json:
        import json as json_module

        print(json_module.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))


def resolve_config(model_name: Optional[str], model_config: Optional[Config]) -> Config:
    if model_name is not None and model_config is not None:
        raise UserError("Give either a model name or --model_config, not both.")
    if model_config is not None:
        return model_config
    if model_name is None:
        raise UserError(
            "Name a model to plan for (e.g. `litgpt plan --model_name Llama-2-7b-hf`) or give --model_config."
        )
    return Config.from_name(model_name)


# ---- the estimate --------------------------------------------------------------------------------------------------
@dataclass
class _Run:
    """The settings of the planned run, checked, and what follows from them (sizes in bytes per element)."""

    config: Config
    method: str
    precision: str
    sharding_strategy: str
    device: str
    devices: int
    num_nodes: int
    micro_batch_size: int
    seq_length: int
    lora: object
    quantize: Optional[str]
    activation_checkpointing: ActivationCheckpointing
    cpu_offload: bool
    accumulate_gradients: bool
    shard: int  # the shard group: how many devices one copy of the state is split over
    loss_chunk_size: int = 0  # positions per chunk of the head and loss
    backward_prefetch: int = 0  # blocks a block's backward pass gathers ahead (0: FSDP2's implicit one)

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
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def master(self) -> int:  # stored parameters, gradients, optimizer state
        return 4 if self.precision == "32-true" or self.mixed else 2

    @property
    def compute(self) -> int:  # what the math runs in
        return 4 if self.precision == "32-true" else 2

    @property
    def autocast(self) -> bool:  # single device: Fabric's autocast over float32 weights
        return self.mixed and not self.fsdp

    @property
    def param_compute(self) -> int:  # the dtype a module sees its weights in
        return self.compute if self.fsdp else self.master

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_length


def estimate(
    config: Config,
    *,
    method: str = "full",
    precision: str = "bf16-mixed",
    sharding_strategy: str = "HYBRID_SHARD",
    devices: int = 1,
    num_nodes: int = 1,
    micro_batch_size: int = 1,
    seq_length: Optional[int] = None,
    lora=None,
    quantize: Optional[str] = None,
    activation_checkpointing: Union[bool, int, str, ActivationCheckpointing] = False,
    cpu_offload: bool = False,
    accumulate_gradients: bool = True,
    device: str = "cuda",
    device_memory_gb: float = 80.0,
    loss_chunk_size: Optional[int] = None,
    teacher: Optional[Config] = None,
    backward_prefetch: Union[bool, int, str, None] = 0,
) -> MemoryPlan:
    """The per-device memory of one training step; `lora` is a `LoRASettings` (default settings when None);
    `teacher` the config of a frozen teacher the model is distilled from (`_add_teacher`)."""
    run = _check_run(
        config, method=method, precision=precision, sharding_strategy=sharding_strategy, devices=devices,
        num_nodes=num_nodes, micro_batch_size=micro_batch_size, seq_length=seq_length, lora=lora, quantize=quantize,
        activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
        accumulate_gradients=accumulate_gradients, device=device, device_memory_gb=device_memory_gb,
        loss_chunk_size=loss_chunk_size, backward_prefetch=backward_prefetch,
    )
    layout = _parameter_layout(config, run.lora, run.quantize)
    saved = saved_activation_bytes(
        config, micro_batch_size=run.micro_batch_size, seq_length=run.seq_length, precision=run.precision,
        fsdp=run.fsdp, device=run.device, lora=run.lora,
    )
    state = _resident_state(run, layout)
    activations = _activation_rows(run, saved)
    gathered = _gathered_params(run, layout, saved)
    backward = _block_backward(run, layout)
    moments = _moments(run, state, activations, gathered, backward)
    teacher_bytes = _add_teacher(run, teacher, moments) if teacher is not None else 0
    peak_phase, peak_rows = max(moments.items(), key=lambda item: sum(item[1].values()))
    at_peak = {key: peak_rows.get(key, 0) for key, _ in ROWS}
    largest = {key: max(m.get(key, 0) for m in moments.values()) for key, _ in ROWS}
    peak = sum(at_peak.values())
    overhead = _overhead(peak, run.device)
    total = peak + overhead
    device_memory = int(device_memory_gb * GiB)
    loading = _quantized_loading(run, layout) if run.quantize else 0
    needed = max(total, loading + _overhead(loading, run.device) if loading else 0)
    details, notes = _describe(run, layout, state, activations, gathered, backward, loading)
    kv_cache_per_token, kv_cache_note = _kv_cache_per_token(config, run.compute)
    notes.append(kv_cache_note)
    teacher_params = _parameter_layout(teacher, None, None).total_params if teacher is not None else 0
    if teacher is not None:
        details["parameters"] += f" + the teacher's {_fmt(teacher_bytes)}"
        notes.append(
            f"Distillation: the frozen teacher ({teacher.name or 'teacher_config'}, {_count(teacher_params)} "
            f"parameters) in the compute dtype, sharded like the model, its root (embeddings, head) kept gathered: "
            f"{_fmt(teacher_bytes)}; its final hidden states and its chunk of logits are counted with the model's."
        )
    return MemoryPlan(
        model_name=config.name or "model_config", method=run.method, precision=run.precision,
        sharding_strategy=run.sharding_strategy if run.fsdp else "none (1 device)", device=run.device,
        devices=run.devices, num_nodes=run.num_nodes, micro_batch_size=run.micro_batch_size,
        seq_length=run.seq_length, activation_checkpointing=str(run.activation_checkpointing),
        cpu_offload=run.cpu_offload, accumulate_gradients=run.accumulate_gradients, quantize=run.quantize,
        lora_r=run.lora.r if run.lora else None, lora_targets=_lora_targets(run.lora), world_size=run.world,
        shard_group_size=run.shard, replicate_groups=run.world // run.shard, fsdp=run.fsdp,
        total_params=layout.total_params, trainable_params=layout.trainable_params, n_layer=config.n_layer,
        **largest, at_peak=at_peak, peak_phase=peak_phase, peak=peak, overhead=overhead, total=total,
        device_memory=device_memory, fits=needed <= device_memory, margin=device_memory - needed, loading=loading,
        host_memory_per_node=state["host_per_node"], activations_per_layer=max(saved.per_layer, default=0),
        attention=backward["attention"], row_details=details, notes=notes, loss_chunk_size=run.loss_chunk_size,
        teacher_params=teacher_params, teacher_bytes=teacher_bytes, kv_cache_bytes_per_token=kv_cache_per_token,
    )


def _kv_cache_per_token(config: Config, itemsize: int) -> tuple[int, str]:
    """Bytes per position of the KV cache generation allocates (the model's own caches, built on the meta device),
    and a note saying so; latent attention caches its compressed latent, set against full keys and values."""
    from litgpt.model import build_attention

    with torch.device("meta"):
        attn = build_attention(config, 0)
    dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]

    def per_token(**kwargs) -> int:
        cache = attn.new_kv_cache(1, 1, device="meta", dtype=dtype, **kwargs)
        return config.n_layer * sum(t.numel() * t.element_size() for t in (cache.k, cache.v))

    def words(nbytes: int) -> str:
        return f"{nbytes:,} bytes per position, {_fmt(nbytes * config.block_size)} for {config.block_size:,} positions"

    nbytes = per_token()
    note = f"Generation (not in this training plan): one sequence's KV cache takes {words(nbytes)}"
    if config.kv_lora_rank is not None:
        full = words(per_token(latent=False))
        note += f" (latent attention's compressed latent; full keys and values would take {full})"
    return nbytes, note + "."


def _check_run(config: Config, *, method, precision, sharding_strategy, devices, num_nodes, micro_batch_size,
               seq_length, lora, quantize, activation_checkpointing, cpu_offload, accumulate_gradients, device,
               device_memory_gb, loss_chunk_size=None, backward_prefetch=0) -> _Run:
    """The options checked (by the training commands' own validators where they have one) and completed."""
    from litgpt.lora import LoRASettings
    from litgpt.distributed.topology import check_sharding_strategy
    from litgpt.precision import check_precision
    from litgpt.quantize import check_quantize_mode

    if method not in METHODS:
        raise UserError(f"--method {method!r} is not one of {', '.join(METHODS)}.")
    if device not in PLAN_DEVICES:
        raise UserError(f"--device {device!r} is not one of {', '.join(PLAN_DEVICES)}.")
    strategy = str(sharding_strategy).upper()
    check_sharding_strategy(strategy, option="--sharding_strategy")
    for name, value in (("devices", devices), ("num_nodes", num_nodes), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"--{name} must be a whole number >= 1, got {value!r}.")
    world = devices * num_nodes
    check_precision(precision, on_cpu=device == "cpu", fsdp=world > 1)
    seq_length = config.block_size if seq_length is None else seq_length
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise UserError(f"--seq_length must be a whole number >= 1, got {seq_length!r}.")
    if seq_length > config.block_size:
        raise UserError(
            f"--seq_length {seq_length} is longer than the model's block size {config.block_size}: "
            f"use at most {config.block_size}."
        )
    if not (isinstance(device_memory_gb, (int, float)) and device_memory_gb > 0):
        raise UserError(f"--device_memory_gb must be a number > 0, got {device_memory_gb!r}.")
    if quantize is not None:
        check_quantize_mode(quantize, sharded=world > 1)
        if method != "lora":
            raise UserError("--quantize stores frozen base weights: it needs --method lora.")
    if cpu_offload and world == 1:
        raise UserError("--cpu_offload is an FSDP option: it needs more than one device (devices x num_nodes > 1).")
    shard = _shard_group(devices, num_nodes, strategy)
    if quantize is not None:
        from litgpt.quantize import check_nf4_precision, check_quantized_offload, storage_mode

        if world > 1:
            check_quantized_offload("--cpu_offload", cpu_offload, shard, strategy)
        if storage_mode(quantize, world > 1) == "ao.nf4":
            check_nf4_precision(precision, sharded=shard > 1)
    if method == "lora":
        lora = lora if lora is not None else LoRASettings()
    chunk = _loss_chunk(config, micro_batch_size * seq_length, loss_chunk_size)
    return _Run(
        config=config, method=method, precision=precision, sharding_strategy=strategy, device=device,
        devices=devices, num_nodes=num_nodes, micro_batch_size=micro_batch_size, seq_length=seq_length,
        lora=lora if method == "lora" else None, quantize=quantize,
        activation_checkpointing=ActivationCheckpointing.parse(activation_checkpointing, "--activation_checkpointing"),
        cpu_offload=cpu_offload,
        accumulate_gradients=accumulate_gradients, shard=shard,
        loss_chunk_size=chunk, backward_prefetch=prefetch_blocks(backward_prefetch, "--backward_prefetch", FSDP1_BACKWARD),
    )


def _loss_chunk(config: Config, tokens: int, loss_chunk_size: Optional[int]) -> int:
    """Positions per chunk of the head and loss: the option's, or training's automatic rule."""
    from litgpt.train.loss import auto_chunk_size

    if loss_chunk_size is None:
        return auto_chunk_size(tokens, config.n_embd, config.padded_vocab_size)
    if isinstance(loss_chunk_size, bool) or not isinstance(loss_chunk_size, int) or loss_chunk_size < 1:
        raise UserError(f"--loss_chunk_size must be a whole number >= 1, got {loss_chunk_size!r}.")
    return min(loss_chunk_size, tokens)


def _shard_group(devices: int, num_nodes: int, strategy: str) -> int:
    """The devices one copy of the sharded state spans: the shard dimension of training's FSDP mesh."""
    if devices * num_nodes == 1:
        return 1
    from litgpt.distributed.topology import Topology

    with contextlib.redirect_stderr(io.StringIO()):  # Topology's note on HYBRID_SHARD: the plan has its own
        return Topology(devices, num_nodes, strategy).mesh_shape[1]


def _resident_state(run: _Run, layout: "_Layout") -> dict:
    """Parameters, gradients and optimizer state as they stay on the device (or, offloaded, in host memory)."""

    def stored_bytes(p: "_Param") -> int:
        if p.quantized:
            return _quantized_weight_bytes(run, p.shape)
        return _shard_numel(p.shape, run.shard) * run.master

    parameters = sum(stored_bytes(p) for p in layout.params)
    trainable = [p for p in layout.params if p.trainable]
    gradients = sum(_shard_numel(p.shape, run.shard) for p in trainable) * run.master
    optimizer_state = 2 * gradients + 4 * len(trainable)  # exp_avg, exp_avg_sq, and a step count per tensor
    state = dict(
        parameters=parameters, gradients=gradients, optimizer_state=optimizer_state, host_per_node=0,
        # Sharded strategies reduce-scatter after every micro-batch, so accumulation holds sharded gradients
        # (NO_SHARD holds them unsharded, which is the same size there).
        gradients_held=gradients if run.accumulate_gradients else 0,
        resident=dict(parameters=parameters, gradients=gradients, optimizer_state=optimizer_state),
    )
    if run.cpu_offload:
        state["host_per_node"] = run.devices * (parameters + gradients + optimizer_state)
        state["resident"] = dict(parameters=0, gradients=0, optimizer_state=0)
        state["gradients_held"] = 0  # FSDP2 moves each reduce-scattered gradient to CPU memory
    return state


def _activation_rows(run: _Run, saved: "SavedActivations") -> dict:
    """The activations held at the start of the backward pass, and the loss' float32 tensors; and, for the block
    whose backward pass holds the most, what is held then (its own and the earlier blocks' activations) and what
    it recomputes on top."""
    checkpointing = run.activation_checkpointing
    kept, recomputed = [], []
    for index, layer in enumerate(saved.per_layer):
        if not checkpointing.checkpoints(index):
            kept.append(layer)
            recomputed.append(0)
        elif checkpointing.mode == "ops":  # the input and the cached outputs; the rest is recomputed
            kept.append(saved.block_inputs[index] + saved.kept_outputs[index])
            recomputed.append(layer - saved.kept_outputs_saved[index])
        else:  # only the input; the whole block is recomputed
            kept.append(saved.block_inputs[index])
            recomputed.append(layer)
    # The backward pass runs the blocks last to first, freeing each one's activations when it is done.
    held = [sum(kept[: index + 1]) + recomputed[index] for index in range(len(kept))]
    worst = max(range(len(kept)), key=held.__getitem__, default=None)
    chunk_logits, loss_gradients = _chunked_loss_bytes(run)
    return dict(
        activations=saved.root + sum(kept), root=saved.root, logits_loss=chunk_logits + loss_gradients,
        chunk_logits=chunk_logits,
        backward=sum(kept[: worst + 1]) if worst is not None else 0,
        recompute=recomputed[worst] if worst is not None else 0,
        largest_layer=max(saved.per_layer, default=0),
    )


def _chunked_loss_bytes(run: _Run) -> tuple[int, int]:
    """(one chunk's logits as the head and loss hold them, the gradients the chunk loop accumulates): see the module
    docstring."""
    config = run.config
    vocab, width = config.padded_vocab_size, config.n_embd
    per_row = 4 + (2 if run.compute == 2 else 0) + (4 if config.final_logit_softcapping is not None else 0)
    chunk_logits = run.loss_chunk_size * vocab * per_row
    hidden_grad = run.tokens * width * run.param_compute
    if run.method == "full":  # the head's weight (or the tied embedding) trains
        head_grads = vocab * width * run.param_compute
        if run.param_compute != run.compute:  # autocast: each chunk's 16-bit product, then added in float32
            head_grads += vocab * width * run.compute
    else:
        head_grads = vocab * run.lora.r * run.param_compute if run.lora.head else 0
    return chunk_logits, hidden_grad + head_grads


def _gathered_params(run: _Run, layout: "_Layout", saved: "SavedActivations") -> dict:
    """FSDP's gathered units, or on one device autocast's 16-bit weight copies, at each moment of the step."""
    unsharded = lambda params: sum(math.prod(p.shape) for p in params)  # noqa: E731
    block_bytes = sorted(sum(_gathered_bytes(run, p) for p in ps) for ps in layout.blocks)
    root_bytes = unsharded(layout.root) * run.compute
    gathered = dict(root=root_bytes if run.fsdp else 0, forward_end=0)
    if run.fsdp:
        # `shard_model` keeps the root (embeddings, final norm, head) gathered from its forward to its backward, which
        # starts with the head. A block is gathered for its forward and again for its backward, the next one
        # prefetched (a shard group of one copies each block as it runs, without prefetching). SHARD_GRAD_OP
        # (reshard_after_forward=False) keeps every unit gathered from its forward to its backward.
        ahead = max(1, run.backward_prefetch) if run.shard > 1 else 0
        gathered["backward"] = root_bytes + sum(block_bytes[-(1 + ahead):])
        if run.sharding_strategy == "SHARD_GRAD_OP" and run.shard > 1:
            gathered.update(start=root_bytes + sum(block_bytes), detail="every block + root, from forward to backward")
        else:
            gathered.update(start=root_bytes, detail=f"root + {1 + max(1, run.backward_prefetch)} blocks at a time, "
                                                     "compute dtype")
    elif run.autocast:
        # Autocast's 16-bit copies of the weights that autograd saved; with checkpointing only the head's and the
        # recomputed block's are saved, but the cached copies of trainable weights last until the forward pass ends.
        gathered.update(start=saved.weight_copies, backward=saved.weight_copies)
        gathered["detail"] = "autocast's 16-bit copies of the linear weights"
        if run.activation_checkpointing:
            checkpointed = run.activation_checkpointing.checkpoints
            layer_copies = list(enumerate(saved.layer_weight_copies))
            kept = saved.weight_copies - sum(copies for index, copies in layer_copies if checkpointed(index))
            gathered["start"] = kept  # the head's, and those of the blocks not checkpointed (every:N)
            gathered["backward"] = kept + max((c for i, c in layer_copies if checkpointed(i)), default=0)
            gathered["forward_end"] = max(saved.cached_weight_copies, kept)
    else:
        gathered.update(start=0, backward=0, detail="none on a single device")
    return gathered


def _block_backward(run: _Run, layout: "_Layout") -> dict:
    """What the backward pass of one block allocates on top of the activations, and the root's gradients."""
    config = run.config
    unsharded = lambda params: sum(math.prod(p.shape) for p in params)  # noqa: E731
    grad_itemsize = run.compute if (run.autocast or run.fsdp) else run.param_compute
    widest = max(config.qkv_size, _mlp_width(config), config.n_embd)
    activation_grads = 3 * run.tokens * widest * grad_itemsize + 2 * run.tokens * config.n_embd * run.param_compute
    math_attention = _math_attention(config, run.device, run.precision)
    if config.attention_logit_softcapping is not None:
        attention = "soft-capped attention, materialized"
    elif math_attention:
        attention = "math attention: no fused float32 kernel takes grouped keys"
    else:
        attention = "flash attention" if run.device == "cuda" else "CPU flash attention"
    if math_attention or config.attention_logit_softcapping is not None:
        # The attention weights' gradient and the scores' gradient: (B, H, T, T) each.
        activation_grads += 2 * run.micro_batch_size * config.n_head * run.seq_length**2 * run.compute
    top_trainable = unsharded(_top_block_trainable(layout))
    reduce_bytes = run.master  # FSDP's reduce dtype: float32 for -mixed (and 32-true), 16 bits for -true
    if run.fsdp:
        # The block's unsharded gradients in the compute dtype, and the reduce-scatter input in the reduce dtype.
        weight_grads = top_trainable * (run.compute + reduce_bytes)
    else:
        weight_grads = 0 if run.accumulate_gradients else top_trainable * run.master
    dequantized = _dequantize_bytes(run, max(layout.quantized_numel, default=0)) if run.quantize else 0
    root_trainable = unsharded([p for p in layout.root if p.trainable])
    if run.fsdp:
        root_grads = root_trainable * run.compute  # the root reduces its gradients after the whole backward
    else:
        root_grads = 0 if run.accumulate_gradients else root_trainable * run.master
    return dict(
        activation_grads=activation_grads, weight_grads=weight_grads, dequantized=dequantized, root_grads=root_grads,
        attention=attention, math_attention=math_attention,
    )


def _moments(run: _Run, state: dict, activations: dict, gathered: dict, backward: dict) -> dict[str, dict]:
    """Every row's size at each moment of the step that can be the peak."""
    held = state["gradients_held"]
    buffers = activations["recompute"] + backward["activation_grads"] + backward["weight_grads"]
    buffers += backward["dequantized"]
    root_grads = backward["root_grads"]
    moments = {}
    if run.autocast and run.activation_checkpointing:
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


def _add_teacher(run: _Run, teacher: Config, moments: dict[str, dict]) -> int:
    """Add a frozen teacher (distillation, `litgpt.train.recipe.Recipe.materialize_teacher`) to every moment; returns
    its weights' bytes on the device.

    Its weights are in the compute dtype, sharded like the model's; its root (embeddings, final norm, head) stays
    gathered after its first forward pass, beside its shard. Its final hidden states live from its forward pass to
    the end of the model's backward pass, and one chunk of the loss holds, beside the model's logits, the teacher's
    (their 16-bit product and float32 copy) and at most three more float32 (positions, vocab) buffers of the KD loss
    (the student's softened log-probabilities and two temporaries: `litgpt.train.loss.distillation_chunk`). Its
    own forward pass, which comes first, is a moment of its own: two of its blocks gathered and one block's
    intermediate activations (none are saved: no gradient)."""
    layout = _parameter_layout(teacher, None, None)
    numel = lambda params: sum(math.prod(p.shape) for p in params)  # noqa: E731
    if run.fsdp:
        shards = sum(_shard_numel(p.shape, run.shard) for p in layout.params) * run.compute
        resident = (0 if run.cpu_offload else shards) + numel(layout.root) * run.compute
    else:
        resident = layout.total_params * run.compute
    hidden = run.tokens * teacher.n_embd * run.compute
    per_row = (2 if run.compute == 2 else 0) + 4 + 3 * 4 + (4 if teacher.final_logit_softcapping is not None else 0)
    for name, moment in moments.items():
        moment["parameters"] += resident
        if name != "optimizer step":
            moment["activations"] = moment.get("activations", 0) + hidden
        if "logits_loss" in moment and name == "start of the backward pass":
            moment["logits_loss"] += run.loss_chunk_size * teacher.padded_vocab_size * per_row
    blocks = sorted(numel(block) for block in layout.blocks)[-2:] if run.fsdp and run.shard > 1 else []
    widest = max(teacher.qkv_size, _mlp_width(teacher), teacher.n_embd)
    first = moments["optimizer step"]
    moments["teacher's forward pass"] = dict(
        parameters=first["parameters"], optimizer_state=first["optimizer_state"],
        gradients=moments["start of the backward pass"]["gradients"], gathered_params=sum(blocks) * run.compute,
        activations=hidden, buffers=3 * run.tokens * widest * run.compute,
    )
    return resident


def _describe(run: _Run, layout: "_Layout", state: dict, activations: dict, gathered: dict, backward: dict,
              loading: int) -> tuple[dict[str, str], list[str]]:
    """The table's detail column and the notes under it."""
    dtype_name = {4: "float32", 2: "16-bit"}
    master, config = dtype_name[run.master], run.config
    placement = f"1/{run.shard} shard" if run.shard > 1 else ("replicated" if run.fsdp else "one device")
    if run.cpu_offload:
        placement = "in CPU memory"
    details = {
        "parameters": f"{placement}, {master}" + (f", blocks' linears {run.stored_quantize}" if run.quantize else ""),
        "gradients": f"{placement}, {master}"
        + (" (+ the root's unsharded in the backward pass)" if run.fsdp and backward["root_grads"] else ""),
        "optimizer_state": f"2 moments, {placement}, {master}",
        "gathered_params": gathered["detail"],
        "activations": _activations_detail(run, activations),
        "logits_loss": f"1 chunk of {run.loss_chunk_size:,} of {run.tokens:,} positions x {config.padded_vocab_size:,} "
        "vocab, + head and hidden gradients",
        "buffers": ("1 block recomputed + " if activations["recompute"] else "")
        + "1 block's backward" + (" + dequantizing 1 weight" if run.quantize else ""),
    }
    notes = []
    if loading:
        steps = "each block's whole NF4 weights, then only its shards" if run.fsdp else "one weight at a time"
        notes.append(
            f"--quantize: the base is quantized from the memory-mapped file onto the device ({steps}): at most "
            f"{_fmt(loading)} (+ overhead) at that moment, before training starts."
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
    if run.fsdp and run.sharding_strategy == "HYBRID_SHARD" and run.num_nodes == 1:
        notes.append("HYBRID_SHARD on one node shards over its devices, as FULL_SHARD does.")
    if run.cpu_offload:
        notes.append(
            f"CPU offload: the sharded parameters, gradients and optimizer state take {_fmt(state['host_per_node'])} "
            f"of host memory per node ({run.devices} device(s)); the optimizer step runs on the CPU."
        )
    if run.device == "cuda":
        notes.append(
            f"Overhead assumed: {_fmt(CUDA_CONTEXT_BYTES)} for the CUDA context and library workspaces, plus "
            f"{CUDA_FRAGMENTATION:.0%} of the peak for the caching allocator's fragmentation."
        )
    else:
        notes.append(f"Overhead assumed: {_fmt(CPU_RUNTIME_BYTES)}, the resident size of Python and torch themselves.")
    if config.mlp_class_name == "LLaMAMoE":
        notes.append("Mixture of experts: the routed rows (k per token, sorted by expert) have fixed shapes: the plan "
                     "holds whatever the routing.")
    if backward["math_attention"]:
        notes.append(
            "No fused CUDA attention kernel takes float32 with grouped keys: the math path keeps a (batch, heads, seq, "
            "seq) softmax per layer; a 16-bit precision runs flash attention instead."
        )
    return details, notes


def _activations_detail(run: _Run, activations: dict) -> str:
    checkpointing, n_layer = run.activation_checkpointing, run.config.n_layer
    every_block = f"{n_layer} blocks x {_fmt(activations['largest_layer'])} + head"
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


# ---- parameters ------------------------------------------------------------------------------------------------------
@dataclass
class _Param:
    shape: tuple[int, ...]
    trainable: bool
    quantized: bool


@dataclass
class _Layout:
    root: list[_Param]  # the embedding, the final norm and the head: FSDP's root unit
    blocks: list[list[_Param]]  # one FSDP unit per block
    quantized_numel: list[int]

    @property
    def params(self) -> list[_Param]:
        return self.root + [p for block in self.blocks for p in block]

    @property
    def total_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @property
    def trainable_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params if p.trainable)


def _parameter_layout(config: Config, lora, quantize: Optional[str]) -> _Layout:
    """Every parameter of the model as it trains (with its adapters), by FSDP unit: the root and each block."""
    from litgpt.checkpoint.model_files import meta_device
    from litgpt.lora import add_lora, is_lora_key
    from litgpt.model import GPT
    from litgpt.quantize import quantize_targets

    with meta_device():
        model = GPT(config)
    if lora is not None:
        add_lora(model, lora)
    quantized = {id(layer.weight) for _, _, layer in quantize_targets(model)} if quantize else set()
    root: list[_Param] = []
    blocks: list[list[_Param]] = [[] for _ in range(config.n_layer)]
    quantized_numel = []
    for name, param in model.named_parameters():
        entry = _Param(tuple(param.shape), is_lora_key(name) if lora is not None else True, id(param) in quantized)
        if entry.quantized:
            quantized_numel.append(param.numel())
        if name.startswith("transformer.h."):
            blocks[int(name.split(".")[2])].append(entry)
        else:
            root.append(entry)
    return _Layout(root, blocks, quantized_numel)


def _top_block_trainable(layout: _Layout) -> list[_Param]:
    return [p for p in layout.blocks[-1] if p.trainable] if layout.blocks else []


def _shard_numel(shape: tuple[int, ...], shard: int) -> int:
    """Elements of the largest shard: FSDP2 splits dim 0 into `shard` equal chunks, padding the last."""
    if not shape:
        return 1
    return -(-shape[0] // shard) * math.prod(shape[1:])


def _quantized_bytes(shape: tuple[int, ...], mode: str) -> int:
    """bitsandbytes' storage of one weight: the packed values and the quantization statistics."""
    numel = math.prod(shape)
    blocks = -(-numel // BNB_BLOCK)
    if mode == "bnb.int8":
        return numel + shape[0] * 4  # int8 values and a float32 scale per output row
    if mode == "bnb.nf4-dq":
        # the absmax of each block quantized to 8 bits, with a float32 scale per 256 of them and an offset
        return -(-numel // 2) + blocks + 4 * -(-blocks // 256) + 4
    return -(-numel // 2) + 4 * blocks  # nf4 / fp4: 4-bit values and a float32 absmax per block


def _nf4_bytes(shape: tuple[int, ...], itemsize: int, shard: int = 1) -> int:
    """torchao's NF4Tensor of one weight on one rank: the 4-bit codes, an int8 scaler per 64 weights and a scale per
    group of scalers (in the dtype it dequantizes to) are split by rows over `shard` ranks; every rank keeps the
    scalers' mean and the 16 code values."""
    from litgpt.quantize import NF4_BLOCK, nf4_scaler_block

    numel = math.prod(shape)
    blocks = numel // NF4_BLOCK
    split = numel // 2 + blocks + blocks // nf4_scaler_block(numel) * itemsize
    return -(-split // shard) + 17 * itemsize


def _quantized_weight_bytes(run: _Run, shape: tuple[int, ...]) -> int:
    """One quantized weight as the run stores it on a device: bitsandbytes' layout, or torchao's NF4 (in the compute
    dtype) split over the shard group."""
    if run.stored_quantize == "ao.nf4":
        return _nf4_bytes(shape, run.compute, run.shard)
    return _quantized_bytes(shape, run.quantize)


def _gathered_bytes(run: _Run, p: _Param) -> int:
    """One parameter as FSDP all-gathers it: in the compute dtype, an NF4 weight in its own 4-bit layout (kept out of
    FSDP, never gathered, over a shard group of one)."""
    if p.quantized:
        return _nf4_bytes(p.shape, run.compute) if run.shard > 1 else 0
    return math.prod(p.shape) * run.compute


def _dequantize_bytes(run: _Run, numel: int) -> int:
    """What dequantizing one weight of `numel` elements holds at once for the matmul."""
    if run.stored_quantize == "ao.nf4":
        return numel * (NF4_DEQUANTIZE_INT64 + NF4_DEQUANTIZE_COPIES * run.compute)
    return numel * run.param_compute


def _quantized_loading(run: _Run, layout: _Layout) -> int:
    """The device's peak while the training commands quantize the base from the memory-mapped file, one weight at a
    time: the quantized weights so far (none with cpu_offload: FSDP moves each block's shards to CPU memory as it
    shards the block), under FSDP the whole NF4 weights of the block about to be sharded, and the work of quantizing
    the largest weight."""
    quantized = [p for p in layout.params if p.quantized]
    largest = max(layout.quantized_numel, default=0)
    so_far = 0 if run.cpu_offload else sum(_quantized_weight_bytes(run, p.shape) for p in quantized)
    if run.stored_quantize == "ao.nf4":
        work = largest * (NF4_QUANTIZE_FIXED + NF4_QUANTIZE_COPIES * run.compute) + NF4_QUANTIZE_CHUNK * run.compute
    else:
        work = largest * run.master  # the weight on the device, before bitsandbytes quantizes it there
    whole_block = 0
    if run.fsdp:
        whole_block = max(sum(_nf4_bytes(p.shape, run.compute) for p in ps if p.quantized) for ps in layout.blocks)
    return so_far + whole_block + work


def _mlp_width(config: Config) -> int:
    if config.mlp_class_name == "LLaMAMoE":  # k routed experts and the shared ones per token; dense first layers
        routed = config.moe_intermediate_size * config.n_expert_per_token + (config.moe_shared_intermediate_size or 0)
        return max(routed, config.intermediate_size) if config.moe_first_dense_layers else routed
    return config.intermediate_size


# ---- activations: the real model on fake tensors -------------------------------------------------------------------
@dataclass
class SavedActivations:
    """Bytes autograd saves in the forward pass of `litgpt.model.GPT` (the loss' own tensors not included).

    `per_layer`: one entry per block (a storage first saved in a block counts there); `root`: the rest (the
    embedding's indices, the final norm, the head's input, a final soft-capping). `block_inputs`: the storage of each
    block's input, what activation checkpointing keeps. With autocast (a -mixed precision on one device)
    `weight_copies` are its 16-bit copies of the weights that autograd saves (`layer_weight_copies` per block, the
    rest the head's), and `cached_weight_copies` those of the trainable weights, which autocast's cache holds until
    the forward pass ends even where checkpointing saves nothing. `kept_outputs`: per block, the outputs of the
    operations op-level checkpointing keeps (`KEPT_OPS`: matmuls, attention), and `kept_outputs_saved` the part of
    `per_layer` they make up (what a recomputation of the block need not allocate again).
    """

    per_layer: list[int]
    root: int
    weight_copies: int = 0
    layer_weight_copies: list[int] = field(default_factory=list)
    cached_weight_copies: int = 0
    block_inputs: list[int] = field(default_factory=list)
    kept_outputs: list[int] = field(default_factory=list)
    kept_outputs_saved: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.root + self.weight_copies


_MEASURED: dict[tuple, SavedActivations] = {}


def saved_activation_bytes(
    config: Config,
    *,
    micro_batch_size: int,
    seq_length: int,
    precision: str,
    fsdp: bool = False,
    device: str = "cuda",
    lora=None,
) -> SavedActivations:
    """What autograd saves in one forward pass of `litgpt.model.GPT` training with these settings, measured by
    running the model on fake tensors (see the module docstring).

    `lora` (a `LoRASettings`) makes only the adapters trainable, as `litgpt finetune_lora` does. With a -mixed
    precision a single device runs under autocast over float32 weights, FSDP in 16 bits throughout.
    """
    key = (repr(config), micro_batch_size, seq_length, precision, fsdp, device, repr(lora))
    if key not in _MEASURED:
        if len(_MEASURED) >= 64:
            _MEASURED.clear()
        _MEASURED[key] = _measure(config, micro_batch_size, seq_length, precision, fsdp, device, lora)
    return copy.deepcopy(_MEASURED[key])


def _measure(config: Config, batch: int, seq: int, precision: str, fsdp: bool, device: str, lora) -> SavedActivations:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    autocast = precision.endswith("-mixed") and not fsdp
    dtype = torch.float32 if precision == "32-true" or autocast else torch.bfloat16  # 16 bits: same sizes
    fake = FakeTensorMode()
    model = _fake_model(config, lora, dtype, fake)
    tape = _SavedTensors(model, autocast)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake)
        idx = torch.zeros((batch, seq), dtype=torch.long)
        stack.enter_context(_Kernels(device, tape))
        if device == "cuda":
            stack.enter_context(_NativeDropout())
        if _math_attention(config, device, precision):
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        if autocast:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(tape.pack, lambda tensor: tensor))
        try:
            model(idx)
        except (RuntimeError, ValueError, TypeError, IndexError) as error:
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise UserError(f"The model config cannot run a forward pass of this size: {first_line}") from None
    return tape.result(config.n_layer)


def _fake_model(config: Config, lora, dtype: torch.dtype, fake) -> torch.nn.Module:
    """`GPT(config)` as the training commands build it (adapters added, only they trainable with LoRA), in `dtype`,
    with fake parameters: built on the meta device, then every parameter (ties kept) and buffer made a fake CPU
    tensor."""
    from litgpt.checkpoint.model_files import meta_device
    from litgpt.lora import add_lora, mark_only_lora_as_trainable
    from litgpt.model import GPT

    with meta_device():
        model = GPT(config)
    if lora is not None:
        add_lora(model, lora)
        mark_only_lora_as_trainable(model)
    fakes: dict[int, torch.nn.Parameter] = {}
    with fake:
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and id(param) not in fakes:
                    fresh = torch.empty(param.shape, dtype=dtype)
                    fakes[id(param)] = torch.nn.Parameter(fresh, requires_grad=param.requires_grad)
                if param is not None:
                    module._parameters[name] = fakes[id(param)]
            for name, buffer in module._buffers.items():  # the routers' correction biases
                if buffer is not None:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)
    return model


def _storage(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (views share it), for as long as the storage lives."""
    return tensor.untyped_storage()._cdata


class _SavedTensors:
    """The pack hook: counts every storage autograd saves once, by where it was first saved, parameters left out."""

    def __init__(self, model: torch.nn.Module, autocast: bool) -> None:
        self.params = {_storage(p) for p in model.parameters()}
        self.trainable = {_storage(p) for p in model.parameters() if p.requires_grad}
        self.autocast = autocast
        self.copies: set[int] = set()  # storages of autocast's copies of parameters
        self.cached = 0
        self.where: object = "root"
        self.saved: dict[object, int] = {}
        self.saved_copies: dict[object, int] = {}
        self.saved_kept: dict[object, int] = {}
        self.inputs: list[int] = []
        self.kept: dict[int, tuple[object, int]] = {}  # `KEPT_OPS`' output storages: (block made in, bytes)
        self.seen: set[int] = set()
        self.alive: list[torch.Tensor] = []  # keeps counted storages alive, so their identities are not reused
        for index, block in enumerate(model.transformer.h):
            block.register_forward_pre_hook(lambda module, args, index=index: self.enter(index, args[0]))
            block.register_forward_hook(lambda module, args, out: setattr(self, "where", "root"))

    def enter(self, index: int, x: torch.Tensor) -> None:
        self.where = index
        self.inputs.append(x.untyped_storage().nbytes())

    def copied(self, source: torch.Tensor, copy: torch.Tensor) -> None:
        """A cast (`_to_copy`) ran: under autocast, a 16-bit copy of a parameter is a weight copy."""
        if self.autocast and isinstance(source, torch.Tensor) and _storage(source) in self.params:
            self.copies.add(_storage(copy))
            self.alive.append(copy)
            if _storage(source) in self.trainable:  # autocast caches these until the forward pass ends
                self.cached += copy.untyped_storage().nbytes()

    def kept_output(self, output) -> None:
        """An operation op-level checkpointing keeps the outputs of ran: note their storages for the block."""
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor) and _storage(tensor) not in self.params:
                self.kept.setdefault(_storage(tensor), (self.where, tensor.untyped_storage().nbytes()))
                self.alive.append(tensor)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.alive.append(tensor)
            table = self.saved_copies if key in self.copies else self.saved
            table[self.where] = table.get(self.where, 0) + tensor.untyped_storage().nbytes()
            if key in self.kept and self.kept[key][0] == self.where:
                self.saved_kept[self.where] = self.saved_kept.get(self.where, 0) + tensor.untyped_storage().nbytes()
        return tensor

    def result(self, n_layer: int) -> SavedActivations:
        layer_copies = [self.saved_copies.get(i, 0) for i in range(n_layer)]
        return SavedActivations(
            per_layer=[self.saved.get(i, 0) for i in range(n_layer)], root=self.saved.get("root", 0),
            weight_copies=sum(self.saved_copies.values()), layer_weight_copies=layer_copies,
            cached_weight_copies=self.cached, block_inputs=self.inputs,
            kept_outputs=[sum(n for where, n in self.kept.values() if where == i) for i in range(n_layer)],
            kept_outputs_saved=[self.saved_kept.get(i, 0) for i in range(n_layer)],
        )


def _math_attention(config: Config, device: str, precision: str) -> bool:
    """On CUDA no fused attention kernel takes float32 with grouped keys: PyTorch runs its math path."""
    return (
        device == "cuda" and precision == "32-true" and config.n_query_groups != config.n_head
        and config.attention_logit_softcapping is None
    )


class _Kernels(TorchDispatchMode):
    """Below autograd in the fake run: notes autocast's weight copies and the outputs op-level checkpointing keeps
    and, for --device cuda, gives kernels' results CUDA's dtypes and layouts."""

    def __init__(self, device: str, tape: _SavedTensors) -> None:
        super().__init__()
        self.cuda = device == "cuda"
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._to_copy.default:
            self.tape.copied(args[0], out)
        elif self.cuda and func is aten.native_layer_norm.default:
            out = (out[0], out[1].float(), out[2].float())  # CUDA keeps mean and rstd in float32
        elif self.cuda and func is aten._scaled_dot_product_flash_attention_for_cpu.default:
            if args[0].dtype == torch.float32 or kwargs.get("attn_mask") is not None:
                # CUDA's memory-efficient kernel writes its output as (B, T, H, hs), seen as (B, H, T, hs).
                out = (out[0].transpose(1, 2).contiguous().transpose(1, 2), *out[1:])
        if is_kept(func):
            self.tape.kept_output(out)
        return out


class _NativeDropout(TorchFunctionMode):
    """CUDA's dropout: the fused kernel (`native_dropout`), which saves a one-byte mask where the CPU's dropout saves
    the scaled noise in the input's dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            return self.dropout(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
        if training and 0 < p < 1 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return torch.nn.functional.dropout(input, p, training, inplace)


# ---- the table ----------------------------------------------------------------------------------------------------
def _fmt(nbytes: int) -> str:
    if abs(nbytes) >= GiB / 10:
        return f"{nbytes / GiB:,.2f} GiB"
    return f"{nbytes / 2**20:,.1f} MiB"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return str(n)


def _checkpointing_words(setting: str) -> str:
    words = {"none": "off", "full": "on", "ops": "ops (matmul and attention outputs kept)"}
    return words.get(setting) or f"{setting} (one block in {setting.removeprefix('every:')})"


def format_plan(plan: MemoryPlan) -> str:
    if plan.method == "lora":
        method = f"LoRA r={plan.lora_r} ({', '.join(plan.lora_targets)})"
        if plan.quantize:
            method = f"QLoRA {plan.quantize}, " + method[5:]
    else:
        method = "full finetune / pretrain"
    if plan.teacher_params:
        method += f", distilled from a frozen {_count(plan.teacher_params)}-parameter teacher"
    lines = [f"{plan.model_name}: {method}, {plan.precision}"]
    if plan.fsdp:
        lines.append(
            f"{plan.sharding_strategy} over {plan.num_nodes} node(s) x {plan.devices} device(s) = world size "
            f"{plan.world_size}: shard groups of {plan.shard_group_size}, {plan.replicate_groups} replica(s)"
        )
    else:
        lines.append("1 device, no sharding")
    share = plan.trainable_params / plan.total_params if plan.total_params else 0.0
    lines.append(
        f"parameters: {_count(plan.total_params)} total ({plan.total_params:,}), {_count(plan.trainable_params)} "
        f"trainable ({share:.2%})"
    )
    lines.append(
        f"micro batch {plan.micro_batch_size} x {plan.seq_length:,} tokens on {plan.device} ({plan.attention}), "
        f"activation checkpointing {_checkpointing_words(plan.activation_checkpointing)}, "
        f"gradient accumulation {'on' if plan.accumulate_gradients else 'off'}"
    )
    lines.append("")
    width = 28
    lines.append(f"{'per device':<{width}} {'largest':>12} {'at peak':>12}  detail")
    for key, label in ROWS:
        lines.append(
            f"{label:<{width}} {_fmt(getattr(plan, key)):>12} {_fmt(plan.at_peak[key]):>12}  "
            f"{plan.row_details.get(key, '')}"
        )
    lines.append(f"{'':<{width}} {'':>12} {'-' * 12}")
    lines.append(f"{'peak':<{width}} {'':>12} {_fmt(plan.peak):>12}  at the {plan.peak_phase}")
    lines.append(f"{'overhead':<{width}} {'':>12} {_fmt(plan.overhead):>12}")
    lines.append(f"{'total':<{width}} {'':>12} {_fmt(plan.total):>12}")
    if plan.loading:
        label = "loading (quantizing)"
        detail = "quantizing the base before training, + overhead"
        lines.append(f"{label:<{width}} {'':>12} {_fmt(plan.loading):>12}  {detail}")
    when = " (at loading)" if plan.device_memory - plan.margin != plan.total else ""
    if plan.fits:
        verdict = f"fits in {_fmt(plan.device_memory)}: {_fmt(plan.margin)} to spare{when}"
    else:
        verdict = f"does NOT fit in {_fmt(plan.device_memory)}: {_fmt(-plan.margin)} short{when}"
    lines.append(f"{'device memory':<{width}} {'':>12} {_fmt(plan.device_memory):>12}  {verdict}")
    if plan.cpu_offload:
        per_device = _fmt(plan.host_memory_per_node // plan.devices)
        lines.append(f"{'host memory per node':<{width}} {'':>12} {_fmt(plan.host_memory_per_node):>12}  "
                     f"{plan.devices} device(s) x {per_device}: sharded parameters, gradients, optimizer state")
    if plan.notes:
        lines.append("")
        lines.extend(f"- {note}" for note in plan.notes)
    return "\n".join(lines)

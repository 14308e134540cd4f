"""`litgpt plan`: the memory one training step needs on each device, worked out before anything is allocated.

`estimate(config, ...)` returns a `MemoryPlan` (bytes per device, with the peak and where in the step it falls);
`main` is the command, which prints it as a table or as JSON. Nothing is allocated: the model is built on the meta
device only to count and shape its parameters.

What is counted, per device:

- parameters: the resident (sharded) copy. Trainable ones in the master dtype (float32 for 32-true and the -mixed
  precisions, 16 bits for the -true ones). Frozen LoRA base weights too, since the training entry points cast the
  whole model to the master dtype; with --quantize the blocks' linear weights are stored in 4 or 8 bits instead
  (after the whole base was loaded in the master dtype: that moment is planned too).
- gradients: one per trainable parameter, in the master dtype, sharded like it. With gradient accumulation the
  earlier micro-batches' gradients are held while the next one runs forward (sharded: the sharded strategies
  reduce-scatter after every micro-batch).
- optimizer state: AdamW's two moments per trainable parameter, in the master dtype, sharded.
- gathered parameters: FSDP2 (`fully_shard` per Block, then the root) all-gathers a unit's parameters in the
  compute dtype before it runs: two blocks at a time (one running, one prefetched) and, in the backward pass, the
  root (embedding, final norm, head) throughout; with SHARD_GRAD_OP every unit stays gathered from its forward until
  its backward.
  On a single device (no FSDP) with a -mixed precision, autocast's 16-bit copies of the linear weights, which
  autograd keeps for the backward pass, take this row instead.
- activations: what autograd saves in the forward pass of `litgpt.model.GPT`, tensor by tensor (see `_Tape`);
  with activation checkpointing only each block's input, and one block's activations while it is recomputed.
  Attention is O(sequence) (flash / memory-efficient kernels, and the CPU's flash kernel), except on CUDA in
  float32 with grouped keys (n_query_groups < n_head), which no fused kernel takes: the math path keeps the
  (batch, heads, seq, seq) softmax, as does soft-capped attention (Gemma 2) everywhere.
- logits and loss: `loss_fn` upcasts the logits to float32; at the start of the backward pass the log-softmax
  output, its gradient and the logits' gradient (3 x tokens x vocab x 4 bytes) are alive together.
- work buffers: what one block's backward pass allocates on top (activation gradients, its weight gradients,
  FSDP's reduce-scatter input) and, with --quantize, one dequantized weight.

The peak is the largest of three moments: the start of the backward pass (all activations and the loss tensors
alive), the backward pass of the last block (its work buffers on top of the activations), and the optimizer step
(all gradients and optimizer state); with autocast and checkpointing also the end of the forward pass, while
autocast's cache still holds 16-bit copies of every trainable weight. Every row of the table gives its own largest
size and its size at the peak.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, get_args

from litgpt.args import ShardingStrategy
from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.precision import PRECISIONS
from litgpt.quantize import QUANTIZE_MODES

METHODS = ("full", "lora")
SHARDING_STRATEGIES = get_args(ShardingStrategy)
PLAN_DEVICES = ("cuda", "cpu")
GiB = 2**30

# What a device needs beyond the tensors counted here.
CUDA_CONTEXT_BYTES = 1 * GiB  # CUDA context and library workspaces (0.82 GiB measured on an H100, torch 2.11)
CUDA_FRAGMENTATION = 0.10  # the caching allocator reserves more than it hands out: a share of the peak
CPU_RUNTIME_BYTES = GiB // 2  # resident size of Python + torch + litgpt before the model (0.42 GiB, torch 2.13)
BNB_BLOCK = 64  # bitsandbytes' 4-bit quantization block (one absmax per 64 weights)

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
    activation_checkpointing: bool
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
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    accumulate_gradients: bool = True,
    device: str = "cuda",
    device_memory_gb: float = 80.0,
    json: bool = False,
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
        quantize: QLoRA: the frozen base weights of the blocks in bnb.nf4, bnb.nf4-dq, bnb.fp4 or bnb.int8
            (method lora on a single device).
        activation_checkpointing: Recompute each block's activations in the backward pass.
        cpu_offload: Keep the sharded parameters, gradients and optimizer state in CPU memory (FSDP only).
        accumulate_gradients: Gradients of earlier micro-batches are held while the next one runs (the global batch
            is larger than devices x micro batch, as in the recipes); false for one micro-batch per step.
        device: cuda or cpu: which attention kernels and dropout masks, and which fixed overhead, to assume.
        device_memory_gb: Memory of one device in GiB (2**30 bytes) to check the plan against.
        json: Print the plan as JSON instead of a table.
    """
    from litgpt.lora import LoRASettings

    config = resolve_config(model_name, model_config)
    lora = None
    if method == "lora":
        lora = LoRASettings(
            r=lora_r, dropout=lora_dropout, query=lora_query, key=lora_key, value=lora_value,
            projection=lora_projection, mlp=lora_mlp, head=lora_head,
        )
    plan = estimate(
        config, method=method, precision=precision, sharding_strategy=sharding_strategy, devices=devices,
        num_nodes=num_nodes, micro_batch_size=micro_batch_size, seq_length=seq_length, lora=lora, quantize=quantize,
        activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
        accumulate_gradients=accumulate_gradients, device=device, device_memory_gb=device_memory_gb,
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
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    accumulate_gradients: bool = True,
    device: str = "cuda",
    device_memory_gb: float = 80.0,
) -> MemoryPlan:
    """The per-device memory of one training step; `lora` is a `LoRASettings` (default settings when None)."""
    from litgpt.lora import LoRASettings

    method, precision, sharding_strategy, device = _check_choices(method, precision, sharding_strategy, device)
    for name, value in (("devices", devices), ("num_nodes", num_nodes), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"--{name} must be a whole number >= 1, got {value!r}.")
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
    world = devices * num_nodes
    if quantize is not None:
        if quantize not in QUANTIZE_MODES:
            raise UserError(f"Unknown quantization {quantize!r}; use one of {', '.join(QUANTIZE_MODES)}.")
        if method != "lora":
            raise UserError("--quantize stores frozen base weights: it needs --method lora.")
        if world > 1:
            raise UserError(
                f"--quantize runs on a single device, but devices x num_nodes is {world}: use --devices 1 "
                "--num_nodes 1, or drop --quantize to shard the model with FSDP."
            )
    if cpu_offload and world == 1:
        raise UserError("--cpu_offload is an FSDP option: it needs more than one device (devices x num_nodes > 1).")
    if precision == "16-mixed" and device == "cpu":
        raise UserError("--precision 16-mixed needs a GPU; on the CPU use bf16-mixed or 32-true.")
    if precision == "16-mixed" and world > 1:
        raise UserError("--precision 16-mixed is not supported with FSDP: use bf16-mixed (or 16-true).")
    if method == "lora" and lora is None:
        lora = LoRASettings()
    if method == "full":
        lora = None

    fsdp = world > 1
    if not fsdp:
        shard = 1
    elif sharding_strategy == "NO_SHARD":
        shard = 1
    elif sharding_strategy == "HYBRID_SHARD":
        shard = devices
    else:
        shard = world
    mixed = precision.endswith("-mixed")
    master = 4 if precision == "32-true" or mixed else 2  # stored parameters, gradients, optimizer state
    compute = 4 if precision == "32-true" else 2  # what the math runs in
    autocast = mixed and not fsdp  # single device: Fabric's autocast over float32 weights
    param_compute = master if not fsdp else compute  # the dtype a module sees its weights in

    layout = _parameter_layout(config, lora, quantize)
    n_tokens = micro_batch_size * seq_length
    notes: list[str] = []
    dtype_name = {4: "float32", 2: "16-bit"}

    # ---- resident state ----------------------------------------------------------------------------------------
    def stored_bytes(p: "_Param") -> int:
        if p.quantized:
            return _quantized_bytes(p.shape, quantize)
        return _shard_numel(p.shape, shard) * master

    parameters = sum(stored_bytes(p) for p in layout.params)
    trainable = [p for p in layout.params if p.trainable]
    gradients_sharded = sum(_shard_numel(p.shape, shard) for p in trainable) * master
    optimizer_state = 2 * gradients_sharded + 4 * len(trainable)  # exp_avg, exp_avg_sq, and a step count per tensor
    unsharded = lambda params: sum(math.prod(p.shape) for p in params)  # noqa: E731
    reduce_bytes = master  # FSDP's reduce dtype: float32 for -mixed (and 32-true), 16 bits for -true
    # Sharded strategies reduce-scatter after every micro-batch, so accumulation holds sharded gradients (NO_SHARD
    # holds them unsharded, which is the same size there).
    gradients_held = gradients_sharded if accumulate_gradients else 0

    # ---- activations -------------------------------------------------------------------------------------------
    saved = saved_activation_bytes(
        config, micro_batch_size=micro_batch_size, seq_length=seq_length, precision=precision, fsdp=fsdp,
        device=device, lora=lora,
    )
    per_layer, root_activations = saved.per_layer, saved.root
    if activation_checkpointing:
        # Each checkpointed block keeps only its input; the backward pass recomputes one block at a time.
        activations = root_activations + n_tokens * config.n_embd * param_compute * config.n_layer
        recompute = max(per_layer)
    else:
        activations = root_activations + sum(per_layer)
        recompute = 0
    logits_loss = 3 * n_tokens * config.padded_vocab_size * 4

    # ---- gathered parameters -----------------------------------------------------------------------------------
    block_bytes = sorted(unsharded(ps) * compute for ps in layout.blocks)
    root_bytes = unsharded(layout.root) * compute
    if fsdp:
        # `shard_model` keeps the root (embeddings, final norm, head) gathered from its forward to its backward, which
        # starts with the head. A block is gathered for its forward and again for its backward, the next one
        # prefetched (a shard group of one copies each block as it runs, without prefetching). SHARD_GRAD_OP
        # (reshard_after_forward=False) keeps every unit gathered from its forward to its backward.
        gathered_backward = root_bytes + sum(block_bytes[-(2 if shard > 1 else 1):])
        if sharding_strategy == "SHARD_GRAD_OP" and shard > 1:
            gathered_start = root_bytes + sum(block_bytes)
            gathered_detail = "every block + root, from forward to backward"
        else:
            gathered_start = root_bytes
            gathered_detail = "root + 2 blocks at a time, compute dtype"
    elif autocast:
        # Autocast's 16-bit copies of the linear weights, saved for the backward pass; with checkpointing only the
        # head's and the recomputed block's are saved, but the cached copies of trainable weights last until the
        # forward pass ends.
        gathered_start = gathered_backward = saved.weight_copies
        if activation_checkpointing:
            head_copies = saved.weight_copies - sum(saved.layer_weight_copies)
            gathered_start = head_copies
            gathered_backward = head_copies + max(saved.layer_weight_copies)
            gathered_forward_end = max(saved.cached_weight_copies, head_copies)
        gathered_detail = "autocast's 16-bit copies of the linear weights"
    else:
        gathered_start = gathered_backward = 0
        gathered_detail = "none on a single device"

    # ---- one block's backward pass -------------------------------------------------------------------------------
    grad_itemsize = compute if (autocast or fsdp) else param_compute
    widest = max(config.qkv_size, _mlp_width(config), config.n_embd)
    activation_grads = 3 * n_tokens * widest * grad_itemsize + 2 * n_tokens * config.n_embd * param_compute
    math_attention = (
        device == "cuda" and precision == "32-true" and config.n_query_groups != config.n_head
        and config.attention_logit_softcapping is None
    )
    if config.attention_logit_softcapping is not None:
        attention = "soft-capped attention, materialized"
    elif math_attention:
        attention = "math attention: no fused float32 kernel takes grouped keys"
    else:
        attention = "flash attention" if device == "cuda" else "CPU flash attention"
    if math_attention or config.attention_logit_softcapping is not None:
        # The attention weights' gradient and the scores' gradient: (B, H, T, T) each.
        activation_grads += 2 * micro_batch_size * config.n_head * seq_length**2 * compute
    top_trainable = unsharded(_top_block_trainable(layout))
    if fsdp:
        # The block's unsharded gradients in the compute dtype, and the reduce-scatter input in the reduce dtype.
        weight_grads = top_trainable * (compute + reduce_bytes)
    else:
        weight_grads = 0 if accumulate_gradients else top_trainable * master
    dequantized = max(layout.quantized_numel, default=0) * param_compute if quantize else 0
    buffers = recompute + activation_grads + weight_grads + dequantized
    root_trainable = [p for p in layout.root if p.trainable]
    if fsdp:
        root_grads = unsharded(root_trainable) * compute  # the root reduces its gradients after the whole backward
    elif not accumulate_gradients:
        root_grads = unsharded(root_trainable) * master
    else:
        root_grads = 0

    # ---- CPU offload ---------------------------------------------------------------------------------------------
    host_per_node = 0
    resident_parameters, resident_gradients, resident_optimizer = parameters, gradients_sharded, optimizer_state
    if cpu_offload:
        host_per_node = devices * (parameters + gradients_sharded + optimizer_state)
        resident_parameters = resident_gradients = resident_optimizer = 0

    # ---- the moments of a step -------------------------------------------------------------------------------------
    moments = {}
    if autocast and activation_checkpointing:
        moments["end of the forward pass"] = dict(
            gradients=gradients_held, gathered_params=gathered_forward_end, activations=activations,
            logits_loss=n_tokens * config.padded_vocab_size * compute, buffers=dequantized,
        )
    moments.update({
        "start of the backward pass": dict(
            gradients=gradients_held, gathered_params=gathered_start, activations=activations,
            logits_loss=logits_loss, buffers=dequantized,
        ),
        "backward pass of the last block": dict(
            gradients=gradients_held + root_grads, gathered_params=gathered_backward,
            activations=activations - root_activations, buffers=buffers,
        ),
        # Under FSDP the root's parameters stay gathered and its gradients unsharded until the backward pass ends.
        "optimizer step": dict(
            gradients=resident_gradients + (root_grads if fsdp else 0), gathered_params=root_bytes if fsdp else 0
        ),
    })
    for moment in moments.values():
        moment.update(parameters=resident_parameters, optimizer_state=resident_optimizer)
    peak_phase, peak_rows = max(moments.items(), key=lambda item: sum(item[1].values()))
    at_peak = {key: peak_rows.get(key, 0) for key, _ in ROWS}
    largest = {key: max(m.get(key, 0) for m in moments.values()) for key, _ in ROWS}
    peak = sum(at_peak.values())
    overhead = _overhead(peak, device)
    total = peak + overhead
    device_memory = int(device_memory_gb * GiB)
    loading = 0
    if quantize:
        # The training commands load the whole base onto the device in the master dtype, then quantize it there.
        loading = sum(math.prod(p.shape) for p in layout.params) * master
        notes.append(
            f"--quantize: the base is loaded onto the device in {dtype_name[master]} before it is quantized: "
            f"{_fmt(loading)} (+ overhead) at that moment, before training starts."
        )
    needed = max(total, loading + _overhead(loading, device) if loading else 0)

    # ---- what the table says -------------------------------------------------------------------------------------
    placement = f"1/{shard} shard" if shard > 1 else ("replicated" if fsdp else "one device")
    if cpu_offload:
        placement = "in CPU memory"
    details = {
        "parameters": f"{placement}, {dtype_name[master]}" + (f", blocks' linears {quantize}" if quantize else ""),
        "gradients": f"{placement}, {dtype_name[master]}"
        + (" (+ the root's unsharded in the backward pass)" if fsdp and root_grads else ""),
        "optimizer_state": f"2 moments, {placement}, {dtype_name[master]}",
        "gathered_params": gathered_detail,
        "activations": (
            f"{config.n_layer} block inputs + head" if activation_checkpointing
            else f"{config.n_layer} blocks x {_fmt(max(per_layer))} + head"
        ),
        "logits_loss": f"3 x {n_tokens:,} tokens x {config.padded_vocab_size:,} vocab x 4 B",
        "buffers": ("1 block recomputed + " if activation_checkpointing else "")
        + "1 block's backward" + (" + 1 dequantized weight" if quantize else ""),
    }
    if method == "lora" and quantize is None:
        notes.append(
            f"The frozen base weights are stored in {dtype_name[master]} (the training commands cast the whole model "
            "to the master dtype); --quantize on one device stores the blocks' linear weights in 4 or 8 bits."
        )
    if fsdp and sharding_strategy == "HYBRID_SHARD" and num_nodes == 1:
        notes.append("HYBRID_SHARD on one node shards over its devices, as FULL_SHARD does.")
    if cpu_offload:
        notes.append(
            f"CPU offload: the sharded parameters, gradients and optimizer state take {_fmt(host_per_node)} of host "
            f"memory per node ({devices} device(s)); the optimizer step runs on the CPU."
        )
    if device == "cuda":
        notes.append(
            f"Overhead assumed: {_fmt(CUDA_CONTEXT_BYTES)} for the CUDA context and library workspaces, plus "
            f"{CUDA_FRAGMENTATION:.0%} of the peak for the caching allocator's fragmentation."
        )
    else:
        notes.append(f"Overhead assumed: {_fmt(CPU_RUNTIME_BYTES)}, the resident size of Python and torch themselves.")
    if config.mlp_class_name == "LLaMAMoE":
        notes.append("Mixture of experts: every token's k experts' activations are counted, whatever the routing.")
    if math_attention:
        notes.append(
            "No fused CUDA attention kernel takes float32 with grouped keys: the math path keeps a (batch, heads, seq, "
            "seq) softmax per layer; a 16-bit precision runs flash attention instead."
        )

    return MemoryPlan(
        model_name=config.name or "model_config", method=method, precision=precision,
        sharding_strategy=sharding_strategy if fsdp else "none (1 device)", device=device, devices=devices,
        num_nodes=num_nodes, micro_batch_size=micro_batch_size, seq_length=seq_length,
        activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
        accumulate_gradients=accumulate_gradients, quantize=quantize, lora_r=lora.r if lora else None,
        lora_targets=_lora_targets(lora), world_size=world, shard_group_size=shard, replicate_groups=world // shard,
        fsdp=fsdp, total_params=layout.total_params, trainable_params=layout.trainable_params,
        n_layer=config.n_layer, parameters=largest["parameters"], gradients=largest["gradients"],
        optimizer_state=largest["optimizer_state"], gathered_params=largest["gathered_params"],
        activations=largest["activations"], logits_loss=largest["logits_loss"], buffers=largest["buffers"],
        at_peak=at_peak, peak_phase=peak_phase, peak=peak, overhead=overhead, total=total,
        device_memory=device_memory, fits=needed <= device_memory, margin=device_memory - needed, loading=loading,
        host_memory_per_node=host_per_node, activations_per_layer=max(per_layer), attention=attention,
        row_details=details, notes=notes,
    )


def _overhead(peak: int, device: str) -> int:
    if device == "cuda":
        return CUDA_CONTEXT_BYTES + int(CUDA_FRAGMENTATION * peak)
    return CPU_RUNTIME_BYTES


def _check_choices(method: str, precision: str, strategy: str, device: str) -> tuple[str, str, str, str]:
    if method not in METHODS:
        raise UserError(f"--method {method!r} is not one of {', '.join(METHODS)}.")
    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    normalized = str(strategy).upper()
    if normalized not in SHARDING_STRATEGIES:
        raise UserError(f"--sharding_strategy {strategy!r} is not one of {', '.join(SHARDING_STRATEGIES)}.")
    if device not in PLAN_DEVICES:
        raise UserError(f"--device {device!r} is not one of {', '.join(PLAN_DEVICES)}.")
    return method, precision, normalized, device


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
    import torch.nn as nn

    from litgpt.checkpoint.model_files import meta_device
    from litgpt.lora import add_lora, is_lora_key
    from litgpt.model import GPT

    with meta_device():
        model = GPT(config)
    if lora is not None:
        add_lora(model, lora)
    quantized = set()
    if quantize:  # as litgpt.quantize.quantize_frozen_base: every linear of the blocks but a router
        for name, module in model.transformer.h.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("mlp.gate"):
                quantized.add(id(module.weight))
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


def _mlp_width(config: Config) -> int:
    if config.mlp_class_name == "LLaMAMoE":
        return config.moe_intermediate_size * config.n_expert_per_token
    return config.intermediate_size


# ---- activations ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _T:
    """A tensor of the symbolic forward pass: views share their storage's key."""

    key: int
    numel: int
    itemsize: int
    storage_bytes: int
    requires_grad: bool
    fresh: bool = False  # laid out contiguously by a cat (CPU attention then returns a contiguous output)


@dataclass
class SavedActivations:
    """Bytes autograd saves in the forward pass of `litgpt.model.GPT` (the loss' own tensors not included).

    `per_layer`: one entry per block; `root`: the embedding's indices, the rotary tables, the final norm, the head's
    input and a final soft-capping. With autocast (a -mixed precision on one device) `weight_copies` are its 16-bit
    copies of the weights that autograd saves (`layer_weight_copies` per block, the rest the head's), and
    `cached_weight_copies` those of the trainable weights, which autocast's cache holds until the forward pass ends
    even where checkpointing saves nothing.
    """

    per_layer: list[int]
    root: int
    weight_copies: int = 0
    layer_weight_copies: list[int] = field(default_factory=list)
    cached_weight_copies: int = 0

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.root + self.weight_copies


class _Tape:
    """Walks `litgpt.model.GPT`'s forward pass and records, per op, the tensors autograd saves for the backward.

    The rules follow PyTorch's derivative formulas: a linear layer saves its input only when its weight trains, and
    its weight (a parameter, or autocast's copy of it) only when its input needs a gradient; an elementwise product
    saves each operand for the other's gradient; RMSNorm saves its float32 input and the reciprocal RMS, and its
    normalized input when its weight trains; flash / memory-efficient attention saves q, k, v, the output and the
    log-sum-exp. A saved view keeps its whole storage alive, and a storage saved twice counts once.
    """

    def __init__(self, config: Config, *, tokens: int, batch: int, seq: int, param_compute: int, compute: int,
                 autocast: bool, device: str, full: bool, lora) -> None:
        self.c = config
        self.tokens, self.batch, self.seq = tokens, batch, seq
        self.param_compute, self.compute, self.autocast = param_compute, compute, autocast
        self.device, self.full, self.lora = device, full, lora
        self.saved: dict[int, int] = {}
        self.weight_copies = 0
        self.cached_weight_copies = 0
        self._next = 0
        self.rope_keys: dict[bool, tuple[int, int]] = {}

    # ---- primitives ----
    def new(self, numel: int, itemsize: int, requires_grad: bool, fresh: bool = False) -> _T:
        self._next += 1
        return _T(self._next, numel, itemsize, numel * itemsize, requires_grad, fresh)

    def save(self, t: _T) -> None:
        self.saved.setdefault(t.key, t.storage_bytes)

    def save_new(self, numel: int, itemsize: int) -> None:
        self.save(self.new(numel, itemsize, False))

    def cast(self, t: _T, itemsize: int) -> _T:
        return t if t.itemsize == itemsize else self.new(t.numel, itemsize, t.requires_grad, t.fresh)

    def autocast_input(self, t: _T) -> _T:
        """What autocast hands a matmul: a new 16-bit copy of a float32 activation (per call: never cached)."""
        return self.cast(t, self.compute) if self.autocast else t

    def view(self, t: _T, numel: int) -> _T:
        return _T(t.key, numel, t.itemsize, t.storage_bytes, t.requires_grad, t.fresh)

    def total(self) -> int:
        return sum(self.saved.values())

    # ---- layers ----
    def norm(self, x: _T, size: int, trainable: bool) -> _T:
        rows = x.numel // size
        requires_grad = x.requires_grad or trainable
        if self.c.norm_class_name == "LayerNorm":
            xc = self.cast(x, 4) if self.autocast else x
            if requires_grad:
                self.save(xc)
                stats = 4 if self.device == "cuda" else xc.itemsize  # mean and rstd
                self.save_new(rows, stats)
                self.save_new(rows, stats)
            return self.new(x.numel, xc.itemsize, requires_grad)
        xf = self.cast(x, 4)  # x.float()
        if x.requires_grad:
            self.save(xf)
            self.save_new(rows, 4)  # rsqrt(mean(x^2) + eps)
        normed = self.new(x.numel, 4, x.requires_grad)
        if self.c.norm_unit_offset:  # (normed * (1 + weight.float())).to(dtype)
            if trainable:
                self.save(normed)
            if x.requires_grad:
                self.save_new(size, 4)
            return self.cast(self.new(x.numel, 4, requires_grad), x.itemsize)
        y = self.cast(normed, x.itemsize)  # normed.to(dtype)
        if trainable:
            self.save(y)
        return self.new(x.numel, max(self.param_compute, y.itemsize), requires_grad)

    def linear(self, x: _T, in_features: int, out_features: int, trainable: bool, lora_parts: int = 0,
               lora_rows: int = 0) -> _T:
        rows = x.numel // in_features
        out_itemsize = self.compute if self.autocast else max(x.itemsize, self.param_compute)
        if trainable:
            self.save(self.autocast_input(x))
        if self.autocast and x.requires_grad:
            self.weight_copies += in_features * out_features * self.compute
        if self.autocast and trainable:
            self.cached_weight_copies += in_features * out_features * self.compute
        out = self.new(rows * out_features, out_itemsize, x.requires_grad or trainable or lora_parts > 0)
        if not lora_parts:
            return out
        # dropout(x).to(A's dtype) @ A^T (A of every part stacked), * scaling, @ B^T (laid out over the rows)
        r = self.lora.r * lora_parts
        adapter_itemsize = self.compute if self.autocast else self.param_compute
        h = x
        if self.lora.dropout > 0:
            if x.requires_grad:  # the mask: a bool on CUDA, the scaled noise in the input's dtype on the CPU
                self.save_new(x.numel, 1 if self.device == "cuda" else x.itemsize)
            h = self.new(x.numel, x.itemsize, x.requires_grad)
        h = self.cast(h, self.param_compute)
        self.save(self.autocast_input(h))
        if h.requires_grad and (lora_parts > 1 or self.autocast):
            self.save_new(r * in_features, adapter_itemsize)  # A concatenated, or autocast's copy
        self.save_new(rows * r, adapter_itemsize)  # (h @ A^T) * scaling
        if lora_parts > 1 or lora_rows != out_features or self.autocast:
            self.save_new(out_features * r, adapter_itemsize)  # B laid out over the rows, or autocast's copy
        return self.new(out.numel, out.itemsize, True)

    def attention(self, x: _T, layer_idx: int) -> _T:
        c = self.c
        q_rows, kv_rows = c.n_head * c.head_size, c.n_query_groups * c.head_size
        lora = self.lora
        parts = [p for p in ("query", "key", "value") if lora is not None and getattr(lora, p)]
        lora_rows = sum(q_rows if p == "query" else kv_rows for p in parts)
        qkv = self.linear(x, c.n_embd, c.qkv_size, self.full, len(parts), lora_rows)
        q = self.view(qkv, self.tokens * q_rows)
        k = self.view(qkv, self.tokens * kv_rows)
        v = self.view(qkv, self.tokens * kv_rows)
        if c.norm_qk:
            q = self.norm(q, c.head_size, self.full)
            k = self.norm(k, c.head_size, self.full)
        local = c.rope_local_base is not None and c.is_sliding_layer(layer_idx)
        q, k = self.rope(q, local), self.rope(k, local)
        if c.attention_logit_softcapping is not None:
            y = self.softcapped_attention(q, k, v)
        else:
            y = self.sdpa(q, k, v, masked=c.is_sliding_layer(layer_idx))
        proj_lora = 1 if lora is not None and lora.projection else 0
        return self.linear(y, q_rows, c.n_embd, self.full, proj_lora, c.n_embd)

    def rope(self, x: _T, local: bool) -> _T:
        c = self.c
        if c.rope_n_elem == 0:
            return x
        if x.requires_grad:  # rotated * cos + rotate_half(rotated) * sin saves cos and sin, shared by the layers
            if local not in self.rope_keys:
                self.rope_keys[local] = (self.new(0, 1, False).key, self.new(0, 1, False).key)
            size = self.seq * c.rope_n_elem * self.param_compute
            for key in self.rope_keys[local]:
                self.saved.setdefault(key, size)
        partial = c.rope_n_elem < c.head_size  # torch.cat((rotated, passed)): a contiguous new tensor
        return self.new(x.numel, max(x.itemsize, self.param_compute), x.requires_grad, fresh=partial)

    def sdpa(self, q: _T, k: _T, v: _T, masked: bool) -> _T:
        c = self.c
        q, k, v = (self.autocast_input(t) for t in (q, k, v))
        requires_grad = q.requires_grad or k.requires_grad or v.requires_grad
        if self.math_attention(q.itemsize):
            # No fused CUDA kernel takes float32 with grouped keys: the math path repeats k and v per head, scales
            # q and k, and keeps the softmax of the scores; its (B, H, T, hs) output is copied for the projection.
            if requires_grad:
                for numel in (q.numel, q.numel, q.numel, self.batch * c.n_head * self.seq * self.seq):
                    self.save_new(numel, q.itemsize)
            return self.new(q.numel, q.itemsize, requires_grad)
        out = self.new(q.numel, q.itemsize, requires_grad)
        if requires_grad:
            for t in (q, k, v, out):
                self.save(t)
            self.save_new(self.batch * c.n_head * self.seq, 4)  # log-sum-exp per query
            if self.device == "cuda":
                self.save_new(2, 8)  # the dropout RNG's seed and offset
            if masked:  # the boolean window mask becomes an additive float mask, per call
                self.save_new(self.seq * self.seq, q.itemsize)
        # CPU flash and CUDA flash attention lay their output out like q, CUDA's memory-efficient kernel (float32,
        # or a mask) as (B, T, H, hs): after a partial rotary embedding q is contiguous, and the projection's
        # y.transpose(1, 2).reshape(...) copies the output.
        efficient = self.device == "cuda" and (q.itemsize == 4 or masked)
        if q.fresh and not efficient:
            return self.new(out.numel, out.itemsize, requires_grad)
        return out

    def math_attention(self, itemsize: int) -> bool:
        return self.device == "cuda" and itemsize == 4 and self.c.n_query_groups != self.c.n_head

    def softcapped_attention(self, q: _T, k: _T, v: _T) -> _T:
        c = self.c
        q, k, v = (self.autocast_input(t) for t in (q, k, v))
        if c.n_query_groups != c.n_head:
            k = self.new(q.numel, k.itemsize, k.requires_grad)  # repeat_interleave
            v = self.new(q.numel, v.itemsize, v.requires_grad)
        scores = self.batch * c.n_head * self.seq * self.seq
        self.save(q)
        self.save(k)
        self.save_new(scores, q.itemsize)  # tanh's output
        self.save_new(self.seq * self.seq, 1)  # the boolean mask of masked_fill
        weights = self.new(scores, 4, True)  # softmax in float32
        self.save(weights)
        self.save(self.cast(weights, q.itemsize))
        self.save(v)
        return self.new(q.numel, q.itemsize, True)  # made contiguous for the projection

    def mlp(self, x: _T, intermediate: Optional[int] = None) -> _T:
        c = self.c
        lora_mlp = 1 if self.lora is not None and self.lora.mlp else 0
        size = intermediate or c.intermediate_size
        if c.mlp_class_name == "LLaMAMoE" and intermediate is None:
            return self.moe(x)
        if c.mlp_class_name == "GptNeoxMLP":
            a = self.linear(x, c.n_embd, size, self.full, lora_mlp, size)
            if a.requires_grad:
                self.save(a)  # gelu's input
            g = self.new(a.numel, a.itemsize, a.requires_grad)
            return self.linear(g, size, c.n_embd, self.full, lora_mlp, c.n_embd)
        a = self.linear(x, c.n_embd, size, self.full, lora_mlp, size)
        b = self.linear(x, c.n_embd, size, self.full, lora_mlp, size)
        if a.requires_grad:
            self.save(a)  # silu's / gelu's input
        s = self.new(a.numel, a.itemsize, a.requires_grad)
        if b.requires_grad:
            self.save(s)
        if s.requires_grad:
            self.save(b)
        p = self.new(a.numel, max(a.itemsize, b.itemsize), a.requires_grad or b.requires_grad)
        return self.linear(p, size, c.n_embd, self.full, lora_mlp, c.n_embd)

    def moe(self, x: _T) -> _T:
        """Router, then each token through its k experts: k x tokens rows over all experts, however spread."""
        c = self.c
        rows, k = x.numel // c.n_embd, c.n_expert_per_token
        logits = self.linear(x, c.n_embd, c.n_expert, self.full)
        routed = logits.requires_grad
        if routed:
            self.save_new(rows * c.n_expert, 4)  # softmax output
            self.save_new(rows * k, 8)  # top-k indices
            if c.moe_renormalize:
                self.save_new(rows * k, 4)  # top-k weights
                self.save_new(rows, 4)  # their sum
        self.save_new(rows * k, 16)  # each expert's token and slot indices
        picked = self.new(rows * k * c.n_embd, x.itemsize, x.requires_grad)  # x[token_idx]
        copies, cached = self.weight_copies, self.cached_weight_copies
        out = self.mlp(picked, intermediate=c.moe_intermediate_size)
        self.weight_copies += (c.n_expert - 1) * (self.weight_copies - copies)  # every expert's weights
        self.cached_weight_copies += (c.n_expert - 1) * (self.cached_weight_copies - cached)
        if out.requires_grad:
            self.save_new(rows * k, x.itemsize)  # the routing weight of each row
        if routed:
            self.save(out)  # for the routing weights' gradient
        self.save_new(out.numel, max(out.itemsize, x.itemsize))  # the weighted rows, saved by index_add_
        return self.new(x.numel, x.itemsize, True)

    def add(self, *ts: _T) -> _T:
        return self.new(ts[0].numel, max(t.itemsize for t in ts), any(t.requires_grad for t in ts))

    def block(self, x: _T, layer_idx: int) -> _T:
        c = self.c
        d = c.n_embd
        x_normed = self.norm(x, d, self.full)
        attention_out = self.attention(x_normed, layer_idx)
        if c.post_attention_norm:
            attention_out = self.norm(attention_out, d, self.full)
        if c.parallel_residual:
            mlp_in = x_normed if self.c.shared_attention_norm else self.norm(x, d, self.full)
            mlp_out = self.mlp(mlp_in)
            if c.post_mlp_norm:
                mlp_out = self.norm(mlp_out, d, self.full)
            return self.add(x, attention_out, mlp_out)
        x = self.add(x, attention_out)
        mlp_out = self.mlp(self.norm(x, d, self.full))
        if c.post_mlp_norm:
            mlp_out = self.norm(mlp_out, d, self.full)
        return self.add(x, mlp_out)


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
    """What autograd saves in one forward pass of `litgpt.model.GPT` training with these settings.

    `lora` (a `LoRASettings`) makes only the adapters trainable, as `litgpt finetune_lora` does. With a -mixed
    precision a single device runs under autocast over float32 weights, FSDP in 16 bits throughout.
    """
    mixed = precision.endswith("-mixed")
    compute = 4 if precision == "32-true" else 2
    master = 4 if precision == "32-true" or mixed else 2
    param_compute = compute if fsdp else master
    full = lora is None
    tokens = micro_batch_size * seq_length
    tape = _Tape(
        config, tokens=tokens, batch=micro_batch_size, seq=seq_length, param_compute=param_compute, compute=compute,
        autocast=mixed and not fsdp, device=device, full=full, lora=lora,
    )
    d = config.n_embd
    if full:
        tape.save_new(tokens, 8)  # the embedding's indices
    x = tape.new(tokens * d, param_compute, full)
    if config.scale_embeddings:
        if x.requires_grad:
            tape.save_new(1, x.itemsize)  # the scale, a 0-dim tensor
        x = tape.new(x.numel, x.itemsize, x.requires_grad)
    per_layer, layer_copies = [], []
    for i in range(config.n_layer):
        before, copies_before = tape.total(), tape.weight_copies
        x = tape.block(x, i)
        per_layer.append(tape.total() - before)
        layer_copies.append(tape.weight_copies - copies_before)
    head_lora = 1 if lora is not None and lora.head else 0
    x = tape.norm(x, d, full)
    logits = tape.linear(x, d, config.padded_vocab_size, full, head_lora, config.padded_vocab_size)
    if config.final_logit_softcapping is not None and logits.requires_grad:
        tape.save_new(logits.numel, logits.itemsize)  # tanh's output
    return SavedActivations(
        per_layer, tape.total() - sum(per_layer), tape.weight_copies, layer_copies, tape.cached_weight_copies
    )


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


def format_plan(plan: MemoryPlan) -> str:
    if plan.method == "lora":
        method = f"LoRA r={plan.lora_r} ({', '.join(plan.lora_targets)})"
        if plan.quantize:
            method = f"QLoRA {plan.quantize}, " + method[5:]
    else:
        method = "full finetune / pretrain"
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
        f"activation checkpointing {'on' if plan.activation_checkpointing else 'off'}, "
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
        label = "loading, before quantizing"
        lines.append(f"{label:<{width}} {'':>12} {_fmt(plan.loading):>12}  the whole base before training, + overhead")
    when = " (at loading)" if plan.device_memory - plan.margin != plan.total else ""
    if plan.fits:
        verdict = f"fits in {_fmt(plan.device_memory)}: {_fmt(plan.margin)} to spare{when}"
    else:
        verdict = f"does NOT fit in {_fmt(plan.device_memory)}: {_fmt(-plan.margin)} short{when}"
    lines.append(f"{'device memory':<{width}} {'':>12} {_fmt(plan.device_memory):>12}  {verdict}")
    if plan.cpu_offload:
        lines.append(f"{'host memory per node':<{width}} {'':>12} {_fmt(plan.host_memory_per_node):>12}")
    if plan.notes:
        lines.append("")
        lines.extend(f"- {note}" for note in plan.notes)
    return "\n".join(lines)

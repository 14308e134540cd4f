"""The plan as the command prints it: a table of the rows per device, the peak and the verdict, and the notes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from litgpt.plan.estimate import MemoryPlan

GiB = 2**30

# The rows of the plan: the `MemoryPlan` field of each, and its label in the table.
ROWS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state (AdamW)"),
    ("gathered_params", "gathered parameters"),
    ("activations", "activations"),
    ("logits_loss", "logits + loss (float32)"),
    ("buffers", "work buffers"),
)


def fmt(nbytes: int) -> str:
    if abs(nbytes) >= GiB / 10:
        return f"{nbytes / GiB:,.2f} GiB"
    return f"{nbytes / 2**20:,.1f} MiB"


def count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return str(n)


def _checkpointing_words(setting: str) -> str:
    words = {"none": "off", "full": "on", "ops": "ops (matmul and attention outputs kept)"}
    return words.get(setting) or f"{setting} (one block in {setting.removeprefix('every:')})"


def format_plan(plan: "MemoryPlan") -> str:
    if plan.method == "lora":
        method = f"LoRA r={plan.lora_r} ({', '.join(plan.lora_targets)})"
        if plan.quantize:
            method = f"QLoRA {plan.quantize}, " + method[5:]
    else:
        method = "full finetune / pretrain"
    if plan.summary:
        method += f", {plan.summary}"
    lines = [f"{plan.model_name}: {method}, {plan.precision}"]
    if plan.fsdp:
        lines.append(
            f"{plan.sharding_strategy} over {plan.num_nodes} node(s) x {plan.devices} device(s) = world size "
            f"{plan.world_size}: shard groups of {plan.shard_group_size}, {plan.replicate_groups} replica(s)"
            + (f", each layer split over {plan.tensor_parallel} devices (--parallel.tensor; the parameter counts "
               "are one device's piece)" if plan.tensor_parallel > 1 else "")
            + (f", each MoE layer's experts split over {plan.expert_parallel} devices (--parallel.expert; the "
               "parameter counts are one device's experts)" if plan.expert_parallel > 1 else "")
            + (f", each sequence split over {plan.context_parallel} devices (--parallel.context)"
               if plan.context_parallel > 1 else "")
            + (f", the layers cut into stages over {plan.pipeline_parallel} devices (--parallel.pipeline "
               f"{plan.pipeline_schedule}; the parameter counts are pipeline rank {plan.pipeline_rank}'s stages')"
               if plan.pipeline_parallel > 1 else "")
        )
    else:
        lines.append("1 device, no sharding")
    share = plan.trainable_params / plan.total_params if plan.total_params else 0.0
    lines.append(
        f"parameters: {count(plan.total_params)} total ({plan.total_params:,}), {count(plan.trainable_params)} "
        f"trainable ({share:.2%})"
    )
    lines.append(
        f"micro batch {plan.micro_batch_size} x {plan.seq_length:,} tokens on {plan.device} ({plan.attention}), "
        f"activation checkpointing {_checkpointing_words(plan.activation_checkpointing)}, "
        + ("activation offloading on, " if plan.offload_activations else "")
        + f"gradient accumulation {'on' if plan.accumulate_gradients else 'off'}"
    )
    lines.append("")
    width = 28
    lines.append(f"{'per device':<{width}} {'largest':>12} {'at peak':>12}  detail")
    for key, label in ROWS:
        lines.append(
            f"{label:<{width}} {fmt(getattr(plan, key)):>12} {fmt(plan.at_peak[key]):>12}  "
            f"{plan.row_details.get(key, '')}"
        )
    lines.append(f"{'':<{width}} {'':>12} {'-' * 12}")
    lines.append(f"{'peak':<{width}} {'':>12} {fmt(plan.peak):>12}  at the {plan.peak_phase}")
    lines.append(f"{'overhead':<{width}} {'':>12} {fmt(plan.overhead):>12}")
    lines.append(f"{'total':<{width}} {'':>12} {fmt(plan.total):>12}")
    if plan.loading:
        label = "loading (quantizing)"
        detail = "quantizing the base before training, + overhead"
        lines.append(f"{label:<{width}} {'':>12} {fmt(plan.loading):>12}  {detail}")
    when = " (at loading)" if plan.device_memory - plan.margin != plan.total else ""
    if plan.fits:
        verdict = f"fits in {fmt(plan.device_memory)}: {fmt(plan.margin)} to spare{when}"
    else:
        verdict = f"does NOT fit in {fmt(plan.device_memory)}: {fmt(-plan.margin)} short{when}"
    lines.append(f"{'device memory':<{width}} {'':>12} {fmt(plan.device_memory):>12}  {verdict}")
    if plan.host_memory_per_node:
        per_device = fmt(plan.host_memory_per_node // plan.devices)
        held = (["sharded parameters, gradients, optimizer state"] if plan.cpu_offload else []) + (
            [f"activations ({fmt(plan.host_activations)}, pinned)"] if plan.offload_activations else [])
        lines.append(f"{'host memory per node':<{width}} {'':>12} {fmt(plan.host_memory_per_node):>12}  "
                     f"{plan.devices} device(s) x {per_device}: {'; '.join(held)}")
    if plan.notes:
        lines.append("")
        lines.extend(f"- {note}" for note in plan.notes)
    return "\n".join(lines)

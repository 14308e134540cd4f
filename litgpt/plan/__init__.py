"""`litgpt plan`: the memory one training step needs on each device, worked out before anything is allocated
(`command`: the command; `estimate`: the per-device model; `measure`: saved activations on fake tensors; `layout`:
the parameters by FSDP unit; `quantized`: quantized weights' bytes; `report`: the table)."""

from litgpt.plan.command import main, plan_for, recipe_for
from litgpt.plan.estimate import MemoryPlan, estimate
from litgpt.plan.measure import SavedActivations, saved_activation_bytes
from litgpt.plan.report import GiB, format_plan

__all__ = [
    "GiB", "MemoryPlan", "SavedActivations", "estimate", "format_plan", "main", "plan_for", "recipe_for",
    "saved_activation_bytes",
]

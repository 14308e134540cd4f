"""Tensor-parallel plans per model family, as data (`dense.py`, with the styles of `styles.py`), and the checks of
which configs tensor, expert and context parallelism cover.

Light to import (no torch): entry points check `--parallel` before anything heavy loads."""

from __future__ import annotations

from litgpt.config import Config
from litgpt.errors import UserError


def check_tensor_parallel(config: Config, degree: int, quantized: bool = False) -> None:
    """UserError unless `degree`-way tensor parallelism covers `config` (`litgpt.distributed.plans.dense`): its heads,
    key-value groups, MLP widths (the dense layers', every expert's, the shared experts') and vocabulary split
    evenly. LoRA adapters are split with their layers, except on a quantized base (`quantized`: bitsandbytes layers
    and torchao's NF4 tensors are not DTensors the plan can split)."""
    if degree == 1:
        return
    name = config.name or "this model"
    if quantized:
        raise UserError(f"--parallel.tensor {degree}: tensor parallelism of models with a quantized base (--quantize, "
                        f"QLoRA) ({name}) is not supported yet; use --parallel.tensor 1.")
    sizes = {"heads (n_head)": config.n_head, "vocabulary rows (padded_vocab_size)": config.padded_vocab_size}
    if config.kv_lora_rank is None:  # latent attention has no key-value groups: every head expands the latent
        sizes["key-value groups (n_query_groups)"] = config.n_query_groups
    moe = config.mlp_class_name == "LLaMAMoE"
    if not moe or config.moe_first_dense_layers:
        sizes["MLP width (intermediate_size)"] = config.intermediate_size
    if moe:
        sizes["experts' width (moe_intermediate_size)"] = config.moe_intermediate_size
        if config.moe_n_shared_expert:
            sizes["shared experts' width (moe_shared_intermediate_size)"] = config.moe_shared_intermediate_size
    for what, size in sizes.items():
        if size % degree:
            raise UserError(f"--parallel.tensor {degree} does not divide the {size} {what} of {name}: use a divisor "
                            "of it.")


def check_expert_parallel(config: Config, degree: int) -> None:
    """UserError unless `degree`-way expert parallelism covers `config`: a mixture-of-experts model whose experts
    split evenly over the degree."""
    if degree == 1:
        return
    name = config.name or "this model"
    if config.mlp_class_name != "LLaMAMoE":
        raise UserError(f"--parallel.expert {degree}: {name} is a dense model (no mixture-of-experts layers to "
                        "split); use --parallel.expert 1.")
    if config.n_expert % degree:
        raise UserError(f"--parallel.expert {degree} does not divide the {config.n_expert} experts (n_expert) of "
                        f"{name}: use a divisor of it.")


def check_context_parallel(config: Config, degree: int, tensor: int = 1) -> None:
    """UserError unless `degree`-way context parallelism (the head scatter) covers `config`: fused-qkv or latent
    attention whose heads (and key-value groups) left on each of `tensor` ranks split evenly."""
    if degree == 1:
        return
    name = config.name or "this model"
    sizes = {"heads (n_head)": config.n_head}
    if config.kv_lora_rank is None:  # latent attention expands its keys and values for every head
        sizes["key-value groups (n_query_groups)"] = config.n_query_groups
    for what, size in sizes.items():
        if size % (degree * tensor):
            per_rank = f" x --parallel.tensor {tensor}" if tensor > 1 else ""
            raise UserError(f"--parallel.context {degree}{per_rank} does not divide the {size} {what} of {name}: "
                            "each rank attends with its share of them; use a divisor of it.")

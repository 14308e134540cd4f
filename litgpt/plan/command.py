"""`litgpt plan`: the memory a training run needs per device, and whether it fits, printed before anything is
allocated.

Its options are the training commands' own groups (`--train.*`, `--fsdp.*`, `--parallel.*`, `--lora.*`) and what only a plan has (the
method, the world layout, the device and its memory, the output). `recipe_for` makes the `Recipe` the run would train,
`plan_for` the plan (`litgpt.plan.estimate`), which `main` prints as a table or as JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from litgpt.args import DPOArgs, FSDPArgs, GRPOArgs, ParallelArgs, TrainArgs
from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.lora import LoRASettings

if TYPE_CHECKING:
    from litgpt.plan.estimate import MemoryPlan
    from litgpt.train.recipe import Recipe

METHODS = ("full", "lora")
# --train as the plan takes it by default: one sample per micro-batch (the other fields change no memory).
TRAIN_DEFAULTS = TrainArgs(micro_batch_size=1)


def main(
    model_name: Optional[str] = None,
    *,
    model_config: Optional[Config] = None,
    teacher_model_name: Optional[str] = None,
    teacher_config: Optional[Config] = None,
    json: bool = False,
    **options,
) -> None:
    """Print the memory a training run needs per device, and whether it fits, before anything is allocated.

    Args:
        model_name: A registered model name (`litgpt download list`), or leave out and give --model_config.
        model_config: The model's config fields (in YAML under `model_config:`), instead of a name.
        teacher_model_name: Distillation (`litgpt distill`): the frozen teacher's registered name.
        teacher_config: Or the teacher's config fields (in YAML under `teacher_config:`).
        json: Print the plan as JSON instead of a table.
        options: `plan_for`'s options (the run's method, precision, --train.*, --fsdp.*, --lora.*, world and device).
    """
    config = resolve_config(model_name, model_config)
    teacher = None
    if teacher_model_name is not None or teacher_config is not None:
        teacher = resolve_config(teacher_model_name, teacher_config)
    plan = plan_for(config, teacher_config=teacher, **options)
    if json:
        import json as json_module

        print(json_module.dumps(plan.to_dict(), indent=2))
    else:
        from litgpt.plan.report import format_plan

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


def plan_for(
    config: Config,
    *,
    method: str = "full",
    precision: str = "bf16-mixed",
    train: TrainArgs = TRAIN_DEFAULTS,
    fsdp: FSDPArgs = FSDPArgs(),
    parallel: ParallelArgs = ParallelArgs(),
    lora: LoRASettings = LoRASettings(),
    quantize: Optional[str] = None,
    teacher_config: Optional[Config] = None,
    dpo: Optional[DPOArgs] = None,
    grpo: Optional[GRPOArgs] = None,
    devices: int = 1,
    num_nodes: int = 1,
    accumulate_gradients: bool = True,
    device: str = "cuda",
    device_memory_gb: float = 80.0,
) -> "MemoryPlan":
    """The plan `litgpt plan` prints for these options (the one list of them: `main` forwards its own here).

    Args:
        config: The model's config.
        method: full (every weight trains) or lora (only the adapters train, as `litgpt finetune_lora`).
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed, 16-true or fp8-mixed (planned as bf16-mixed: its float8
            copies live only within each matmul), as the training commands take it.
        train: The training commands' --train group; the plan reads micro_batch_size, max_seq_length (default: the
            model's block size), activation_checkpointing, loss_chunk_size and optimizer_in_backward (which implies
            one micro-batch per step).
        fsdp: The training commands' --fsdp group (unused on one device); the plan reads sharding_strategy,
            cpu_offload and backward_prefetch.
        parallel: The training commands' --parallel group: --parallel.tensor N plans one device of N that split each
            layer (its heads, MLP columns and vocabulary rows; the norms' activations split over the positions; the
            head gathered whole for the loss), FSDP sharding over the data-parallel rest of the world;
            --parallel.expert N one device holding n_expert / N experts of every MoE layer (each 1/T of its width
            with --parallel.tensor T; sharded over the devices holding the same ones) and the all-to-all of the
            routed rows; --parallel.context N one device running 1/N of every sequence's positions and attention's
            all-to-all; --parallel.pipeline N the device of N that peaks, with its stages' blocks (and the embedding
            or the head), the micro-batches its schedule keeps in flight (--train.global_batch_size gives how many
            there are per step) and its receive buffers.
        lora: The adapters, as --lora.r, --lora.query, ... (method lora; `litgpt finetune_lora`'s --lora_r, ...).
        quantize: QLoRA: the frozen base weights of the blocks in bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.int8 or ao.nf4
            (method lora). On several devices FSDP shards them as torchao NF4 (ao.nf4, and bnb.nf4 / bnb.nf4-dq
            stored so), as the training commands do; bnb.fp4 and bnb.int8 run on one device only.
        teacher_config: Distillation: the frozen teacher's config.
        dpo: Preference optimization (`litgpt dpo`), e.g. --dpo.loss sigmoid: each sample is a pair of sequences,
            and with method full a frozen reference is held beside the model (none with
            --dpo.precompute_reference true or a reference-free loss; LoRA's is the base with the adapters off).
        grpo: GRPO (`litgpt grpo`), e.g. --grpo.num_generations 8: each sample is a prompt's group of that many
            completions, trained on together, and with method full and --grpo.beta > 0 a frozen reference is held
            (the generation's KV cache is not counted).
        devices: Devices per node.
        num_nodes: Nodes of the run.
        accumulate_gradients: Gradients of earlier micro-batches are held while the next one runs (the global batch
            is larger than devices x micro batch, as in the recipes); false for one micro-batch per step.
        device: cuda or cpu: which attention kernels and dropout masks, and which fixed overhead, to assume.
        device_memory_gb: Memory of one device in GiB (2**30 bytes) to check the plan against.
    """
    from litgpt.plan.estimate import estimate
    from litgpt.precision import Precision

    recipe = recipe_for(config, method, lora, quantize, teacher_config, dpo, grpo)
    return estimate(
        recipe, train, fsdp, Precision.resolve(precision, float8_recipe=train.float8_recipe), devices=devices,
        num_nodes=num_nodes, device=device, device_memory_gb=device_memory_gb,
        accumulate_gradients=accumulate_gradients, parallel=parallel,
    )


def recipe_for(config: Config, method: str = "full", lora: Optional[LoRASettings] = None,
               quantize: Optional[str] = None, teacher_config: Optional[Config] = None,
               dpo: Optional[DPOArgs] = None, grpo: Optional[GRPOArgs] = None) -> "Recipe":
    """The recipe the planned run trains: `config` whole (full) or its LoRA adapters (lora: `lora`, default
    settings when None) on a base stored as `quantize`, distilled from a frozen `teacher_config` or aligned on
    preference pairs (`dpo`) or on rewards of sampled groups (`grpo`). The one place the plan builds a `Recipe`."""
    from litgpt.args import KDArgs
    from litgpt.train.recipe import Recipe
    from litgpt.train.recipes.distill import DistillRecipe, TeacherSettings
    from litgpt.train.recipes.dpo import DPORecipe, PreferenceSettings
    from litgpt.train.recipes.grpo import GRPORecipe, GRPOSettings

    if method not in METHODS:
        raise UserError(f"--method {method!r} is not one of {', '.join(METHODS)}.")
    if sum(kind is not None for kind in (dpo, grpo, teacher_config)) > 1:
        raise UserError("Plan one kind of training: distillation (--teacher_config), preference optimization "
                        "(--dpo.*) or GRPO (--grpo.*).")
    lora = (lora or LoRASettings()) if method == "lora" else None
    if dpo is not None:
        dpo.check()
        return DPORecipe("dpo", config, lora=lora, quantize=quantize, preference=PreferenceSettings(dpo))
    if grpo is not None:  # the plan calls no reward
        grpo.check()
        return GRPORecipe("grpo", config, lora=lora, quantize=quantize, grpo=GRPOSettings(grpo, rewards=None))
    if teacher_config is not None:  # the plan reads no weights, and the KD settings change no memory
        teacher = TeacherSettings(config=teacher_config, weights=Path("unused"), kd=KDArgs())
        return DistillRecipe("distill", config, lora=lora, quantize=quantize, teacher=teacher)
    return Recipe("finetune_lora" if lora else "pretrain", config, lora=lora, quantize=quantize)

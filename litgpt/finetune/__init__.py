"""Finetuning commands: `full` (every weight) and `lora` (adapters on a frozen, optionally quantized, base)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from litgpt.lora import LoRASettings
    from litgpt.train.job import Job


def finetune_job(setup: Callable, arguments: dict, name: str, lora: "Optional[LoRASettings]" = None,
                 quantize: Optional[str] = None, initial_adapter_dir: Optional[Path] = None) -> "Job":
    """The job of a finetuning command's arguments: the recipe starts from the checkpoint's weights (and, with
    `initial_adapter_dir`, from that LoRA adapter's), the data is laid out in the checkpoint's prompt style, and the
    tokenizer is the checkpoint's."""
    from litgpt.checkpoint.model_files import WEIGHTS_FILE, find_checkpoint_dir
    from litgpt.compat import check_litgpt_arguments, tie_embeddings, untie_for_lora_head
    from litgpt.config import Config
    from litgpt.precision import Precision
    from litgpt.prompts import PromptStyle
    from litgpt.train.job import Job
    from litgpt.train.recipe import Recipe
    from litgpt.train.run_record import record_arguments

    arguments = check_litgpt_arguments(arguments)
    hyperparameters = record_arguments(setup, arguments)
    arguments["train"].check()
    checkpoint_dir = find_checkpoint_dir(Path(arguments["checkpoint_dir"]))
    config = tie_embeddings(Config.from_checkpoint(checkpoint_dir), arguments["train"], finetuning=True)
    initial_adapters = None
    if initial_adapter_dir is not None:
        from litgpt.convert.peft import read_initial_adapter

        lora, initial_adapters = read_initial_adapter(Path(initial_adapter_dir), config, lora)
        hyperparameters.update(lora.to_hparams())  # what the checkpoints' adapters are: merge_lora reads them
    config = untie_for_lora_head(config, lora)
    data = arguments["data"]
    if data is None:
        from litgpt.data import Alpaca

        data = Alpaca()
    recipe = Recipe(name=name, config=config, initialization="checkpoint", initial_weights=checkpoint_dir / WEIGHTS_FILE,
                    lora=lora, quantize=quantize, initial_adapters=initial_adapters)
    return Job(
        recipe=recipe, out_dir=Path(arguments["out_dir"]), data=data, tokenizer_dir=checkpoint_dir,
        train=arguments["train"], eval=arguments["eval"], hyperparameters=hyperparameters,
        precision=Precision.resolve(arguments["precision"], float8_recipe=arguments["train"].float8_recipe),
        resume=arguments["resume"],
        optimizer=arguments["optimizer"], seed=arguments["seed"], profile=arguments["profile"],
        timeout=arguments["fsdp"].timeout, logger_name=arguments["logger_name"],
        logger=arguments["logger"],
        # Instruction data takes a chat model's own style; on a base model, the data's default (alpaca).
        prompt_style=PromptStyle.for_finetuning(config),
        base_checkpoint=checkpoint_dir.resolve() if lora is not None else None,
    )


def check_tuning_method(arguments: dict, command: str) -> None:
    """The checks of the commands that tune a checkpoint either way (dpo, grpo): --method lora|full, --quantize only
    with lora, a core compiler."""
    from litgpt.errors import UserError
    from litgpt.registry import CORE_COMPILERS

    method, quantize = arguments["method"], arguments["quantize"]
    if method not in ("lora", "full"):
        raise UserError(f"--method {method!r}: use lora (adapters, QLoRA with --quantize) or full (every weight).")
    if method == "full" and quantize is not None:
        raise UserError(f"--quantize {quantize} stores a frozen base for LoRA adapters: use it with --method lora.")
    if arguments["compiler"] not in CORE_COMPILERS:
        raise UserError(f"--compiler {arguments['compiler']}: litgpt {command} compiles with none, auto or torch.")


def launch_tuning(job: "Job", arguments: dict, command: str) -> None:
    """Start a dpo or grpo job: Fabric (blocks compiled, not the whole loss: a reference or the rollouts run beside
    the policy), the quantized base's storage for the strategy, and the processes."""
    from litgpt.distributed.fsdp import FSDPStrategy
    from litgpt.finetune.lora import quantization_for
    from litgpt.train.job import launch
    from litgpt.train.launch import run_fabric

    fabric = run_fabric(job, devices=arguments["devices"], num_nodes=arguments["num_nodes"], fsdp=arguments["fsdp"],
                        run_name=f"{command}-{arguments['method']}-{job.recipe.config.name or 'model'}",
                        compiler=arguments["compiler"], whole_loss=False)
    if arguments["quantize"] is not None:
        job = quantization_for(job, fabric.strategy if isinstance(fabric.strategy, FSDPStrategy) else None)
    launch(fabric, job)

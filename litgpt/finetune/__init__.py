"""Finetuning commands: `full` (every weight) and `lora` (adapters on a frozen, optionally quantized, base)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from litgpt.lora import LoRASettings
    from litgpt.train.job import Job


def finetune_job(setup: Callable, arguments: dict, name: str, lora: "Optional[LoRASettings]" = None,
                 quantize: Optional[str] = None) -> "Job":
    """The job of a finetuning command's arguments: the recipe starts from the checkpoint's weights, the data is laid
    out in the checkpoint's prompt style, and the tokenizer is the checkpoint's."""
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
    config = untie_for_lora_head(config, lora)
    data = arguments["data"]
    if data is None:
        from litgpt.data import Alpaca

        data = Alpaca()
    recipe = Recipe(name=name, config=config, initialization="checkpoint", initial_weights=checkpoint_dir / WEIGHTS_FILE,
                    lora=lora, quantize=quantize)
    return Job(
        recipe=recipe, out_dir=Path(arguments["out_dir"]), data=data, tokenizer_dir=checkpoint_dir,
        train=arguments["train"], eval=arguments["eval"], hyperparameters=hyperparameters,
        precision=Precision.resolve(arguments["precision"]), resume=arguments["resume"],
        optimizer=arguments["optimizer"], seed=arguments["seed"], profile=arguments["profile"],
        timeout=arguments["fsdp"].timeout,
        # Instruction data takes a chat model's own style; on a base model, the data's default (alpaca).
        prompt_style=PromptStyle.for_finetuning(config),
    )

"""LitGPT 0.5.13's recipe keys that mean nothing here, in one place.

Our training commands take LitGPT's argument names, so its `config_hub` recipes and scripts parse as written. Most
keys mean the same here. The rest are read too (fields of `args.TrainArgs`, `args.EvalArgs`, `args.LogArgs`,
`data.base.LoaderOptions` and the commands' `access_token`) and then checked here, once the command has its
arguments: a key whose setting has no effect here gets a one-line note that says why, and a key whose setting would
change the run in a way we cannot follow is refused with one line that says what to use instead. A key left at
LitGPT's default (or null) is what the run does anyway and gets no line. LitGPT's data modules that are not carried
refuse themselves (`data/litgpt_only.py`); LitGPT's command names are in `__main__.py`, and the one that needs
code of its own, `convert_pretrained_checkpoint`, is here. `tutorials/coming_from_litgpt.md` lists all of it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from litgpt.args import EvalArgs, LoggerArgs, LogArgs, TrainArgs
from litgpt.errors import UserError

if TYPE_CHECKING:
    from litgpt.config import Config
    from litgpt.lora import LoRASettings


def check_litgpt_arguments(arguments: dict) -> dict:
    """Note or refuse the LitGPT-only settings among a training command's `arguments` (see the module docstring);
    returns the arguments to run and record, without the access token."""
    from litgpt.distributed.runtime import print_once

    train: TrainArgs = arguments["train"]
    if train.max_time is not None:
        raise UserError(
            f"--train.max_time {train.max_time}: there is no time limit here; bound the run with --train.max_steps or "
            "--train.max_tokens (a SIGTERM or SIGUSR1 also saves a checkpoint and stops it)."
        )
    if train.lr_warmup_fraction is not None:
        raise UserError(
            f"--train.lr_warmup_fraction {train.lr_warmup_fraction}: give the warm-up in optimizer steps with "
            "--train.lr_warmup_steps (an epoch is as many steps as training samples / train.global_batch_size)."
        )
    for note in litgpt_notes(arguments):
        print_once(f"Note: {note}")
    arguments = {**arguments, "logger": litgpt_logger_args(arguments)} if "logger" in arguments else arguments
    return {**arguments, "access_token": None} if "access_token" in arguments else arguments


# LitGPT's --log.* fields that name its W&B run, and the --logger.* field each one fills.
LITGPT_WANDB_FIELDS = {"project": "project", "run": "name", "group": "group"}


def litgpt_logger_args(arguments: dict) -> LoggerArgs:
    """--logger.* with LitGPT's log.project, log.run and log.group filled in where the W&B logger runs (as LitGPT
    names its W&B run) and the --logger.* field is not given."""
    logger, log = arguments["logger"], arguments.get("log")
    if log is None or arguments.get("logger_name") != "wandb":
        return logger
    filled = {ours: getattr(log, theirs) for theirs, ours in LITGPT_WANDB_FIELDS.items()
              if getattr(log, theirs) is not None and getattr(logger, ours) is None}
    return dataclasses.replace(logger, **filled)


def litgpt_notes(arguments: dict) -> list[str]:
    """One line for each LitGPT-only setting in `arguments` that has no effect here."""
    notes = []
    data = arguments.get("data")
    workers = getattr(data, "num_workers", None)
    if workers is not None and not getattr(data, "loader_workers", False):
        notes.append(
            f"data.num_workers {workers} has no effect here: there are no loader workers (samples are tokenized once "
            "into a cache and collated in the training process)."
        )
    from litgpt.data import TinyStories

    if isinstance(arguments.get("data"), TinyStories) and arguments["data"].seed is not None:
        notes.append(
            f"data.seed {arguments['data'].seed} of TinyStories has no effect here: the run's --seed orders the "
            "samples."
        )
    example = arguments["eval"].evaluate_example
    if example != EvalArgs.evaluate_example:
        notes.append(
            f"eval.evaluate_example {example!r} has no effect here: the text sample after each validation always "
            "starts from the first validation sample."
        )
    log = arguments.get("log")
    if log is not None:
        named = LITGPT_WANDB_FIELDS if arguments.get("logger_name") == "wandb" else {}
        changed = [f.name for f in dataclasses.fields(LogArgs)
                   if getattr(log, f.name) != f.default and f.name not in named]
        if changed:
            notes.append(
                f"log.{', log.'.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect here: the tracker's "
                "run is set with --logger.* (project, name, entity, group, tags; LitGPT's log.project, log.run and "
                "log.group name a --logger_name wandb run)."
            )
    if arguments.get("access_token"):
        notes.append(
            "access_token has no effect here: finetuning reads checkpoint_dir from disk and downloads nothing; give "
            "the token to `litgpt download ORG/NAME --access_token ...` instead."
        )
    return notes


def tie_embeddings(config: "Config", train: TrainArgs, finetuning: bool) -> "Config":
    """The model config with LitGPT's `--train.tie_embeddings` applied: pretraining ties (or unties) the output head
    to the token embedding as asked; finetuning keeps the checkpoint's layout and notes a setting that differs."""
    wanted: Optional[bool] = train.tie_embeddings
    if wanted is None or wanted == config.tie_embeddings:
        return config
    if finetuning:
        from litgpt.distributed.runtime import print_once

        print_once(
            f"Note: train.tie_embeddings {wanted} has no effect when finetuning: the checkpoint's weights decide "
            f"(its model_config.yaml has tie_embeddings: {config.tie_embeddings})."
        )
        return config
    return dataclasses.replace(config, tie_embeddings=wanted)


def untie_for_lora_head(config: "Config", lora: "Optional[LoRASettings]") -> "Config":
    """The model config for LitGPT's `lora_head: true` on a checkpoint whose head is tied to its embeddings (Gemma):
    untied, so that the head starts as a copy of the embeddings and only it is adapted, as in LitGPT's layout, where
    such a head is a copy. Said in one line; the run's model_config.yaml then has tie_embeddings: false."""
    if lora is None or not lora.head or not config.tie_embeddings:
        return config
    from litgpt.distributed.runtime import print_once

    print_once(
        "Note: lora_head on a model whose output head is tied to its embeddings: the head becomes a copy of the "
        "embeddings that the adapters change (as in LitGPT's layout); the result has tie_embeddings: false."
    )
    return dataclasses.replace(config, tie_embeddings=False)


def convert_pretrained_checkpoint(checkpoint_dir: Path, output_dir: Path) -> None:
    """LitGPT's `convert_pretrained_checkpoint`: a checkpoint of a pretraining run as a model folder of its own
    (weights, model_config.yaml, tokenizer) that generate, chat, finetune_* and the converters read.

    Our runs' full checkpoints (final/, step-XXXXXX/) already hold the model's weights alone, so they are copied; a
    sharded one is consolidated (`litgpt consolidate`). Nothing is written when a check fails.

    Args:
        checkpoint_dir: final/ or a step-XXXXXX folder of a `litgpt pretrain` run.
        output_dir: The new model folder; it must not exist or must be empty.
    """
    from litgpt.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE, copy_tokenizer_files, find_checkpoint_dir
    from litgpt.checkpoint.store import SHARDED_DIR
    from litgpt.io import atomic_copy

    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise UserError(f"{str(output_dir)!r} exists and is not an empty folder: choose a new output_dir.")
    if (checkpoint_dir / SHARDED_DIR).is_dir():
        from litgpt.consolidate import main as consolidate

        consolidate(checkpoint_dir, out_dir=output_dir)
        return
    find_checkpoint_dir(checkpoint_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_copy(checkpoint_dir / CONFIG_FILE, output_dir / CONFIG_FILE)
    copy_tokenizer_files(checkpoint_dir, output_dir)
    atomic_copy(checkpoint_dir / WEIGHTS_FILE, output_dir / WEIGHTS_FILE)  # last: the folder is whole once it is there
    print(f"Wrote the model of {str(checkpoint_dir)!r} to {str(output_dir)!r}.")

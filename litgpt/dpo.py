"""`litgpt dpo`: preference optimization (DPO, IPO, hinge, robust DPO, SimPO, ORPO) of a checkpoint, with LoRA
adapters (QLoRA with --quantize) or every weight.

The run is finetuning's job with `litgpt.train.recipes.dpo.DPORecipe` as its recipe (the loss of
`litgpt.train.preference_loss`, a reference as cheap as the method allows); data, sharding, checkpoints, resume,
signals and metrics are what every training command has.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional, Union

from litgpt.args import DPOArgs, EvalArgs, FSDPArgs, LoggerArgs, LogArgs, TrainArgs
from litgpt.data.base import DataModule
from litgpt.errors import UserError
from litgpt.loggers import LoggerName


def setup(
    checkpoint_dir: Path,
    method: Literal["lora", "full"] = "lora",
    out_dir: Path = Path("out/dpo"),
    precision: Optional[str] = None,
    quantize: Optional[Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8", "ao.nf4"]] = None,
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    fsdp: FSDPArgs = FSDPArgs(),
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    lora_query: bool = True,
    lora_key: bool = False,
    lora_value: bool = True,
    lora_projection: bool = False,
    lora_mlp: bool = False,
    lora_head: bool = False,
    resume: Union[bool, Literal["auto"], Path] = False,
    data: Optional[DataModule] = None,
    train: TrainArgs = TrainArgs(
        save_interval=1000,
        log_interval=1,
        global_batch_size=16,
        micro_batch_size=1,
        lr_warmup_steps=10,
        epochs=1,
        max_seq_length=None,
    ),
    eval: EvalArgs = EvalArgs(interval=100, max_new_tokens=100, max_iters=100),
    optimizer: Union[str, dict] = {"class_path": "AdamW", "init_args": {"lr": 5e-6}},
    logger_name: LoggerName = "csv",
    logger: LoggerArgs = LoggerArgs(),
    seed: int = 1337,
    profile: bool = False,
    compiler: str = "none",
    dpo: DPOArgs = DPOArgs(),
    log: LogArgs = LogArgs(),
    access_token: Optional[str] = None,
) -> None:
    """Align a model on preference pairs (a prompt, a chosen and a rejected answer).

    Every pair's chosen and rejected sequences run in one forward; the loss compares their summed answer
    log-probabilities with the reference's (the same weights with the adapters switched off under LoRA, a frozen copy
    of the checkpoint under full finetuning, or its log-probabilities computed once with --dpo.precompute_reference);
    simpo and orpo need no reference. The log shows TRL's rewards/* and logps/* beside the loss.

    Args:
        checkpoint_dir: The model to align (usually after supervised finetuning): a folder with lit_model.pth,
            model_config.yaml and the tokenizer (and its chat template, which lays out conversations).
        method: lora (adapters on a frozen base; QLoRA with --quantize) or full (every weight).
        out_dir: Where checkpoints (step-XXXXXX/, final/), logs, run_args.json and metrics.json go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or fp8-mixed (default: bf16-mixed on GPUs and on CPUs with
            native bf16, AVX512-BF16 or AMX; 32-true on other CPUs; printed at start).
        quantize: With --method lora: store the frozen base quantized (as `litgpt finetune_lora --quantize`).
        devices: Devices per node (an int, or "auto").
        num_nodes: Nodes of the run.
        fsdp: How runs on several devices shard the model and a frozen reference (--fsdp.sharding_strategy, ...).
        lora_r: The adapters' rank (--method lora).
        lora_alpha: The adapters' scale numerator (the update is scaled by alpha / r).
        lora_dropout: Dropout on the adapters' input.
        lora_query: Adapt the query projection.
        lora_key: Adapt the key projection.
        lora_value: Adapt the value projection.
        lora_projection: Adapt the attention output projection.
        lora_mlp: Adapt the MLP (every expert's in a mixture of experts).
        lora_head: Adapt the output head.
        resume: Continue a run: "auto" (the newest checkpoint in out_dir), a step-XXXXXX folder, or false.
        data: The preference pairs: `--data Preference --data.json_path FILE` (or --data.dataset for a Hugging Face
            dataset); see `litgpt.data.preference`.
        train: Training schedule and batch sizes (a sample is one pair).
        eval: Validation settings (validation reports the loss and val_rewards/*).
        optimizer: An optimizer name (AdamW) or a mapping {class_path, init_args} (default: AdamW, lr 5e-6).
        logger_name: The experiment tracker: csv, tensorboard, wandb (online unless WANDB_MODE says offline) or
            mlflow (to MLFLOW_TRACKING_URI, else out_dir/mlruns).
        logger: The tracker's run: --logger.project, --logger.name, --logger.entity, --logger.group,
            --logger.tags, as the tracker has them.
        seed: Seed of the adapters' initialization, the dropout and the data order.
        profile: Record a torch.profiler trace of a few steps into out_dir/profile/.
        compiler: none (eager; the default), auto or torch (each transformer block compiled).
        dpo: The loss: --dpo.loss sigmoid|ipo|hinge|robust|simpo|orpo, --dpo.beta, --dpo.label_smoothing,
            --dpo.simpo_gamma, --dpo.precompute_reference.
        log: LitGPT's logger settings (--log.project, ...), read so that its recipes work; no effect here.
        access_token: LitGPT's token for downloading checkpoint_dir; no effect here (`litgpt download` takes it).
    """
    arguments = dict(locals())
    from litgpt.finetune import launch_tuning

    launch_tuning(dpo_job(arguments), arguments, "dpo")


def dpo_job(arguments: dict):
    """Finetuning's job (LoRA or full) with the preference recipe, every input checked before Lightning loads."""
    from litgpt.finetune import check_tuning_method, finetune_job
    from litgpt.finetune.lora import lora_settings
    from litgpt.train.recipes.dpo import REFERENCE_FILE, DPORecipe, PreferenceSettings

    args: DPOArgs = arguments["dpo"]
    args.check()
    check_tuning_method(arguments, "dpo")
    method, quantize = arguments["method"], arguments["quantize"]
    if arguments["data"] is None:
        raise UserError("Give the preference pairs: --data Preference --data.json_path FILE (a .json or .jsonl of "
                        "prompt/chosen/rejected rows) or --data.dataset NAME.")
    lora = lora_settings(arguments) if method == "lora" else None
    job = finetune_job(setup, arguments, name="dpo", lora=lora, quantize=quantize)
    settings = PreferenceSettings(args=args, reference_store=Path(arguments["out_dir"]) / REFERENCE_FILE)
    return dataclasses.replace(job, recipe=DPORecipe(**vars(job.recipe), preference=settings))

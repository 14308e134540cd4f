"""`litgpt grpo`: online reinforcement learning with verifiable rewards (GRPO, Dr. GRPO, DAPO) of a checkpoint, with
LoRA adapters (QLoRA with --quantize) or every weight.

The run is finetuning's job with `litgpt.train.recipes.grpo.GRPORecipe` as its recipe: the data are prompts
(`--data Prompts`), each step's completions are sampled from the policy as it is by `litgpt serve`'s batching engine
and scored by the reward functions (`litgpt.train.rewards`); sharding, checkpoints, resume, signals and metrics are
what every training command has.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional, Union

from litgpt.args import EvalArgs, FSDPArgs, GRPOArgs, LoggerArgs, LogArgs, TrainArgs
from litgpt.data.base import DataModule
from litgpt.errors import UserError
from litgpt.loggers import LoggerName
from litgpt.train.prompt_data import Prompts  # noqa: F401  (--data Prompts names it)


def setup(
    checkpoint_dir: Path,
    method: Literal["lora", "full"] = "lora",
    out_dir: Path = Path("out/grpo"),
    precision: Optional[str] = None,
    quantize: Optional[Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8", "ao.nf4"]] = None,
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    fsdp: FSDPArgs = FSDPArgs(),
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
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
        global_batch_size=8,
        micro_batch_size=1,
        lr_warmup_steps=0,
        epochs=1,
        max_seq_length=None,
        min_lr=0.0,
    ),
    eval: EvalArgs = EvalArgs(interval=100, max_new_tokens=0, max_iters=8),
    optimizer: Union[str, dict] = {"class_path": "AdamW", "init_args": {"lr": 1e-5}},
    logger_name: LoggerName = "csv",
    logger: LoggerArgs = LoggerArgs(),
    seed: int = 1337,
    profile: bool = False,
    compiler: str = "none",
    grpo: GRPOArgs = GRPOArgs(),
    reward: Union[str, list[str]] = "exact_answer",
    reward_weights: Optional[list[float]] = None,
    log: LogArgs = LogArgs(),
    access_token: Optional[str] = None,
) -> None:
    """Train a model on rewards a program computes from its own sampled completions (GRPO and its variants).

    Each optimizer step takes --train.global_batch_size prompts; each prompt gets --grpo.num_generations completions
    sampled from the current weights (with a KV cache, in batches); every completion's advantage is its reward less
    its group's mean (over the group's std for grpo and dapo), and the clipped policy loss raises the probability of
    the better ones. A micro-batch of --train.micro_batch_size prompts trains on its prompts' groups together.

    Args:
        checkpoint_dir: The model to train (usually after supervised finetuning): a folder with lit_model.pth,
            model_config.yaml and the tokenizer (and its chat template, which lays out conversations).
        method: lora (adapters on a frozen base; QLoRA with --quantize) or full (every weight).
        out_dir: Where checkpoints (step-XXXXXX/, final/), logs, run_args.json and metrics.json go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or fp8-mixed (default: the machine's, printed at start).
        quantize: With --method lora: store the frozen base quantized (as `litgpt finetune_lora --quantize`).
        devices: Devices per node (an int, or "auto").
        num_nodes: Nodes of the run.
        fsdp: How runs on several devices shard the model and a frozen reference (--fsdp.sharding_strategy, ...).
        lora_r: The adapters' rank (--method lora).
        lora_alpha: The adapters' scale numerator (the update is scaled by alpha / r).
        lora_dropout: Dropout on the adapters' input (0: the importance ratio of one step per generation is 1).
        lora_query: Adapt the query projection.
        lora_key: Adapt the key projection.
        lora_value: Adapt the value projection.
        lora_projection: Adapt the attention output projection.
        lora_mlp: Adapt the MLP (every expert's in a mixture of experts).
        lora_head: Adapt the output head.
        resume: Continue a run: "auto" (the newest checkpoint in out_dir), a step-XXXXXX folder, or false.
        data: The prompts: `--data Prompts --data.json_path FILE` (rows with a "prompt", text or chat messages, and
            the fields the rewards read, e.g. "answer") or --data.dataset for a Hugging Face dataset.
        train: Training schedule and batch sizes (a sample is one prompt, with its group of completions).
        eval: Validation settings (validation samples completions of the validation prompts and logs their loss
            and rewards as val_*).
        optimizer: An optimizer name (AdamW) or a mapping {class_path, init_args} (default: AdamW, lr 1e-5).
        logger_name: The experiment tracker: csv, tensorboard, wandb or mlflow.
        logger: The tracker's run: --logger.project, --logger.name, --logger.entity, --logger.group, --logger.tags.
        seed: Seed of the adapters' initialization, the data order and every completion's sampling.
        profile: Record a torch.profiler trace of a few steps into out_dir/profile/.
        compiler: none (eager; the default), auto or torch (each transformer block compiled).
        grpo: The group size, sampling and loss: --grpo.num_generations, --grpo.max_new_tokens,
            --grpo.temperature/top_k/top_p, --grpo.loss grpo|dr_grpo|dapo, --grpo.epsilon, --grpo.epsilon_high,
            --grpo.beta, --grpo.steps_per_generation, --grpo.max_batch_size, --grpo.refill_rounds (dapo).
        reward: The reward functions: built-ins exact_answer, regex_format[=PATTERN], length_penalty[=CHARACTERS],
            or your own module:function (a module or a .py file) with TRL's signature
            fn(prompts, completions, **row_fields) -> list[float]; several, given as a list
            (`--reward '[exact_answer, my_rewards.py:format]'`), add up.
        reward_weights: Each reward's weight in the total (default: 1 each).
        log: LitGPT's logger settings (--log.project, ...), read so that its recipes work; no effect here.
        access_token: LitGPT's token for downloading checkpoint_dir; no effect here (`litgpt download` takes it).
    """
    arguments = dict(locals())
    from litgpt.finetune import launch_tuning

    launch_tuning(grpo_job(arguments), arguments, "grpo")


def grpo_job(arguments: dict):
    """Finetuning's job (LoRA or full) with the GRPO recipe, every input checked before Lightning loads."""
    from litgpt.finetune import check_tuning_method, finetune_job
    from litgpt.finetune.lora import lora_settings
    from litgpt.train.recipes.grpo import GRPORecipe, GRPOSettings
    from litgpt.train.rewards import Rewards

    args: GRPOArgs = arguments["grpo"]
    args.check()
    check_tuning_method(arguments, "grpo")
    method, quantize = arguments["method"], arguments["quantize"]
    if not isinstance(arguments["data"], Prompts):
        raise UserError("Give the prompts: --data Prompts --data.json_path FILE (a .json or .jsonl of rows with a "
                        "\"prompt\" and the fields your rewards read) or --data.dataset NAME.")
    specs = [arguments["reward"]] if isinstance(arguments["reward"], str) else arguments["reward"]
    rewards = Rewards.from_specs(specs, arguments["reward_weights"])
    lora = lora_settings(arguments) if method == "lora" else None
    job = finetune_job(setup, arguments, name="grpo", lora=lora, quantize=quantize)
    settings = GRPOSettings(args=args, rewards=rewards, seed=arguments["seed"])
    return dataclasses.replace(job, recipe=GRPORecipe(**vars(job.recipe), grpo=settings))

"""`litgpt pretrain`: train a model from scratch, or continue pretraining from a checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, Literal, Optional, Union

from litgpt.args import EvalArgs, FSDPArgs, ParallelArgs, LoggerArgs, LogArgs, TrainArgs
from litgpt.config import Config
from litgpt.data.base import DataModule
from litgpt.errors import UserError
from litgpt.loggers import LoggerName

if TYPE_CHECKING:
    from litgpt.train.job import Job

# Pretraining's schedule defaults.
TRAIN_DEFAULTS = TrainArgs(
    save_interval=1000,
    log_interval=1,
    global_batch_size=512,
    micro_batch_size=4,
    max_tokens=int(3e12),
    max_norm=1.0,
    min_lr=4e-5,
    lr_warmup_steps=2000,
)
EVAL_DEFAULTS = EvalArgs(interval=1000, max_iters=100)


def setup(
    model_name: Optional[str] = None,
    model_config: Optional[Config] = None,
    out_dir: Path = Path("out/pretrain"),
    precision: Optional[str] = None,
    initial_checkpoint_dir: Optional[Path] = None,
    resume: Union[bool, Literal["auto"], Path] = False,
    data: Optional[DataModule] = None,
    train: TrainArgs = TRAIN_DEFAULTS,
    eval: EvalArgs = EVAL_DEFAULTS,
    optimizer: Union[str, dict] = "AdamW",
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    fsdp: FSDPArgs = FSDPArgs(),
    parallel: ParallelArgs = ParallelArgs(),
    tokenizer_dir: Optional[Path] = None,
    logger_name: LoggerName = "csv",
    logger: LoggerArgs = LoggerArgs(),
    seed: int = 42,
    profile: bool = False,
    compiler: str = "auto",
    strategy: Literal["auto", "fsdp", "ddp"] = "auto",
    log: LogArgs = LogArgs(),
) -> None:
    """Pretrain a model.

    Args:
        model_name: A registered model name (`litgpt download list`), or leave out and give --model_config.
        model_config: The model's config fields (in YAML under `model_config:`), instead of a name.
        out_dir: Where checkpoints (step-XXXXXX/, final/), logs, run_args.json and metrics.json go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or fp8-mixed (default: bf16-mixed on GPUs and on CPUs with
            native bf16, AVX512-BF16 or AMX; 32-true on other CPUs; printed at start).
        initial_checkpoint_dir: Start from these weights (continued pretraining) instead of a random init.
        resume: Continue a run: "auto" (the newest checkpoint in out_dir), a step-XXXXXX folder, or false.
        data: The data module (default: the bundled tiny corpus, `Tiny`).
        train: Training schedule and batch sizes.
        eval: Validation settings.
        optimizer: An optimizer name (AdamW) or a mapping {class_path, init_args} (lr, weight_decay, betas).
        devices: Devices per node (an int, or "auto").
        num_nodes: Nodes of the run.
        fsdp: How runs on several devices shard the model (--fsdp.sharding_strategy, --fsdp.state_dict_type, ...).
        parallel: Parallelism beside FSDP's: --parallel.tensor N splits each layer over N neighbouring devices
            (tensor and sequence parallelism; FSDP shards over the rest of the world); --parallel.expert N splits
            each mixture-of-experts layer's experts over N data-parallel devices (expert parallelism);
            --parallel.context N splits every sequence's positions over N devices (context parallelism, Ulysses'
            head scatter around each attention); --parallel.pipeline N cuts the layers into stages over N devices
            (pipeline parallelism, schedule --parallel.pipeline_schedule).
        tokenizer_dir: The folder with tokenizer.json (default: initial_checkpoint_dir, or the data's own).
        logger_name: The experiment tracker: csv, tensorboard, wandb (online unless WANDB_MODE says offline) or
            mlflow (to MLFLOW_TRACKING_URI, else out_dir/mlruns).
        logger: The tracker's run: --logger.project, --logger.name, --logger.entity, --logger.group,
            --logger.tags, as the tracker has them.
        seed: Seed of the initialization and of the data order.
        profile: Record a torch.profiler trace of a few steps into out_dir/profile/.
        compiler: auto (torch on CUDA GPUs, and on CPUs for runs of at least 100 steps; none for shorter CPU
            runs and mixture-of-experts models on CPUs), none (eager), torch (torch.compile: of each transformer
            block on GPUs and with several processes, about a third more tokens/s on an H100; of the whole loss,
            model, head and loss in one graph, in one CPU process, see benchmarks/README.md; the first step pays
            the compilation, which inductor caches for later runs of the same shapes), or the name of a compiler
            extension registered under the `litgpt.compilers` entry points, which takes over the run: thunder
            (extensions/thunder, `pip install -e '.[thunder]'`).
        strategy: How several devices train: auto or fsdp shard the model with FSDP (--fsdp.*); ddp replicates it
            (FSDP's NO_SHARD). With --compiler thunder: Thunder's own FSDP (ZeRO-3, bucketed per block) or DDP.
        log: LitGPT's logger settings (--log.project, ...), read so that its recipes work; no effect here.
    """
    job = pretrain_job(dict(locals()), record_arguments_of=setup)
    fsdp = fsdp_for_strategy(strategy, fsdp)

    from litgpt.train.job import launch
    from litgpt.train.launch import run_fabric

    launch(run_fabric(job, devices=devices, num_nodes=num_nodes, fsdp=fsdp, parallel=parallel,
                      run_name=f"pretrain-{job.recipe.config.name or 'model'}", compiler=compiler, strategy=strategy),
           job)


def pretrain_job(arguments: dict, record_arguments_of: Callable) -> "Job":
    """The pretraining job of `setup`'s arguments (also distillation's, whose recipe adds a teacher), checked before
    anything heavy is imported."""
    from litgpt.checkpoint.model_files import WEIGHTS_FILE, find_checkpoint_dir
    from litgpt.compat import check_litgpt_arguments, tie_embeddings
    from litgpt.precision import Precision
    from litgpt.train.job import Job
    from litgpt.train.recipe import Recipe
    from litgpt.train.run_record import record_arguments

    arguments = check_litgpt_arguments(arguments)
    a = SimpleNamespace(**arguments)
    hyperparameters = record_arguments(record_arguments_of, arguments)
    a.train.check()
    if a.initial_checkpoint_dir is not None:  # LitGPT's ORG/NAME is checkpoints/ORG/NAME
        a.initial_checkpoint_dir = find_checkpoint_dir(a.initial_checkpoint_dir)
    config, data, tokenizer_dir = resolve_inputs(a.model_name, a.model_config, a.initial_checkpoint_dir, a.data,
                                                 a.tokenizer_dir)
    config = tie_embeddings(config, a.train, finetuning=False)
    initial_weights = Path(a.initial_checkpoint_dir) / WEIGHTS_FILE if a.initial_checkpoint_dir else None
    recipe = Recipe(name="pretrain", config=config, initialization="random", initial_weights=initial_weights)
    return Job(
        recipe=recipe, out_dir=Path(a.out_dir), data=data, tokenizer_dir=tokenizer_dir, train=a.train, eval=a.eval,
        hyperparameters=hyperparameters, precision=Precision.resolve(a.precision, float8_recipe=a.train.float8_recipe),
        resume=a.resume, optimizer=a.optimizer, seed=a.seed, profile=a.profile, timeout=a.fsdp.timeout,
        logger_name=a.logger_name, logger=a.logger,
    )


def fsdp_for_strategy(strategy: str, fsdp: FSDPArgs) -> FSDPArgs:
    """--strategy ddp is FSDP's NO_SHARD: every device holds the whole model and the gradients are all-reduced."""
    if strategy != "ddp" or fsdp.sharding_strategy == "NO_SHARD":
        return fsdp
    if fsdp.sharding_strategy != FSDPArgs.sharding_strategy:
        raise UserError(
            f"--strategy ddp replicates the model, but --fsdp.sharding_strategy {fsdp.sharding_strategy} shards it: "
            "give one of the two."
        )
    return dataclasses.replace(fsdp, sharding_strategy="NO_SHARD")


def resolve_inputs(model_name, model_config, initial_checkpoint_dir, data, tokenizer_dir):
    """The model config, the data module and the tokenizer folder a pretraining run uses, from its arguments."""
    from litgpt.distributed.runtime import print_once

    if model_config is not None and model_name is not None:
        # LitGPT's recipes give both (its pretrain needs a name); as in LitGPT, the config wins.
        print_once(f"Note: --model_config (name {model_config.name!r}) is used; --model_name {model_name!r} is not.")
    if model_config is not None:
        config = model_config
    elif model_name is not None:
        config = Config.from_name(model_name)
    elif initial_checkpoint_dir is not None:
        config = Config.from_checkpoint(initial_checkpoint_dir)
    else:
        raise UserError("Name a model to pretrain (e.g. `litgpt pretrain pythia-14m`) or give --model_config / --config.")
    if data is None:
        from litgpt.data import Tiny

        data = Tiny()
    return config, data, default_tokenizer_dir(tokenizer_dir, data, initial_checkpoint_dir)


def default_tokenizer_dir(tokenizer_dir: Optional[Path], data, checkpoint_dir: Optional[Path]) -> Path:
    """--tokenizer_dir, else the checkpoint's folder, else the data's bundled tokenizer."""
    if tokenizer_dir is not None:
        return Path(tokenizer_dir)
    if checkpoint_dir is not None:
        return Path(checkpoint_dir)
    bundled = getattr(data, "tokenizer_dir", None)
    if bundled is not None:
        return Path(bundled)
    raise UserError("Pretraining needs a tokenizer: pass --tokenizer_dir (a folder with tokenizer.json).")

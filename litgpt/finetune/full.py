"""`litgpt finetune_full`: finetune every weight of a checkpoint on instruction data."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

from litgpt.args import EvalArgs, FSDPArgs, ParallelArgs, LoggerArgs, LogArgs, TrainArgs
from litgpt.data.base import DataModule
from litgpt.loggers import LoggerName


def setup(
    checkpoint_dir: Path,
    out_dir: Path = Path("out/finetune/full"),
    precision: Optional[str] = None,
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    fsdp: FSDPArgs = FSDPArgs(),
    parallel: ParallelArgs = ParallelArgs(),
    resume: Union[bool, Literal["auto"], Path] = False,
    data: Optional[DataModule] = None,
    train: TrainArgs = TrainArgs(
        save_interval=1000,
        log_interval=1,
        global_batch_size=16,
        micro_batch_size=1,
        lr_warmup_steps=100,
        epochs=5,
        max_seq_length=None,
    ),
    eval: EvalArgs = EvalArgs(interval=600, max_new_tokens=100, max_iters=100),
    optimizer: Union[str, dict] = "AdamW",
    logger_name: LoggerName = "csv",
    logger: LoggerArgs = LoggerArgs(),
    seed: int = 1337,
    profile: bool = False,
    compiler: str = "none",
    log: LogArgs = LogArgs(),
    access_token: Optional[str] = None,
) -> None:
    """Finetune all weights of a model.

    Args:
        checkpoint_dir: The base model: a folder with lit_model.pth, model_config.yaml and the tokenizer.
        out_dir: Where checkpoints (step-XXXXXX/, final/), logs, run_args.json and metrics.json go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or fp8-mixed (default: bf16-mixed on GPUs and on CPUs with
            native bf16, AVX512-BF16 or AMX; 32-true on other CPUs; printed at start).
        devices: Devices per node (an int, or "auto").
        num_nodes: Nodes of the run.
        fsdp: How runs on several devices shard the model (--fsdp.sharding_strategy, --fsdp.state_dict_type, ...).
        parallel: Parallelism beside FSDP's: --parallel.tensor N splits each layer over N neighbouring devices
            (tensor and sequence parallelism; FSDP shards over the rest of the world); --parallel.expert N splits
            each mixture-of-experts layer's experts over N data-parallel devices (expert parallelism);
            --parallel.context N splits every sequence's positions over N devices (context parallelism, Ulysses'
            head scatter around each attention); --parallel.pipeline N cuts the layers into stages over N devices
            (pipeline parallelism, schedule --parallel.pipeline_schedule).
        resume: Continue a run: "auto" (the newest checkpoint in out_dir), a step-XXXXXX folder, or false.
        data: The instruction data (default: Alpaca), formatted in the checkpoint's prompt style.
        train: Training schedule and batch sizes.
        eval: Validation settings.
        optimizer: An optimizer name (AdamW) or a mapping {class_path, init_args} (lr, weight_decay, betas).
        logger_name: The experiment tracker: csv, tensorboard, wandb (online unless WANDB_MODE says offline) or
            mlflow (to MLFLOW_TRACKING_URI, else out_dir/mlruns).
        logger: The tracker's run: --logger.project, --logger.name, --logger.entity, --logger.group,
            --logger.tags, as the tracker has them.
        seed: Seed of the data order.
        profile: Record a torch.profiler trace of a few steps into out_dir/profile/.
        compiler: none (eager; the default), auto or torch (as `litgpt pretrain`'s), or the name of a compiler
            extension registered under the `litgpt.compilers` entry points, which runs the job with its own Fabric
            strategy: thunder (extensions/thunder, `pip install -e '.[thunder]'`).
        log: LitGPT's logger settings (--log.project, ...), read so that its recipes work; no effect here.
        access_token: LitGPT's token for downloading checkpoint_dir; no effect here (`litgpt download` takes it).
    """
    from litgpt.finetune import finetune_job

    job = finetune_job(setup, dict(locals()), name="finetune_full")

    from litgpt.train.job import launch
    from litgpt.train.launch import run_fabric

    launch(run_fabric(job, devices=devices, num_nodes=num_nodes, fsdp=fsdp, parallel=parallel,
                      run_name=f"finetune-full-{job.recipe.config.name or 'model'}", compiler=compiler), job)

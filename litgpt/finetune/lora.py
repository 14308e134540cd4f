"""`litgpt finetune_lora` (also `litgpt finetune`): train LoRA adapters on a frozen, optionally quantized, base."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

from litgpt.args import EvalArgs, FSDPArgs, ParallelArgs, LoggerArgs, LogArgs, TrainArgs
from litgpt.data.base import DataModule
from litgpt.loggers import LoggerName


def setup(
    checkpoint_dir: Path,
    out_dir: Path = Path("out/finetune/lora"),
    precision: Optional[str] = None,
    quantize: Optional[Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8", "ao.nf4"]] = None,
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    fsdp: FSDPArgs = FSDPArgs(),
    parallel: ParallelArgs = ParallelArgs(),
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
    initial_adapter_dir: Optional[Path] = None,
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
    eval: EvalArgs = EvalArgs(interval=100, max_new_tokens=100, max_iters=100),
    optimizer: Union[str, dict] = "AdamW",
    logger_name: LoggerName = "csv",
    logger: LoggerArgs = LoggerArgs(),
    seed: int = 1337,
    profile: bool = False,
    compiler: str = "none",
    log: LogArgs = LogArgs(),
    access_token: Optional[str] = None,
) -> None:
    """Finetune a model with LoRA: only the low-rank adapters train; checkpoints hold the adapters alone.

    The final checkpoint (out_dir/final) also gets the merged weights, so `litgpt generate out_dir/final` works.

    Args:
        checkpoint_dir: The base model: a folder with lit_model.pth, model_config.yaml and the tokenizer.
        out_dir: Where checkpoints (step-XXXXXX/, final/), logs, run_args.json and metrics.json go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or fp8-mixed (default: bf16-mixed on GPUs and on CPUs with
            native bf16, AVX512-BF16 or AMX; 32-true on other CPUs; printed at start).
        quantize: QLoRA: store the frozen base weights of the blocks quantized: with bitsandbytes (bnb.nf4,
            bnb.nf4-dq, bnb.fp4, bnb.int8) or as torchao's NF4 (ao.nf4); needs `pip install 'litgpt[quantize]'`.
            On several devices FSDP shards the 4-bit base (all-gathered in 4 bits): ao.nf4, and bnb.nf4 / bnb.nf4-dq
            stored as ao.nf4 (the same 4-bit NormalFloat); bnb.fp4 and bnb.int8 run on one device only.
        devices: Devices per node (an int, or "auto").
        num_nodes: Nodes of the run.
        fsdp: How runs on several devices shard the model (--fsdp.sharding_strategy, --fsdp.state_dict_type, ...).
        parallel: Parallelism beside FSDP's: --parallel.tensor N splits each layer over N neighbouring devices
            (tensor and sequence parallelism; FSDP shards over the rest of the world); --parallel.expert N splits
            each mixture-of-experts layer's experts over N data-parallel devices (expert parallelism);
            --parallel.context N splits every sequence's positions over N devices (context parallelism, Ulysses'
            head scatter around each attention); --parallel.pipeline N cuts the layers into stages over N devices
            (pipeline parallelism, schedule --parallel.pipeline_schedule).
        lora_r: The adapters' rank.
        lora_alpha: The adapters' scale numerator (the update is scaled by alpha / r).
        lora_dropout: Dropout on the adapters' input.
        lora_query: Adapt the query projection.
        lora_key: Adapt the key projection.
        lora_value: Adapt the value projection.
        lora_projection: Adapt the attention output projection.
        lora_mlp: Adapt the MLP (every expert's in a mixture of experts).
        lora_head: Adapt the output head.
        resume: Continue a run: "auto" (the newest checkpoint in out_dir), a step-XXXXXX folder, or false.
        initial_adapter_dir: Start the adapters from an earlier adapter instead of a fresh initialization (a new run,
            the optimizer starts afresh): a PEFT adapter folder, one `convert_to_litgpt` imported, or a LoRA run's
            checkpoint (ours or LitGPT's). Its rank, alpha and targets replace the --lora_* options.
        data: The instruction data (default: Alpaca), formatted in the checkpoint's prompt style.
        train: Training schedule and batch sizes.
        eval: Validation settings.
        optimizer: An optimizer name (AdamW) or a mapping {class_path, init_args} (lr, weight_decay, betas).
        logger_name: The experiment tracker: csv, tensorboard, wandb (online unless WANDB_MODE says offline) or
            mlflow (to MLFLOW_TRACKING_URI, else out_dir/mlruns).
        logger: The tracker's run: --logger.project, --logger.name, --logger.entity, --logger.group,
            --logger.tags, as the tracker has them.
        seed: Seed of the adapters' initialization, the dropout and the data order.
        profile: Record a torch.profiler trace of a few steps into out_dir/profile/.
        compiler: none (eager; the default), auto or torch (as `litgpt pretrain`'s), or the name of a compiler
            extension registered under the `litgpt.compilers` entry points, which runs the job with its own Fabric
            strategy: thunder (extensions/thunder, `pip install -e '.[thunder]'`).
        log: LitGPT's logger settings (--log.project, ...), read so that its recipes work; no effect here.
        access_token: LitGPT's token for downloading checkpoint_dir; no effect here (`litgpt download` takes it).
    """
    from litgpt.finetune import finetune_job

    job = finetune_job(setup, dict(locals()), name="finetune_lora", lora=lora_settings(locals()), quantize=quantize,
                       initial_adapter_dir=initial_adapter_dir)

    from litgpt.distributed.fsdp import FSDPStrategy
    from litgpt.train.job import launch
    from litgpt.train.launch import run_fabric

    fabric = run_fabric(job, devices=devices, num_nodes=num_nodes, fsdp=fsdp, parallel=parallel,
                        run_name=f"finetune-lora-{job.recipe.config.name or 'model'}", compiler=compiler)
    if quantize is not None:
        job = quantization_for(job, fabric.strategy if isinstance(fabric.strategy, FSDPStrategy) else None)
    launch(fabric, job)


def lora_settings(arguments: dict):
    """The `LoRASettings` of a command's --lora_* arguments (finetune_lora's, and dpo's with --method lora)."""
    from litgpt.lora import LoRASettings

    return LoRASettings(
        r=arguments["lora_r"], alpha=arguments["lora_alpha"], dropout=arguments["lora_dropout"],
        query=arguments["lora_query"], key=arguments["lora_key"], value=arguments["lora_value"],
        projection=arguments["lora_projection"], mlp=arguments["lora_mlp"], head=arguments["lora_head"],
    )


def quantization_for(job, fsdp_strategy):
    """The job with the mode that stores its quantized base, checked against the strategy (an `FSDPStrategy` or
    None): under FSDP bitsandbytes' NF4 becomes torchao's NF4 (said once), other bitsandbytes modes are refused."""
    import dataclasses

    from litgpt.distributed.runtime import print_once
    from litgpt.errors import UserError
    from litgpt.quantize import (
        check_nf4_precision, check_nf4_shapes, check_quantize_mode, check_quantized_offload, storage_mode,
    )

    requested, sharded = job.recipe.quantize, fsdp_strategy is not None
    if job.precision.float8:
        raise UserError("--precision fp8-mixed multiplies the blocks' float linear layers in float8, and --quantize "
                        "stores them in 4 or 8 bits instead: use bf16-mixed with --quantize.")
    check_quantize_mode(requested, sharded)
    stored = storage_mode(requested, sharded)
    if stored == "ao.nf4":  # on the meta device: no memory, and before any process starts
        shard = fsdp_strategy.topology.fsdp_shard_size if sharded else 1
        check_nf4_shapes(job.recipe.build_model())
        check_nf4_precision(job.precision, sharded=shard > 1)
    if sharded:
        topology = fsdp_strategy.topology
        check_quantized_offload("--fsdp.cpu_offload", fsdp_strategy.fsdp.cpu_offload, topology.fsdp_shard_size,
                                topology.sharding_strategy)
    if stored != requested:
        print_once(
            f"--quantize {requested} on several devices: the base is stored as torchao's NF4 (ao.nf4, the same 4-bit "
            "NormalFloat), which FSDP2 shards and all-gathers in 4 bits; bitsandbytes' 4-bit weights cannot be sharded."
        )
    return dataclasses.replace(job, recipe=dataclasses.replace(job.recipe, quantize=stored))

"""`litgpt finetune_full`: finetune every weight of a checkpoint on instruction data."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

from litgpt.args import EvalArgs, FSDPArgs, TrainArgs
from litgpt.data.base import DataModule
from litgpt.loggers import LoggerName


def setup(
    checkpoint_dir: Path,
    out_dir: Path = Path("out/finetune/full"),
    precision: Optional[str] = None,
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    fsdp: FSDPArgs = FSDPArgs(),
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
    seed: int = 1337,
    profile: bool = False,
) -> None:
    """Finetune all weights of a model.

    Args:
        checkpoint_dir: The base model: a folder with lit_model.pth, model_config.yaml and the tokenizer.
        out_dir: Where checkpoints (step-XXXXXX/, final/), logs, run_args.json and metrics.json go.
        precision: 32-true, bf16-mixed, bf16-true or 16-mixed (default: bf16-mixed on GPUs, 32-true on CPU).
        devices: Devices per node (an int, or "auto").
        num_nodes: Nodes of the run.
        fsdp: How runs on several devices shard the model (--fsdp.sharding_strategy, --fsdp.state_dict_type, ...).
        resume: Continue a run: "auto" (the newest checkpoint in out_dir), a step-XXXXXX folder, or false.
        data: The instruction data (default: Alpaca), formatted in the checkpoint's prompt style.
        train: Training schedule and batch sizes.
        eval: Validation settings.
        optimizer: An optimizer name (AdamW) or a mapping {class_path, init_args} (lr, weight_decay, betas).
        logger_name: csv, tensorboard or wandb (offline).
        seed: Seed of the data order.
        profile: Record a torch.profiler trace of a few steps into out_dir/profile/.
    """
    from litgpt.checkpoint import find_checkpoint_dir
    from litgpt.config import Config
    from litgpt.launch import check_limits, load_logger, record_arguments
    from litgpt.parallel import build_fabric
    from litgpt.precision import default_precision

    hyperparameters = record_arguments(setup, locals())
    check_limits(train)
    checkpoint_dir = find_checkpoint_dir(Path(checkpoint_dir))
    config = Config.from_checkpoint(checkpoint_dir)
    if data is None:
        from litgpt.data import Alpaca

        data = Alpaca()
    logger = load_logger(logger_name, Path(out_dir), run_name=f"finetune-full-{config.name or 'model'}")
    fabric = build_fabric(devices, num_nodes, precision, loggers=[logger], fsdp=fsdp)
    fabric.launch(
        main, config, checkpoint_dir, Path(out_dir), resume, data, train, eval, optimizer, seed, profile,
        hyperparameters, precision or default_precision(),
    )


def main(fabric, config, checkpoint_dir, out_dir, resume, data, train, eval, optimizer, seed, profile,
         hyperparameters, precision) -> None:
    from litgpt.checkpoint import WEIGHTS_FILE, meta_device
    from litgpt.launch import train_model
    from litgpt.model import GPT

    def build_model():
        with meta_device():
            return GPT(config)

    train_model(
        fabric, config=config, out_dir=out_dir, resume=resume, data=data, train=train, eval=eval,
        optimizer_spec=optimizer, tokenizer_dir=checkpoint_dir, seed=seed, profile=profile,
        hyperparameters=hyperparameters, precision=precision, build_model=build_model,
        initialize=lambda model: None,  # every weight comes from the checkpoint
        initial_weights=checkpoint_dir / WEIGHTS_FILE, weights_file=WEIGHTS_FILE,
    )

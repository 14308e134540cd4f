"""`litgpt finetune_lora` (also `litgpt finetune`): train LoRA adapters on a frozen, optionally quantized, base."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

from litgpt.args import EvalArgs, FSDPArgs, TrainArgs
from litgpt.data.base import DataModule
from litgpt.errors import UserError
from litgpt.loggers import LoggerName


def setup(
    checkpoint_dir: Path,
    out_dir: Path = Path("out/finetune/lora"),
    precision: Optional[str] = None,
    quantize: Optional[Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8"]] = None,
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
        lr_warmup_steps=100,
        epochs=5,
        max_seq_length=None,
    ),
    eval: EvalArgs = EvalArgs(interval=100, max_new_tokens=100, max_iters=100),
    optimizer: Union[str, dict] = "AdamW",
    logger_name: LoggerName = "csv",
    seed: int = 1337,
    profile: bool = False,
) -> None:
    """Finetune a model with LoRA: only the low-rank adapters train; checkpoints hold the adapters alone.

    The final checkpoint (out_dir/final) also gets the merged weights, so `litgpt generate out_dir/final` works.

    Args:
        checkpoint_dir: The base model: a folder with lit_model.pth, model_config.yaml and the tokenizer.
        out_dir: Where checkpoints (step-XXXXXX/, final/), logs, run_args.json and metrics.json go.
        precision: 32-true, bf16-mixed, bf16-true or 16-mixed (default: bf16-mixed on GPUs, 32-true on CPU).
        quantize: QLoRA: store the frozen base weights quantized with bitsandbytes (bnb.nf4, bnb.nf4-dq, bnb.fp4,
            bnb.int8; needs `pip install 'litgpt[quantize]'`).
        devices: Devices per node (an int, or "auto").
        num_nodes: Nodes of the run.
        fsdp: How runs on several devices shard the model (--fsdp.sharding_strategy, --fsdp.state_dict_type, ...).
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
        data: The instruction data (default: Alpaca), formatted in the checkpoint's prompt style.
        train: Training schedule and batch sizes.
        eval: Validation settings.
        optimizer: An optimizer name (AdamW) or a mapping {class_path, init_args} (lr, weight_decay, betas).
        logger_name: csv, tensorboard or wandb (offline).
        seed: Seed of the adapters' initialization, the dropout and the data order.
        profile: Record a torch.profiler trace of a few steps into out_dir/profile/.
    """
    from litgpt.checkpoint import find_checkpoint_dir
    from litgpt.config import Config
    from litgpt.launch import check_limits, load_logger, record_arguments
    from litgpt.lora import LoRASettings
    from litgpt.parallel import FSDPStrategy, build_fabric
    from litgpt.precision import default_precision

    hyperparameters = record_arguments(setup, locals())
    check_limits(train)
    settings = LoRASettings(
        r=lora_r, alpha=lora_alpha, dropout=lora_dropout, query=lora_query, key=lora_key, value=lora_value,
        projection=lora_projection, mlp=lora_mlp, head=lora_head,
    )
    if quantize is not None:
        from litgpt.quantize import check_quantize_mode

        check_quantize_mode(quantize)
    checkpoint_dir = find_checkpoint_dir(Path(checkpoint_dir))
    config = Config.from_checkpoint(checkpoint_dir)
    if data is None:
        from litgpt.data import Alpaca

        data = Alpaca()
    logger = load_logger(logger_name, Path(out_dir), run_name=f"finetune-lora-{config.name or 'model'}")
    fabric = build_fabric(devices, num_nodes, precision, loggers=[logger], fsdp=fsdp)
    if quantize is not None and isinstance(fabric.strategy, FSDPStrategy):
        raise UserError(
            "--quantize (QLoRA) runs on one device: bitsandbytes' quantized weights cannot be sharded. Use --devices 1, "
            "or leave out --quantize and let FSDP shard the model over the devices."
        )
    fabric.launch(
        main, config, checkpoint_dir, Path(out_dir), settings, quantize, resume, data, train, eval, optimizer,
        seed, profile, hyperparameters, precision or default_precision(),
    )


def main(fabric, config, checkpoint_dir, out_dir, settings, quantize, resume, data, train, eval, optimizer, seed,
         profile, hyperparameters, precision) -> None:
    from litgpt.checkpoint import WEIGHTS_FILE, meta_device
    from litgpt.launch import train_model
    from litgpt.lora import add_lora, init_lora_weights, is_lora_key, mark_only_lora_as_trainable
    from litgpt.merge_lora import LORA_WEIGHTS_FILE, merge_lora
    from litgpt.model import GPT
    from litgpt.prompts import PromptStyle

    def build_model():
        with meta_device():
            model = GPT(config)
        add_lora(model, settings)
        mark_only_lora_as_trainable(model)
        return model

    def quantize_base(model):
        from litgpt.quantize import quantize_frozen_base

        quantize_frozen_base(model, quantize, fabric.device)

    train_model(
        fabric, config=config, out_dir=out_dir, resume=resume, data=data, train=train, eval=eval,
        optimizer_spec=optimizer, tokenizer_dir=checkpoint_dir, seed=seed, profile=profile,
        hyperparameters=hyperparameters, precision=precision, build_model=build_model,
        initialize=init_lora_weights,  # the adapters; seeded by train_model
        initial_weights=checkpoint_dir / WEIGHTS_FILE, initial_keys=lambda key: not is_lora_key(key),
        checkpoint_keys=is_lora_key, weights_file=LORA_WEIGHTS_FILE,
        after_load=quantize_base if quantize is not None else None,
        prompt_style=PromptStyle.from_config(config),
    )
    if fabric.global_rank == 0:
        merge_lora(out_dir / "final")
    fabric.barrier()

"""What every training entry point does around its model: arguments on record, devices, data, optimizer, resume.

The entry points (pretrain, finetune_full, finetune_lora) differ only in how they build and load the model and in
what a checkpoint stores; everything else comes from here, so the three cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch

from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.errors import UserError


# ---- arguments on record ---------------------------------------------------------------------------------------------
def plain(value: Any) -> Any:
    """Arguments as YAML/JSON-friendly values; data modules as {class_path, init_args} like jsonargparse reads."""
    if isinstance(value, Config):
        return dataclasses.asdict(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        if isinstance(value, (TrainArgs, EvalArgs)):
            return fields
        return {"class_path": f"{type(value).__module__}.{type(value).__qualname__}", "init_args": fields}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def record_arguments(function: Callable, arguments: dict) -> dict:
    """The entry point's arguments in signature order, as plain values (written to hyperparameters.yaml)."""
    names = inspect.signature(function).parameters
    return {name: plain(arguments[name]) for name in names if name in arguments}


def write_run_args(out_dir: Path, hyperparameters: dict) -> None:
    from litgpt.checkpoint import atomic_write_text

    record = {"command": [Path(sys.argv[0]).name, *sys.argv[1:]], "arguments": hyperparameters}
    atomic_write_text(Path(out_dir) / "run_args.json", json.dumps(record, indent=2, default=str) + "\n")


# ---- checks before anything heavy --------------------------------------------------------------------------------------
def check_seq_length(train: TrainArgs, config: Config) -> int:
    length = train.max_seq_length or config.block_size
    if length > config.block_size:
        raise UserError(
            f"--train.max_seq_length {length} is longer than the model's block size {config.block_size}: "
            f"use at most {config.block_size}."
        )
    if length < 1:
        raise UserError(f"--train.max_seq_length must be at least 1, got {length}.")
    return length


def check_limits(train: TrainArgs) -> None:
    for name in ("max_steps", "max_tokens", "epochs", "save_interval", "keep_last"):
        value = getattr(train, name)
        if value is not None and value < 1:
            raise UserError(f"--train.{name} must be at least 1, got {value}.")
    if train.log_interval < 1:
        raise UserError(f"--train.log_interval must be at least 1, got {train.log_interval}.")


def check_requeue(train: TrainArgs) -> None:
    from litgpt.checkpoint import say_rank_zero
    from litgpt.preemption import slurm_job_id

    if train.requeue and slurm_job_id() is None:
        say_rank_zero("Note: --train.requeue acts only in a Slurm job; here a stop signal saves and stops the run.")


def check_disk_space(out_dir: Path, model: torch.nn.Module, select: Callable[[str], bool], train: TrainArgs) -> None:
    """Before any weight is allocated: is there room for one checkpoint? Warn when all of them would not fit."""
    from litgpt.checkpoint import check_free_space, format_bytes, free_bytes, say_rank_zero
    from litgpt.training import checkpoint_bytes

    size = checkpoint_bytes(model, select)
    check_free_space(out_dir, size, "one checkpoint of this model")
    if train.keep_last is None and train.save_interval is not None and train.max_steps is not None:
        count = train.max_steps // train.save_interval + 1
        if size * count > free_bytes(out_dir):
            say_rank_zero(
                f"Warning: {count} checkpoints of {format_bytes(size)} will not fit in the "
                f"{format_bytes(free_bytes(out_dir))} free: pass --train.keep_last N to keep only the newest."
            )


# ---- data ----------------------------------------------------------------------------------------------------------------
def prepare_data(fabric, data, tokenizer, max_seq_length: int, prompt_style=None):
    """Tokenize once (rank 0 first, the others then find the cache) and return (train, val) datasets."""
    data.connect(tokenizer, max_seq_length, prompt_style)
    with fabric.rank_zero_first():
        data.prepare()
    return data.train_dataset(), data.val_dataset()


# ---- optimizer -----------------------------------------------------------------------------------------------------------
def build_optimizer(spec: Union[str, dict], parameters: Iterable[torch.nn.Parameter], device: torch.device):
    """An optimizer from a name ("AdamW") or {"class_path": ..., "init_args": {...}}; fused AdamW where supported."""
    if isinstance(spec, str):
        class_path, init_args = spec, {}
    elif isinstance(spec, dict):
        # No class_path: `--optimizer.lr 1e-4` alone changes the default optimizer, AdamW.
        class_path, init_args = spec.get("class_path", "AdamW"), dict(spec.get("init_args") or {})
        # `--optimizer.init_args.lr 0.01` on the command line reaches us flattened, as {"lr": "0.01"}.
        flat = {key: value for key, value in spec.items() if key not in ("class_path", "init_args")}
        init_args.update({key: flag_value(value) for key, value in flat.items()})
    else:
        raise UserError(f"--optimizer must be a name such as AdamW or a class_path/init_args mapping, got {spec!r}.")
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name or "torch.optim"), class_name)
    except (ImportError, AttributeError):
        raise UserError(f"--optimizer {class_path!r} is not an optimizer class (e.g. AdamW, torch.optim.SGD).") from None
    if cls in (torch.optim.AdamW, torch.optim.Adam) and "fused" not in init_args and device.type in ("cuda", "cpu"):
        init_args["fused"] = True
    try:
        return cls([p for p in parameters if p.requires_grad], **init_args)
    except TypeError as error:
        raise UserError(f"--optimizer {class_path}: {error}") from None


def flag_value(text):
    """A command-line value as YAML reads it (`0.9`, `[0.9, 0.95]`, `true`), with `1e-3`-style floats too."""
    import yaml

    if not isinstance(text, str):
        return text
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def base_learning_rate(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


# ---- resume ---------------------------------------------------------------------------------------------------------------
def restore_checkpoint(
    folder: Path, model, optimizer, state, select: Callable[[str], bool], weights_file: str, shard_io=None
) -> None:
    """Load a checkpoint folder's weights, optimizer state, loop position and RNG into the run.

    A sharded checkpoint reshards to this run's world size; a full one is read memory-mapped, each rank taking its part.
    `shard_io` stands in for litgpt.checkpoint's loading functions (a strategy's `shard_io`, see `train_model`).
    """
    import litgpt.checkpoint
    from litgpt.checkpoint import SHARDED_DIR, TRAINING_STATE_FILE, load_state_dict
    from litgpt.training import unwrap, unwrap_optimizer

    io = shard_io or litgpt.checkpoint
    model, optimizer = unwrap(model), unwrap_optimizer(optimizer)
    folder = Path(folder)
    saved = load_state_dict(folder / TRAINING_STATE_FILE)
    if (folder / SHARDED_DIR).is_dir():
        io.load_sharded(folder, model, optimizer, select)
    else:
        path = folder / weights_file
        io.copy_weights(model, load_state_dict(path), str(path), select)
        try:
            io.load_optimizer_state(model, optimizer, saved["optimizer"])
        except Exception as error:  # a foreign file or another model's optimizer
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UserError(f"Cannot resume the optimizer from {str(folder / TRAINING_STATE_FILE)!r}: {reason}") from None
    for key, value in saved["train_state"].items():
        setattr(state, key, value)
    torch.set_rng_state(saved["rng"])


def load_logger(logger_name: str, out_dir: Path, run_name: str):
    from litgpt.loggers import build_logger

    return build_logger(logger_name, out_dir, run_name)


def default_tokenizer_dir(tokenizer_dir: Optional[Path], data, checkpoint_dir: Optional[Path]) -> Path:
    if tokenizer_dir is not None:
        return Path(tokenizer_dir)
    if checkpoint_dir is not None:
        return Path(checkpoint_dir)
    bundled = getattr(data, "tokenizer_dir", None)
    if bundled is not None:
        return Path(bundled)
    raise UserError("Pretraining needs a tokenizer: pass --tokenizer_dir (a folder with tokenizer.json).")


# ---- the common path of every entry point --------------------------------------------------------------------------------
def every_key(key: str) -> bool:
    return True


def train_model(
    fabric,
    *,
    config: Config,
    out_dir: Path,
    resume,
    data,
    train: TrainArgs,
    eval: EvalArgs,
    optimizer_spec,
    tokenizer_dir: Path,
    seed: int,
    profile: bool,
    hyperparameters: dict,
    precision: str,
    build_model: Callable[[], torch.nn.Module],
    initialize: Callable[[torch.nn.Module], None],
    weights_file: str,
    initial_weights: Optional[Path] = None,
    initial_keys: Callable[[str], bool] = every_key,
    checkpoint_keys: Callable[[str], bool] = every_key,
    after_load: Optional[Callable[[torch.nn.Module], None]] = None,
    prompt_style=None,
    compile_blocks: bool = False,
) -> dict:
    """Check the inputs, prepare the data, build, shard and load the model, and train it.

    `build_model()` returns the model on the meta device with requires_grad set on the parameters to train.
    `initialize(model)` draws its random weights; then the `initial_keys` of the `initial_weights` file are loaded
    over them. Checkpoints store the `checkpoint_keys` (`weights_file`); resuming loads them back. `after_load` runs
    on the loaded model before training (e.g. quantization). `compile_blocks` compiles each transformer block with
    torch.compile (`--compiler torch`).
    """
    from litgpt.checkpoint import assign_weights, check_writable, copy_weights, load_state_dict, resolve_resume
    from litgpt.data.base import MicroBatches
    from litgpt.parallel import FSDPStrategy, apply_activation_checkpointing, prepare_model
    from litgpt.tokenizer import Tokenizer, check_vocab_fits
    from litgpt.training import Run, TrainState, fit

    check_writable(out_dir)
    resume_dir = resolve_resume(out_dir, resume)
    check_requeue(train)
    max_seq_length = check_seq_length(train, config)
    tokenizer = Tokenizer(tokenizer_dir)
    check_vocab_fits(tokenizer, config, tokenizer_dir)
    train.gradient_accumulation_iters(fabric.world_size)  # fail early on impossible batch arithmetic
    fabric.seed_everything(seed)
    train_data, val_data = prepare_data(fabric, data, tokenizer, max_seq_length, prompt_style)
    style_used = getattr(data, "style", None)  # finetuning data records the prompt style it laid samples out in
    if style_used is not None and style_used.name != config.prompt_style:
        # Checkpoints then name the style the model was tuned on, which `litgpt chat` will use.
        config = dataclasses.replace(config, prompt_style=style_used.name)

    model = build_model()
    check_disk_space(out_dir, model, checkpoint_keys, train)
    if after_load is None:
        model = prepare_model(fabric, model, precision, initialize, train.activation_checkpointing, compile_blocks)
        # A resumed checkpoint that holds every weight makes the initial ones unnecessary.
        if initial_weights is not None and (resume_dir is None or checkpoint_keys is not every_key):
            copy_weights(model, load_state_dict(initial_weights), str(initial_weights), initial_keys)
    else:
        # QLoRA (one device): the frozen base goes from the memory-mapped file straight into quantized layers, so
        # the model is never whole in memory at its stored precision.
        assign_weights(model, load_state_dict(initial_weights), str(initial_weights), initial_keys)
        with torch.no_grad():
            initialize(model)
        after_load(model)
        if precision in ("32-true", "bf16-mixed"):  # float32 master copies of what stays unquantized
            for param in model.parameters():
                if param.dtype in (torch.float16, torch.bfloat16):
                    param.data = param.data.float()
        if train.activation_checkpointing:
            apply_activation_checkpointing(model)
    model = fabric.setup(model)
    # A strategy that shards the model its own way (extensions/thunder) supplies, once it has set the model up, the
    # parameters to optimize and the functions that write and read its checkpoints in litgpt's formats.
    shard_io = getattr(fabric.strategy, "shard_io", None)
    parameters = model.parameters() if shard_io is None else shard_io.parameters()
    optimizer = fabric.setup_optimizers(build_optimizer(optimizer_spec, parameters, fabric.device))
    base_lr = base_learning_rate(optimizer)  # before a restore overwrites it with the last scheduled value
    state = TrainState()
    if resume_dir is not None:
        restore_checkpoint(resume_dir, model, optimizer, state, checkpoint_keys, weights_file, shard_io)
    if fabric.global_rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_run_args(out_dir, hyperparameters)
    strategy = fabric.strategy
    if shard_io is not None:
        sharding, state_dict_type, options = shard_io.sharding_strategy, shard_io.state_dict_type, shard_io.options
    elif isinstance(strategy, FSDPStrategy):
        sharding, state_dict_type = strategy.topology.sharding_strategy, strategy.fsdp.state_dict_type
        options = dataclasses.asdict(strategy.fsdp)
    else:
        sharding, state_dict_type, options = "none", "full", None
    resumed_here = resume_dir is not None and resume_dir.resolve().parent == Path(out_dir).resolve()
    run = Run(
        fabric=fabric,
        model=model,
        optimizer=optimizer,
        config=config,
        tokenizer=tokenizer,
        train_data=MicroBatches(train_data, train.micro_batch_size, seed, fabric.global_rank, fabric.world_size),
        val_data=val_data,
        train=train,
        eval=eval,
        out_dir=Path(out_dir),
        hyperparameters=hyperparameters,
        base_lr=base_lr,
        checkpoint_keys=checkpoint_keys,
        weights_file=weights_file,
        tokenizer_dir=tokenizer_dir,
        state=state,
        profile=profile,
        precision=precision,
        sharding=sharding,
        state_dict_type=state_dict_type,
        fsdp=options,
        shard_io=shard_io,
        # A checkpoint of this run that it resumes from needs no second save at the same step.
        last_saved_step=state.step if resumed_here else -1,
    )
    return fit(run)

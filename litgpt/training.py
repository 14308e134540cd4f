"""The training loop every entry point shares: accumulation, clipping, schedule, validation, logging, checkpoints.

An entry point builds a `Run` (model, optimizer, data, arguments, what a checkpoint stores) and calls `fit`. The loop
owns nothing else, so pretraining, full finetuning and LoRA differ only in how they build the Run.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import resource
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data.base import IGNORE_INDEX, MicroBatches, SampleDataset
from litgpt.errors import UserError
from litgpt.failpoints import failpoint
from litgpt.preemption import StepControl, StopSignals


@dataclass
class TrainState:
    """Where the run is; saved with every checkpoint so a resumed run continues exactly."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    epoch_samples: int = 0  # samples of the current epoch consumed, all ranks together (any world size resumes)
    tokens: int = 0  # tokens trained on, all ranks together
    train_seconds: float = 0.0  # time spent in steps, over every session of the run
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient (--train.on_nonfinite skip)


@dataclass
class Run:
    fabric: Any
    model: torch.nn.Module  # set up by Fabric
    optimizer: torch.optim.Optimizer  # set up by Fabric
    config: Config
    tokenizer: Any
    train_data: MicroBatches
    val_data: SampleDataset
    train: TrainArgs
    eval: EvalArgs
    out_dir: Path
    hyperparameters: dict
    base_lr: float
    # Which weights a checkpoint stores: every key, or only the LoRA adapters'.
    checkpoint_keys: Callable[[str], bool]
    weights_file: str = "lit_model.pth"
    tokenizer_dir: Optional[Path] = None  # its files are copied into every checkpoint
    state: TrainState = field(default_factory=TrainState)
    profile: bool = False
    precision: str = "32-true"
    sharding: str = "none"  # the FSDP sharding strategy, "none" on one device
    state_dict_type: str = "full"  # full: one file written by rank 0; sharded: every rank writes its shards
    fsdp: Optional[dict] = None  # the FSDP options, for metrics.json
    # For a model its strategy shards outside FSDP2 (extensions/thunder): an object with the functions of
    # litgpt.checkpoint that read and write shards (gather_weights, gather_optimizer_state, save_sharded,
    # copy_weights, load_optimizer_state, load_sharded; same arguments), used in their place.
    shard_io: Optional[Any] = None
    last_saved_step: int = -1


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT inside Fabric's wrapper."""
    return getattr(model, "module", model)


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Fabric's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_lr` at `total_steps`."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions that have a label (0, not NaN, when none has: a fully masked batch)."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def validation_batches(run: Run) -> MicroBatches:
    """The validation set in a fixed order, in micro-batches no larger than it allows."""
    world = run.fabric.world_size
    if len(run.val_data) < world:
        raise UserError(
            f"The validation set has {len(run.val_data)} samples, fewer than the {world} devices: add validation data."
        )
    size = min(run.train.micro_batch_size, len(run.val_data) // world)
    return MicroBatches(run.val_data, size, seed=0, rank=run.fabric.global_rank, world_size=world, shuffle=False)


@torch.no_grad()
def validate(run: Run) -> float:
    model = run.model
    model.eval()
    batches = validation_batches(run)
    losses = []
    iters = min(run.eval.max_iters, batches.per_epoch)
    for _, _, batch in itertools.islice(batches.iterate(), iters):
        logits = model(run.fabric.to_device(batch["input_ids"]))
        losses.append(loss_fn(logits, run.fabric.to_device(batch["labels"])))
    loss = torch.stack(losses).mean()
    loss = run.fabric.all_reduce(loss, reduce_op="mean")
    model.train()
    return loss.item()


def sample_text(run: Run) -> str:
    """A short greedy continuation of the start of a validation sample, to watch the model learn."""
    from litgpt.generate import generate

    model = unwrap(run.model)
    # A strategy whose set-up module cannot decode (extensions/thunder: compiled, maybe sharded) supplies an eager
    # model with the current weights; called on every rank, as it may gather them.
    sampling_model = getattr(run.fabric.strategy, "sampling_model", None)
    if sampling_model is not None:
        model = sampling_model(model)
    prompt = run.val_data[0]["input_ids"][:16]
    model.eval()
    tokens = list(generate(model, prompt, run.eval.max_new_tokens, temperature=0.0, stop_ids=run.tokenizer.stop_ids))
    model.clear_kv_cache()
    model.train()
    return run.tokenizer.decode(prompt.tolist() + tokens, skip_special_tokens=True)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def flops_per_token(config: Config, seq_length: int, trainable_fraction: float = 1.0) -> float:
    """Training FLOPs per token as PaLM counts them: 6N (forward + backward) plus the attention scores term.

    With frozen weights (LoRA) the weight-gradient third of the backward is skipped for them.
    """
    n = sum(p.numel() for name, p in _parameter_shapes(config) if "wte" not in name)
    matmul = 2 * n * (2 + trainable_fraction)
    attention = 12 * config.n_layer * config.n_head * config.head_size * seq_length
    return matmul + attention


def _parameter_shapes(config: Config):
    from litgpt.checkpoint import meta_device
    from litgpt.model import GPT

    with meta_device():
        return list(GPT(config).named_parameters())


def fit(run: Run) -> dict:
    """Train until the step limit, validating, logging and checkpointing on the way; returns the run's metrics."""
    fabric, model, optimizer, state = run.fabric, run.model, run.optimizer, run.state
    train, world = run.train, fabric.world_size
    accumulation = train.gradient_accumulation_iters(world)
    if run.train_data.per_epoch < accumulation:
        raise UserError(
            f"The training set has {len(run.train_data.dataset)} samples, fewer than one global batch "
            f"({train.global_batch_size}): add data or lower --train.global_batch_size."
        )
    validation_batches(run)  # fail before training, not after it, when the validation set is unusable
    seq_length = run.train_data.dataset[0]["input_ids"].numel()
    total_steps = train.total_steps(run.train_data.per_epoch / accumulation, seq_length)
    samples_per_micro_step = train.micro_batch_size * world
    if state.epoch_samples % samples_per_micro_step:
        fabric.print(
            f"Warning: the checkpoint stopped {state.epoch_samples} samples into epoch {state.epoch}, which this "
            f"world size cannot split evenly; continuing from sample {state.epoch_samples // samples_per_micro_step * samples_per_micro_step}."
        )
    batches = run.train_data.iterate(state.epoch, state.epoch_samples // samples_per_micro_step)
    per_epoch = run.train_data.per_epoch
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_fraction = sum(p.numel() for p in trainable) / sum(p.numel() for p in model.parameters())

    fabric.print(
        f"Training {total_steps} steps from step {state.step}: global batch {train.global_batch_size} = "
        f"{world} device(s) x micro batch {train.micro_batch_size} x {accumulation} accumulation, "
        f"{sum(p.numel() for p in trainable):,} trainable parameters."
    )
    if run.eval.initial_validation and state.step == 0:
        fabric.print(f"step 0 | val loss {validate(run):.4f}")

    fit_start = time.perf_counter()
    profiler = start_profiler(run) if run.profile else None
    progress = progress_bar(fabric, total_steps, state.step)

    def say(text: str) -> None:
        if fabric.global_rank == 0:
            progress.write(text, file=sys.stdout)

    val_loss = None
    stopped_by = None
    control = StepControl((run.fsdp or {}).get("timeout"))
    window_loss = torch.zeros((), device=fabric.device)
    window_label_tokens = torch.zeros((), device=fabric.device, dtype=torch.long)
    window_steps, window_seconds, window_tokens = 0, 0.0, state.tokens  # seconds in steps, not in eval/saving
    window_updates = 0  # steps of the window not skipped for a non-finite value
    with StopSignals() as signals:
        while state.step < total_steps:
            step_start = time.perf_counter()
            lr = lr_at(state.step, run.base_lr, train.lr_warmup_steps, total_steps, train.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = torch.zeros((), device=fabric.device)
            for micro in range(accumulation):
                epoch, index, batch = next(batches)
                input_ids = fabric.to_device(batch["input_ids"])
                labels = fabric.to_device(batch["labels"])
                with fabric.no_backward_sync(model, enabled=micro < accumulation - 1):
                    loss = loss_fn(model(input_ids), labels)
                    fabric.backward(loss / accumulation)
                step_loss += loss.detach() / accumulation
                window_label_tokens += (labels != IGNORE_INDEX).sum()
                state.epoch, state.epoch_samples = (
                    (epoch + 1, 0) if index + 1 == per_epoch else (epoch, (index + 1) * samples_per_micro_step)
                )
                state.tokens += input_ids.numel() * world
            failpoint("step:backward")
            loss_value, grad_norm = step_values(run, step_loss)  # the loop's one host-device sync per step
            nonfinite, stop_signal = control.agree(not (math.isfinite(loss_value) and math.isfinite(grad_norm)),
                                                   signals.received)
            if nonfinite and train.on_nonfinite == "stop":
                raise UserError(nonfinite_message(run, grad_norm))
            if nonfinite:
                state.skipped_steps += 1
                say(f"step {state.step + 1}: skipped the update: the loss ({loss_value}) or the gradient norm "
                    f"({grad_norm}) is not finite on some rank.")
            else:
                optimizer.step()
                window_loss += step_loss
                window_updates += 1
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            window_steps += 1
            step_seconds = time.perf_counter() - step_start
            state.train_seconds += step_seconds
            window_seconds += step_seconds
            if profiler is not None:
                profiler.step()
            progress.update(1)
            failpoint("step:end")

            if state.step % train.log_interval == 0 or state.step == total_steps:
                loss_value = (fabric.all_reduce(window_loss, reduce_op="mean") / window_updates).item() \
                    if window_updates else float("nan")  # every step of the window skipped: its losses were not finite
                tokens_per_second = (state.tokens - window_tokens) / window_seconds
                metrics = {
                    "loss": loss_value, "lr": lr, "tokens": state.tokens, "epoch": state.epoch,
                    "tokens_per_sec": tokens_per_second, "peak_memory_mb": peak_memory_bytes(fabric.device) / 2**20,
                }
                fabric.log_dict(metrics, step=state.step)
                progress.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
                say(
                    f"step {state.step}/{total_steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                    f"{tokens_per_second:,.0f} tokens/s | peak mem {metrics['peak_memory_mb']:,.0f} MB"
                )
                if window_label_tokens.item() == 0:
                    say(
                        f"Warning: no token of the last {window_steps} step(s) had a label, so nothing was learned: "
                        "the prompts fill --train.max_seq_length. Raise it or shorten the prompts."
                    )
                window_loss.zero_()
                window_label_tokens.zero_()
                window_steps, window_seconds, window_tokens, window_updates = 0, 0.0, state.tokens, 0

            if stop_signal:
                stopped_by = signal_name(stop_signal)
                break
            last = state.step == total_steps
            if (state.step % run.eval.interval == 0 and not last) or (last and run.eval.final_validation):
                val_loss = validate(run)
                fabric.log_dict({"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}, step=state.step)
                say(f"step {state.step} | val loss {val_loss:.4f}")
                if run.eval.max_new_tokens:
                    sample = sample_text(run)  # on every rank: a sharded model's forward is collective
                    say(f"sample: {sample!r}")
            if train.save_interval is not None and state.step % train.save_interval == 0 and not last:
                save_checkpoint(run, f"step-{state.step:06d}")
    progress.close()
    if profiler is not None:
        stop_profiler(run, profiler)
    if run.last_saved_step != state.step:
        save_checkpoint(run, f"step-{state.step:06d}")
    if stopped_by is not None:
        return stop_for_signal(run, stopped_by)
    publish_final(run, run.out_dir / f"step-{state.step:06d}")
    metrics = run_metrics(run, val_loss, seq_length, trainable_fraction)
    metrics["wall_seconds"] = round(time.perf_counter() - fit_start, 3)  # this session, with validation and saving
    fabric.log_dict({f"run/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=state.step)
    for logger in fabric.loggers:
        logger.finalize("success")  # flush what the logger buffers
    if fabric.global_rank == 0:
        write_json(run.out_dir / "metrics.json", metrics)
        fabric.print(f"Saved the final checkpoint to {run.out_dir / 'final'}")
        fabric.print(f"Try it: litgpt generate {run.out_dir / 'final'} --prompt \"Once upon a time\"")
    return metrics


def step_values(run: Run, step_loss: torch.Tensor) -> tuple[float, float]:
    """This rank's loss of the step and the gradient norm over all ranks (clipped after, with --train.max_norm)."""
    from torch.distributed.tensor import DTensor

    if run.train.max_norm is not None:
        norm = run.fabric.clip_gradients(
            run.model, run.optimizer, max_norm=run.train.max_norm, error_if_nonfinite=False
        )
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in run.model.parameters() if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if run.precision == "16-mixed":
        norm = torch.zeros_like(norm)  # the grad scaler skips overflowing steps and lowers its scale by itself
    return tuple(torch.stack([step_loss.float(), norm.float().to(step_loss.device)]).tolist())


def nonfinite_message(run: Run, grad_norm: float) -> str:
    """The same text on every rank (the gradient norm is global), so a run of many ranks prints it once."""
    from litgpt.checkpoint import step_checkpoints

    saved = step_checkpoints(run.out_dir)
    kept = f"the newest checkpoint, {saved[-1]}, is as it was" if saved else "no checkpoint had been saved yet"
    return (
        f"Step {run.state.step + 1}: the loss or the gradient norm (here {grad_norm}) is not finite (NaN or inf); "
        f"training stopped before this update ({kept}). Lower the learning rate, clip with --train.max_norm 1.0, "
        "or pass --train.on_nonfinite skip to skip such steps and go on."
    )


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def stop_for_signal(run: Run, name: str) -> dict:
    """After the checkpoint a stop signal asked for: say where it is and, with --train.requeue under Slurm, requeue."""
    from litgpt.preemption import requeue_slurm_job

    folder = run.out_dir / f"step-{run.state.step:06d}"
    for logger in run.fabric.loggers:
        logger.finalize("success")
    if run.fabric.global_rank == 0:
        then = requeue_slurm_job() if run.train.requeue else "continue it with the same command and --resume auto"
        print(f"Stopped by {name} after step {run.state.step}: saved {folder}; {then}.", flush=True)
    return {"stopped_by": name, "steps": run.state.step, "checkpoint": str(folder)}


def run_metrics(run: Run, val_loss: Optional[float], seq_length: int, trainable_fraction: float) -> dict:
    fabric, state = run.fabric, run.state
    tokens_per_sec = state.tokens / state.train_seconds if state.train_seconds else 0.0
    flops = flops_per_token(run.config, seq_length, trainable_fraction) * tokens_per_sec
    device = fabric.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    if device_name in GPU_PEAK_FLOPS:
        peak, source = GPU_PEAK_FLOPS[device_name], "datasheet, dense bf16"
    else:
        dtype = torch.float32 if run.precision.startswith("32") else torch.bfloat16
        peak, side = measured_matmul_flops(device, dtype)
        source = f"measured: {side}^3 {dtype} matmul on this device"
    return {
        "steps": state.step,
        "tokens": state.tokens,
        "train_seconds": round(state.train_seconds, 3),
        "tokens_per_sec": round(tokens_per_sec, 1),
        "samples_per_sec": round(tokens_per_sec / seq_length, 3),
        "model_flops_per_sec": flops,
        "mfu": flops / (peak * fabric.world_size),
        "peak_flops_per_device": peak,
        "peak_flops_source": source,
        "val_loss": val_loss,
        "skipped_steps": state.skipped_steps,
        "world_size": fabric.world_size,
        "num_nodes": getattr(fabric.strategy, "num_nodes", 1),
        "cluster_environment": type(getattr(fabric.strategy, "cluster_environment", None)).__name__,
        "sharding_strategy": run.sharding,
        "state_dict_type": run.state_dict_type,
        "fsdp": run.fsdp,
        "precision": run.precision,
        "device": device_name,
        "peak_memory_mb": round(peak_memory_bytes(device) / 2**20, 1),
        "peak_memory_mb_per_rank": per_rank_peak_memory_mb(fabric),
    }


def per_rank_peak_memory_mb(fabric) -> list[float]:
    """Every rank's peak memory (collective): a sharded run should show each rank holding its part only."""
    from litgpt.checkpoint import every_rank

    return every_rank(round(peak_memory_bytes(fabric.device) / 2**20, 1))


# Dense bf16 peak FLOP/s of the GPUs we quote MFU for.
GPU_PEAK_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12}


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 2048,
                          seconds: float = 0.5) -> tuple[float, int]:
    """The FLOP/s a large square matmul reaches on `device` (the hardware limit that MFU is measured against), and
    the side of the matrices it was measured with.

    The side doubles from 256 up to `size` while the next one would still take under `seconds` per matmul: a dtype
    the device only emulates (bf16 on a CPU without AVX512-BF16 or AMX, where one 2048^3 matmul takes about a minute)
    is measured at a smaller size instead of stalling the end of the run for minutes.
    """

    def matmul_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    side = 256
    while True:
        a = torch.randn(side, side, device=device, dtype=dtype)
        b = torch.randn(side, side, device=device, dtype=dtype)
        matmul_seconds(a, b)  # warm-up: library initialization and kernel selection
        if side >= size or 8 * matmul_seconds(a, b) > seconds:
            break
        side *= 2
    runs, start = 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - start < seconds:
        matmul_seconds(a, b)
        runs += 1
    return 2 * side**3 * runs / (time.perf_counter() - start), side


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def progress_bar(fabric, total: int, initial: int):
    from tqdm import tqdm

    # Only on an interactive terminal: in log files (CI, Slurm) the log lines say it all.
    show = fabric.global_rank == 0 and sys.stderr.isatty()
    return tqdm(total=total, initial=initial, disable=not show, unit="step", dynamic_ncols=True, file=sys.stderr,
                mininterval=1.0)


# ---- profiling ----------------------------------------------------------------------------------------------------------
def start_profiler(run: Run):
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                       record_shapes=True, with_stack=False)
    profiler.start()
    return profiler


def stop_profiler(run: Run, profiler) -> None:
    profiler.stop()
    if run.fabric.global_rank == 0:
        path = run.out_dir / "profile" / f"trace-rank{run.fabric.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            profiler.export_chrome_trace(str(path))
        except RuntimeError:
            print("The run ended before the profiler recorded its steps (it skips 2, records 3).", file=sys.stderr)
            return
        print(f"Wrote a profiler trace (chrome://tracing, Perfetto or TensorBoard) to {path}", file=sys.stderr)


# ---- checkpoints --------------------------------------------------------------------------------------------------------
def save_checkpoint(run: Run, name: str) -> None:
    """Write out_dir/<name>/ under a temporary name and rename it into place when complete (every rank calls this).

    Full: rank 0 gathers the weights and optimizer state and writes them. Sharded: every rank writes its shards into
    <name>/sharded/ in parallel; nobody holds the whole model. The manifest (step, tokens, world size, every file's
    size and SHA-256) is written last; then --train.keep_last prunes older checkpoints.
    """
    import litgpt.checkpoint
    from litgpt.checkpoint import (
        TRAINING_STATE_FILE,
        check_free_space,
        copy_tokenizer_files,
        prune_checkpoints,
        publish_dir,
        save_state_dict,
        staging_dir,
        write_manifest,
    )

    fabric = run.fabric
    io = run.shard_io or litgpt.checkpoint
    model, optimizer = unwrap(run.model), unwrap_optimizer(run.optimizer)
    path = run.out_dir / name
    staging = staging_dir(path)
    failpoint("save:begin")
    if fabric.global_rank == 0:
        check_free_space(run.out_dir, checkpoint_bytes(model, run.checkpoint_keys, optimizer), f"checkpoint {name}")
        shutil.rmtree(staging, ignore_errors=True)  # left by a run that died while saving
        staging.mkdir(parents=True)
    weights = optimizer_state = digests = None
    with disk_errors_named(run, name):
        if run.state_dict_type == "sharded":
            fabric.barrier()
            io.save_sharded(staging, model, optimizer, run.checkpoint_keys)
            failpoint("save:sharded")
            digests = own_shard_digests(staging, fabric.global_rank)
        else:
            weights = io.gather_weights(model, run.checkpoint_keys)
            optimizer_state = io.gather_optimizer_state(model, optimizer)
        if fabric.global_rank == 0:
            with publish_dir(path, staging) as folder:
                if weights is not None:
                    save_state_dict(weights, folder / run.weights_file)
                    failpoint("save:weights")
                run.config.save(folder / "model_config.yaml")
                write_yaml(folder / "hyperparameters.yaml", run.hyperparameters)
                if run.tokenizer_dir is not None:
                    copy_tokenizer_files(run.tokenizer_dir, folder)
                training_state = {
                    "optimizer": optimizer_state,  # in sharded/ for a sharded checkpoint
                    "train_state": asdict(run.state),
                    "rng": torch.get_rng_state(),
                    "weights_file": run.weights_file,
                    "state_dict_type": run.state_dict_type,
                }
                save_state_dict(training_state, folder / TRAINING_STATE_FILE)
                failpoint("save:state")
                write_manifest(folder, checkpoint_info(run), digests)
                failpoint("save:manifest")
            failpoint("save:published")
            if run.train.keep_last is not None:
                prune_checkpoints(run.out_dir, run.train.keep_last)
                failpoint("save:pruned")
    run.last_saved_step = run.state.step
    fabric.barrier()


def own_shard_digests(staging: Path, rank: int) -> dict:
    """The SHA-256 of the shard files, each rank hashing those it wrote, in parallel (collective)."""
    from litgpt.checkpoint import SHARDED_DIR, every_rank, file_sha256

    mine = {f"{SHARDED_DIR}/{f.name}": file_sha256(f) for f in (staging / SHARDED_DIR).glob(f"__{rank}_*")}
    return {name: digest for digests in every_rank(mine) for name, digest in digests.items()}


def checkpoint_info(run: Run) -> dict:
    """What a checkpoint's manifest records besides its files."""
    return {
        "step": run.state.step,
        "epoch": run.state.epoch,
        "tokens": run.state.tokens,
        "world_size": run.fabric.world_size,
        "num_nodes": getattr(run.fabric.strategy, "num_nodes", 1),
        "sharding_strategy": run.sharding,
        "state_dict_type": run.state_dict_type,
        "precision": run.precision,
        "weights_file": run.weights_file,
    }


def checkpoint_bytes(model: torch.nn.Module, select: Callable[[str], bool], optimizer=None) -> int:
    """About how many bytes one checkpoint of this run takes: the selected weights at their dtype, plus the optimizer
    state (before the first step, when it does not exist yet, AdamW's two float32 moments per trainable weight)."""
    weights = sum(v.numel() * v.element_size() for k, v in model.state_dict().items() if select(k))
    states = [t for state in (optimizer.state.values() if optimizer is not None else ()) for t in state.values()]
    if states:
        optimizer_bytes = sum(t.numel() * t.element_size() for t in states if isinstance(t, torch.Tensor))
    else:
        optimizer_bytes = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    return weights + optimizer_bytes


# torch.save reports a failed write as a RuntimeError from its zip writer, not as an OSError with an errno.
TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed")


@contextmanager
def disk_errors_named(run: Run, name: str) -> Iterator[None]:
    """Turn a failed write during a save (disk full, quota, file-size limit, read-only) into one message; the staging
    folder is gone by then and the previous checkpoints are untouched."""
    from litgpt.checkpoint import format_bytes, free_bytes

    try:
        yield
    except Exception as error:
        failures = getattr(error, "failures", {}) or {}  # torch.distributed.checkpoint gathers every rank's
        causes = [error, error.__cause__, *(f[0] if isinstance(f, tuple) else f for f in failures.values())]
        written = next((c for c in causes if isinstance(c, OSError) or (
            isinstance(c, RuntimeError) and any(marker in str(c) for marker in TORCH_WRITE_FAILURES))), None)
        if written is None:
            raise
        reason = written.strerror if isinstance(written, OSError) and written.strerror else "a write failed"
        needed = checkpoint_bytes(unwrap(run.model), run.checkpoint_keys, unwrap_optimizer(run.optimizer))
        raise UserError(
            f"Could not write checkpoint {name} in {str(run.out_dir)!r}: {reason}. It needs about "
            f"{format_bytes(needed)}; {format_bytes(free_bytes(run.out_dir))} are free now (check also quotas and "
            "`ulimit -f`). The earlier checkpoints are as they were: make room and continue with --resume auto."
        ) from None


def publish_final(run: Run, last_step: Path) -> None:
    """out_dir/final: the last step's weights and files without the training state, ready for `litgpt generate`.

    Files are hard-linked rather than written twice; a sharded checkpoint's weights are consolidated into one file.
    """
    from litgpt.checkpoint import (
        MANIFEST_FILE,
        SHARDED_DIR,
        TRAINING_STATE_FILE,
        consolidated_weights,
        publish_dir,
        read_manifest,
        save_state_dict,
        write_manifest,
    )

    if run.fabric.global_rank == 0:
        with publish_dir(run.out_dir / "final") as folder:
            for file in last_step.iterdir():
                if file.name not in (TRAINING_STATE_FILE, SHARDED_DIR, MANIFEST_FILE):
                    try:
                        os.link(file, folder / file.name)
                    except OSError:  # a filesystem without hard links
                        shutil.copy2(file, folder / file.name)
            if (last_step / SHARDED_DIR).is_dir():
                save_state_dict(consolidated_weights(last_step), folder / run.weights_file)
            # The linked files were hashed for the step's manifest already: only a consolidated file is new.
            step_digests = {name: entry["sha256"] for name, entry in read_manifest(last_step)["files"].items()}
            write_manifest(folder, {**checkpoint_info(run), "state_dict_type": "full"}, step_digests)
            failpoint("final:written")
    run.fabric.barrier()


def write_json(path: Path, values: dict) -> None:
    from litgpt.checkpoint import atomic_write_text

    atomic_write_text(path, json.dumps(values, indent=2, default=str) + "\n")


def write_yaml(path: Path, values: dict) -> None:
    import yaml

    from litgpt.checkpoint import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(values, sort_keys=False))

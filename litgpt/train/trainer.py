"""The training loop every recipe shares: accumulation, clipping, schedule, validation, logging, preemption.

The `Trainer` holds the set-up model and optimizer, the data, the recipe's `Objective` and the checkpoint manager,
and takes its own small `TrainerSettings`; it knows nothing of which command runs, which kind of training the
objective is, or how the model is sharded.
"""

from __future__ import annotations

import itertools
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from litgpt.args import EvalArgs, TrainArgs
from litgpt.checkpoint.manager import CheckpointManager, unwrap
from litgpt.data.base import IGNORE_INDEX, MicroBatches, SampleDataset
from litgpt.data.packing import PackedDataset
from litgpt.distributed.runtime import every_rank, print_once
from litgpt.distributed.topology import data_parallel
from litgpt.errors import UserError
from litgpt.failpoints import failpoint
from litgpt.generate import generate
from litgpt.io import write_json
from litgpt.loggers import finish_tracking, log_final_metrics
from litgpt.precision import Precision
from litgpt.progress import terminal_bar
from litgpt.preemption import StepControl, StopSignals, requeue_slurm_job
from litgpt.registry import ExtensionStrategy
from litgpt.train.metrics import LogWindow, run_metrics
from litgpt.train.objective import Objective
from litgpt.train.optimizer import lr_at
from litgpt.train.profiler import start_profiler, stop_profiler
from litgpt.train.state import TrainState
from litgpt.train.step_runner import StepRunner


@dataclass(frozen=True)
class TrainerSettings:
    """What the loop reads of a run's settings.

    Args:
        train, eval: the schedule, batch sizes, intervals and validation settings (--train.*, --eval.*).
        out_dir: where metrics.json and a --profile trace go.
        precision: the run's precision (a gradient scaler's steps are not counted as non-finite).
        profile: record a torch.profiler trace of a few steps.
        timeout: seconds a collective may wait for the other ranks.
        compiles_blocks: the model's blocks are compiled (the first step's time is said to include it).
    """

    train: TrainArgs
    eval: EvalArgs
    out_dir: Path
    precision: Precision
    profile: bool = False
    timeout: float = 600.0
    compiles_blocks: bool = False


class Trainer:
    def __init__(self, fabric, model, optimizer, objective: Objective, runner: StepRunner, settings: TrainerSettings,
                 tokenizer, checkpoints: CheckpointManager, state: TrainState, base_lr: float,
                 train_data: MicroBatches, val_data: SampleDataset) -> None:
        self.fabric, self.model, self.optimizer, self.objective = fabric, model, optimizer, objective
        self.runner = runner  # how a step's micro-batches run forward and backward, and validation's
        self.settings, self.train, self.eval = settings, settings.train, settings.eval
        self.tokenizer, self.checkpoints, self.state, self.base_lr = tokenizer, checkpoints, state, base_lr
        self.train_data, self.val_data = train_data, val_data
        self.val_parts: dict[str, float] = {}  # the validation loss's other parts of the latest validation
        # Ranks of one tensor-parallel group read the same batches: the batch arithmetic counts the groups.
        self.data_rank, self.data_world = data_parallel(fabric)
        self.accumulation = self.train.gradient_accumulation_iters(self.data_world)
        # An optimizer stepped in the backward pass (--train.optimizer_in_backward) leaves no gradient to measure.
        self.steps_in_backward = getattr(optimizer, "steps_in_backward", False)
        self.samples_per_micro_step = self.train.micro_batch_size * self.data_world
        self.seq_length = self.objective.tokens(train_data.dataset[0])
        self.total_steps = self.train.total_steps(train_data.per_epoch / self.accumulation, self.seq_length)
        self.stopped_by: Optional[str] = None  # the name of the stop signal that ended the run early
        self.logged_loss_parts: dict[str, float] = {}  # the parts of the loss on the last log line (ce_loss, ...)
        # This session's first step (seconds, tokens): it pays torch.compile's compilation, reported on its own.
        self.first_step: Optional[tuple[float, int]] = None

    # ---- the loop ---------------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train until the step limit, validating, logging and checkpointing on the way; returns the run's metrics."""
        fabric, state = self.fabric, self.state
        self.check_data()
        if state.data_positions is not None:
            self.train_data.load_state_dict(state.data_positions)
        data = self.train_data.iterate(state.epoch, self.start_position())
        batches = self.objective.batches(fabric, self.model, data, self.train_data.dataset, self.accumulation)
        trainable, total = self.runner.parameter_counts()
        trainable_fraction = trainable / total
        print_once(
            f"Training {self.total_steps} steps from step {state.step}: global batch {self.train.global_batch_size} "
            f"= {self.data_world} {'device(s)' if self.data_world == fabric.world_size else 'model-parallel group(s)'}"
            f" x micro batch {self.train.micro_batch_size} x {self.accumulation} "
            f"accumulation, {trainable:,} trainable parameters."
        )
        if self.eval.initial_validation and state.step == 0:
            print_once(f"step 0 | val loss {self.validate():.4f}")
        fit_start, fit_tokens, fit_seconds = time.perf_counter(), state.tokens, state.train_seconds
        profiler = start_profiler() if self.settings.profile else None
        # A bar on a terminal only: in log files (CI, Slurm) the log lines say it all.
        progress = terminal_bar(self.total_steps, unit="step", initial=state.step)
        window = LogWindow(fabric.device, state.tokens)
        control = StepControl(self.settings.timeout)
        val_loss, stop_signal = None, 0
        with StopSignals() as signals:
            while state.step < self.total_steps and not stop_signal:
                stop_signal = self.step(batches, window, control, signals, progress)
                if profiler is not None:
                    profiler.step()
                progress.update(1)
                failpoint("step:end")
                if state.step % self.train.log_interval == 0 or state.step == self.total_steps:
                    self.log(window, progress)
                if not stop_signal:
                    val_loss = self.after_step(progress, val_loss)
        progress.close()
        if profiler is not None:
            stop_profiler(profiler, self.settings.out_dir, fabric.global_rank)
        if self.checkpoints.last_saved_step != state.step:
            self.save()
        if stop_signal:
            self.stopped_by = signal.Signals(stop_signal).name
            return self.stop_for_signal()
        self.checkpoints.publish_final(state)
        metrics = run_metrics(fabric, state, unwrap(self.model).config, self.settings.precision,
                              self.checkpoints.io, val_loss, self.seq_length, trainable_fraction,
                              self.logged_loss_parts)
        metrics.update({f"val_{name}": value for name, value in self.val_parts.items()})
        metrics["wall_seconds"] = round(time.perf_counter() - fit_start, 3)  # this session, with eval and saving
        metrics.update(steady_state_metrics(self.first_step, state.tokens - fit_tokens,
                                            state.train_seconds - fit_seconds))
        if fabric.global_rank == 0:
            log_final_metrics(fabric.loggers, metrics, state.step)
        finish_tracking(fabric.loggers)
        if fabric.global_rank == 0:
            write_json(self.settings.out_dir / "metrics.json", metrics)
        return metrics

    def check_data(self) -> None:
        """Fail before training, not after it, when the data cannot make one step or one validation."""
        if self.train_data.per_epoch < self.accumulation:
            packed = isinstance(self.train_data.dataset, PackedDataset)
            raise UserError(
                f"The training set has {len(self.train_data.dataset)} {'packed sequences' if packed else 'samples'}, "
                f"fewer than one global batch ({self.train.global_batch_size}): add data or lower "
                "--train.global_batch_size."
            )
        self.validation_batches()

    def start_position(self) -> int:
        """The micro-step of the current epoch to continue from (a resumed run of another world size rounds down)."""
        state, per_step = self.state, self.samples_per_micro_step
        if state.epoch_samples % per_step:
            print_once(
                f"Warning: the checkpoint stopped {state.epoch_samples} samples into epoch {state.epoch}, which this "
                f"world size cannot split evenly; continuing from sample {state.epoch_samples // per_step * per_step}."
            )
        return state.epoch_samples // per_step

    def step(self, batches, window: LogWindow, control: StepControl, signals: StopSignals, progress) -> int:
        """One optimizer step over `accumulation` micro-batches; returns the stop signal any rank received (or 0)."""
        fabric, state = self.fabric, self.state
        step_start = time.perf_counter()
        window.lr = lr_at(state.step, self.base_lr, self.train.lr_warmup_steps, self.total_steps, self.train.min_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = window.lr
        micro_batches = []
        for _ in range(self.accumulation):
            epoch, index, batch = next(batches)
            batch = {name: fabric.to_device(value) for name, value in batch.items()}
            micro_batches.append(batch)
            window.label_tokens += self.objective.labelled_tokens(batch)
            last_of_epoch = index + 1 == self.train_data.per_epoch
            state.epoch, state.epoch_samples = (
                (epoch + 1, 0) if last_of_epoch else (epoch, (index + 1) * self.samples_per_micro_step))
            state.tokens += self.objective.tokens(batch) * self.data_world
        step_losses = self.runner.train_step(micro_batches)  # the loss and its parts, means over the micro-batches
        failpoint("step:backward")
        loss_value, grad_norm = self.step_values(step_losses["loss"])  # the loop's one host-device sync per step
        finite = math.isfinite(loss_value) and (grad_norm is None or math.isfinite(grad_norm))
        nonfinite, stop_signal = control.agree(not finite, signals.received)
        if nonfinite and self.train.on_nonfinite == "stop":
            raise UserError(self.nonfinite_message(grad_norm))
        if nonfinite:
            state.skipped_steps += 1
            self.say(progress, f"step {state.step + 1}: skipped the update: the loss ({loss_value}) or the gradient "
                               f"norm ({grad_norm}) is not finite on some rank.")
        else:
            self.optimizer.step()
            window.add_update(step_losses)
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        seconds = time.perf_counter() - step_start
        state.train_seconds += seconds
        window.add_step(seconds)
        if self.first_step is None:
            self.first_step = (seconds, self.objective.tokens(batch) * self.data_world * self.accumulation)
            if self.settings.compiles_blocks or self.objective.compiles_train_loss:
                self.say(progress, f"The first step took {seconds:.1f} s with torch.compile's compilation (cached for "
                                   f"later runs of the same shapes in {inductor_cache_dir()})")
        return stop_signal

    def step_values(self, step_loss: torch.Tensor) -> tuple[float, Optional[float]]:
        """This rank's loss of the step and the gradient norm over all ranks (clipped after, with --train.max_norm);
        None for the norm when the backward pass stepped and freed every gradient."""
        from litgpt.distributed.fsdp import FSDPStrategy  # Lightning's: imported once a run trains

        if self.steps_in_backward:
            return step_loss.float().item(), None
        if self.train.max_norm is not None:
            norm = self.fabric.clip_gradients(
                self.model, self.optimizer, max_norm=self.train.max_norm, error_if_nonfinite=False)
        elif isinstance(self.fabric.strategy, FSDPStrategy):  # its gradients may live on several meshes
            norm = self.fabric.strategy.gradient_norm(self.model)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.settings.precision.scales_gradients:
            norm = torch.zeros_like(norm)  # the grad scaler skips overflowing steps and lowers its scale by itself
        return tuple(torch.stack([step_loss.float(), norm.float().to(step_loss.device)]).tolist())

    def nonfinite_message(self, grad_norm: Optional[float]) -> str:
        """The same text on every rank (the gradient norm is global), so a run of many ranks prints it once."""
        saved = self.checkpoints.saved()
        kept = f"the newest checkpoint, {saved[-1]}, is as it was" if saved else "no checkpoint had been saved yet"
        if grad_norm is None:  # the backward pass has applied this update already; it is not saved
            return (
                f"Step {self.state.step + 1}: the loss is not finite (NaN or inf) on some rank; training stopped "
                f"without saving this step's update ({kept}). Lower the learning rate, or leave out "
                "--train.optimizer_in_backward to clip with --train.max_norm 1.0 or skip such steps."
            )
        return (
            f"Step {self.state.step + 1}: the loss or the gradient norm (here {grad_norm}) is not finite (NaN or "
            f"inf); training stopped before this update ({kept}). Lower the learning rate, clip with "
            "--train.max_norm 1.0, or pass --train.on_nonfinite skip to skip such steps and go on."
        )

    def log(self, window: LogWindow, progress) -> None:
        """Log and print the window of steps since the last log line, then start a new one."""
        state = self.state
        metrics = window.metrics(self.fabric, state.tokens, state.epoch)
        self.fabric.log_dict(metrics, step=state.step)
        progress.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        self.logged_loss_parts = {name: metrics[name] for name in window.loss_names if name != "loss"}
        parts = "".join(f" | {name} {value:.4f}" for name, value in self.logged_loss_parts.items())
        self.say(progress,
                 f"step {state.step}/{self.total_steps} | loss {metrics['loss']:.4f}{parts} | lr {metrics['lr']:.2e} | "
                 f"{metrics['tokens_per_sec']:,.0f} tokens/s | peak mem {metrics['peak_memory_mb']:,.0f} MB")
        if window.label_tokens.item() == 0:
            self.say(progress,
                     f"Warning: no token of the last {window.steps} step(s) had a label, so nothing was learned: "
                     "the prompts fill --train.max_seq_length. Raise it or shorten the prompts.")
        window.reset(state.tokens)

    def after_step(self, progress, val_loss: Optional[float]) -> Optional[float]:
        """Validate (with a text sample) and save when their intervals come; returns the latest validation loss."""
        step, last = self.state.step, self.state.step == self.total_steps
        if (step % self.eval.interval == 0 and not last) or (last and self.eval.final_validation):
            val_loss = self.validate()
            self.fabric.log_dict({"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}, step=step)
            if self.val_parts:
                self.fabric.log_dict({f"val_{name}": value for name, value in self.val_parts.items()}, step=step)
            parts = "".join(f" | val {name} {value:.4f}" for name, value in self.val_parts.items())
            self.say(progress, f"step {step} | val loss {val_loss:.4f}{parts}")
            if self.eval.max_new_tokens and self.data_world != self.fabric.world_size:
                self.say(progress, "(no text sample: decoding under model parallelism is not supported yet)")
            elif self.eval.max_new_tokens:
                prompt, continuation = self.sample_text()  # on every rank: a sharded model's forward is collective
                self.say(progress, f"sample prompt: {prompt!r}")
                self.say(progress, f"sample: {continuation!r}")
        if self.train.save_interval is not None and step % self.train.save_interval == 0 and not last:
            self.save()
        return val_loss

    def save(self) -> None:
        """A checkpoint of this step, with every rank's data position when the data has one (collective)."""
        position = self.train_data.state_dict()
        self.state.data_positions = every_rank(position) if position is not None else None
        self.checkpoints.save(self.model, self.optimizer, self.state)

    def say(self, progress, text: str) -> None:
        """A log line on rank 0, above the progress bar when one is shown."""
        if self.fabric.global_rank == 0:
            progress.write(text, file=sys.stdout)

    def stop_for_signal(self) -> dict:
        """After the checkpoint a stop signal asked for: say where it is and, with --train.requeue under Slurm,
        requeue."""
        folder = self.checkpoints.step_dir(self.state.step)
        finish_tracking(self.fabric.loggers)
        if self.fabric.global_rank == 0:
            then = requeue_slurm_job() if self.train.requeue else "continue it with the same command and --resume auto"
            print(f"Stopped by {self.stopped_by} after step {self.state.step}: saved {folder}; {then}.", flush=True)
        return {"stopped_by": self.stopped_by, "steps": self.state.step, "checkpoint": str(folder)}

    # ---- validation -------------------------------------------------------------------------------------------------
    def validation_batches(self) -> MicroBatches:
        """The validation set in a fixed order, in micro-batches no larger than it allows."""
        world = self.data_world
        if len(self.val_data) < world:
            raise UserError(f"The validation set has {len(self.val_data)} samples, fewer than the {world} devices: "
                            "add validation data.")
        size = min(self.train.micro_batch_size, len(self.val_data) // world)
        return MicroBatches(self.val_data, size, seed=0, rank=self.data_rank, world_size=world,
                            shuffle=False)

    @torch.no_grad()
    def validate(self) -> float:
        """The objective's validation loss over up to --eval.max_iters validation micro-batches, averaged over the
        ranks; its other parts are kept in `val_parts`."""
        model = self.model
        model.eval()
        batches = self.validation_batches()
        losses, names = [], None  # per micro-batch: the validation loss and its other parts, in `names`' order
        data = itertools.islice(batches.iterate(), min(self.eval.max_iters, batches.per_epoch))
        for _, _, batch in self.objective.batches(self.fabric, model, data, self.val_data, per_step=1):
            batch = {name: self.fabric.to_device(value) for name, value in batch.items()}
            parts = self.runner.validation_losses(batch)
            names = names or list(parts)
            losses.append(torch.stack([parts[name].float() for name in names]))
        means = self.fabric.all_reduce(torch.stack(losses).mean(0), reduce_op="mean").tolist()
        model.train()
        self.val_parts = {name: value for name, value in zip(names, means) if name != "loss"}
        return means[names.index("loss")]

    def sample_text(self) -> tuple[str, str]:
        """The prompt part of the first validation sample and the model's greedy continuation of it, to watch the
        model learn; the prompt stops where the sample's labels begin, so its reference answer is never shown."""
        model = unwrap(self.model)
        if isinstance(self.fabric.strategy, ExtensionStrategy):  # its set-up module may not decode with a KV cache
            model = self.fabric.strategy.sampling_model(model)
        sample = self.val_data[0]
        prompt = sample_prompt(sample["input_ids"], sample["labels"])
        # A prompt too long for a reply keeps its end, where the reply starts.
        prompt = prompt[-max(1, model.config.block_size - self.eval.max_new_tokens):]
        model.eval()
        tokens = list(generate(model, prompt, self.eval.max_new_tokens, temperature=0.0,
                               stop_ids=self.tokenizer.stop_ids))
        model.clear_kv_cache()
        model.train()
        prompt_text = self.tokenizer.decode(prompt.tolist(), skip_special_tokens=True)
        # Decoded together, so that a word split across the boundary keeps its leading space.
        whole = self.tokenizer.decode(prompt.tolist() + tokens, skip_special_tokens=True)
        if whole.startswith(prompt_text):
            return prompt_text, whole[len(prompt_text):]
        return prompt_text, self.tokenizer.decode(tokens, skip_special_tokens=True)


def sample_prompt(input_ids: torch.Tensor, labels: torch.Tensor, prefix: int = 16) -> torch.Tensor:
    """The tokens of a (shifted) sample before its answer: up to and including the position whose label is the
    answer's first token. A sample without a masked prompt (pretraining text) gives its first `prefix` tokens, at
    most half of it, so that there is text left to continue."""
    answer = (labels != IGNORE_INDEX).nonzero()
    if answer.numel() == 0:  # the prompt fills the whole sample
        return input_ids
    first = int(answer[0])
    if first > 0:
        return input_ids[: first + 1]
    return input_ids[: max(1, min(prefix, input_ids.numel() // 2))]


def inductor_cache_dir() -> str:
    """Where inductor keeps its compiled graphs across runs ($TORCHINDUCTOR_CACHE_DIR, else a folder in /tmp)."""
    from torch._inductor.runtime.runtime_utils import cache_dir

    return cache_dir()


def steady_state_metrics(first_step: Optional[tuple[float, int]], tokens: int, seconds: float) -> dict:
    """metrics.json's split of this session's steps: the first one's seconds (with any compilation) and the tokens/s
    of the others (None with a single step)."""
    if first_step is None:
        return {}
    first_seconds, first_tokens = first_step
    later_seconds = seconds - first_seconds
    return {
        "first_step_seconds": round(first_seconds, 3),
        "tokens_per_sec_after_first_step": round((tokens - first_tokens) / later_seconds, 1) if later_seconds > 0
        else None,
    }

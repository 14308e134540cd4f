"""Arguments shared by the training entry points (LitGPT's names, so commands and YAML files carry over)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from litgpt.errors import UserError


@dataclass
class TrainArgs:
    """Training schedule and batch arithmetic.

    Args:
        save_interval: Optimizer steps between checkpoints (None: only the final one).
        log_interval: Optimizer steps between log lines (loss, learning rate, tokens/s, memory).
        global_batch_size: Samples per optimizer step, over all devices and nodes.
        micro_batch_size: Samples per forward/backward pass on one device; the rest is gradient accumulation.
        lr_warmup_steps: Optimizer steps of linear learning-rate warm-up.
        epochs: Passes over the training data (one of epochs / max_tokens / max_steps ends the run).
        max_tokens: Tokens to train on.
        max_steps: Optimizer steps to take.
        max_seq_length: Longest sample in tokens (default: the model's block size).
        max_norm: Clip the gradient norm to this value (None: no clipping).
        min_lr: The learning rate the cosine schedule ends at.
        activation_checkpointing: Recompute each block's activations in the backward pass (less memory, ~30% slower).
        keep_last: Keep only this many newest complete step checkpoints, deleting older ones (None: keep all).
        on_nonfinite: What a NaN or infinite loss or gradient norm does: stop the run (naming the step; the last
            checkpoint stays as it was) or skip that step's update and go on.
        requeue: Under Slurm, after the checkpoint a SIGTERM or SIGUSR1 triggers, requeue the job
            (`scontrol requeue`); the requeued job continues with --resume auto.
    """

    save_interval: Optional[int] = 1000
    log_interval: int = 1
    global_batch_size: int = 64
    micro_batch_size: int = 4
    lr_warmup_steps: int = 100
    epochs: Optional[int] = None
    max_tokens: Optional[int] = None
    max_steps: Optional[int] = None
    max_seq_length: Optional[int] = None
    max_norm: Optional[float] = None
    min_lr: float = 6e-5
    activation_checkpointing: bool = False
    keep_last: Optional[int] = None
    on_nonfinite: Literal["stop", "skip"] = "stop"
    requeue: bool = False

    def gradient_accumulation_iters(self, world_size: int) -> int:
        """global = world_size x micro x accumulation; raise UserError when that does not divide."""
        per_step = self.micro_batch_size * world_size
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise UserError("train.global_batch_size and train.micro_batch_size must be at least 1.")
        if self.global_batch_size % per_step:
            raise UserError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of train.micro_batch_size "
                f"({self.micro_batch_size}) x devices x num_nodes ({world_size}) = {per_step}."
            )
        return self.global_batch_size // per_step

    def total_steps(self, steps_per_epoch: float, seq_length: int) -> int:
        """Optimizer steps the run will take, from whichever limit is set (the smallest if several)."""
        limits = []
        if self.max_steps is not None:
            limits.append(self.max_steps)
        if self.max_tokens is not None:
            limits.append(math.ceil(self.max_tokens / (self.global_batch_size * seq_length)))
        if self.epochs is not None:
            limits.append(math.floor(self.epochs * steps_per_epoch))
        if not limits:
            raise UserError("Set how long to train: one of --train.max_steps, --train.max_tokens or --train.epochs.")
        steps = min(limits)
        if steps < 1:
            raise UserError(
                "The run would take no optimizer step: the data holds fewer samples than one global batch, or the "
                "limits (max_steps / max_tokens / epochs) are too small."
            )
        return steps


@dataclass
class EvalArgs:
    """Validation during training.

    Args:
        interval: Optimizer steps between validations.
        max_iters: Validation micro-batches per validation (at most the whole validation set).
        initial_validation: Validate before the first step.
        final_validation: Validate after the last step.
        max_new_tokens: After each validation, generate this many tokens from a validation prompt (None: don't).
    """

    interval: int = 600
    max_iters: int = 100
    initial_validation: bool = False
    final_validation: bool = True
    max_new_tokens: Optional[int] = None


ShardingStrategy = Literal["HYBRID_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


@dataclass
class FSDPArgs:
    """How a run on more than one device shards the model (FSDP2: each transformer Block, then the root).

    Args:
        sharding_strategy: HYBRID_SHARD shards inside a node and replicates across nodes; FULL_SHARD shards over every
            device; SHARD_GRAD_OP shards too but keeps the parameters gathered from forward to backward (faster, more
            memory); NO_SHARD replicates everything (data parallel).
        state_dict_type: full: rank 0 writes one consolidated lit_model.pth; sharded: every rank writes its shards
            into a torch.distributed.checkpoint folder (fast for large models; `litgpt consolidate` makes one file).
        cpu_offload: Keep parameters, gradients and optimizer state in CPU memory (GPU memory for activations only;
            several devices only; with --quantize the sharded 4-bit base too, which NO_SHARD does not shard).
        timeout: Seconds a collective may wait for the other ranks before the run fails (a rank that died).
    """

    sharding_strategy: ShardingStrategy = "HYBRID_SHARD"
    state_dict_type: Literal["full", "sharded"] = "full"
    cpu_offload: bool = False
    timeout: float = 600.0

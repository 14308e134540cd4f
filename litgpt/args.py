"""The argument dataclasses of the commands (--train.*, --eval.*, --fsdp.*, --parallel.*, --kd.*, --logger.*,
--log.*) and their checks, in one place (LitGPT's names, so commands and YAML files carry over). What a run records of
its arguments is `litgpt.train.run_record`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

from litgpt.config import Config
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
        optimizer_in_backward: Update each parameter inside the backward pass as soon as its gradient is ready, and
            free that gradient, so that the whole model's gradients are never held at once (one parameter's, or
            under FSDP one block's, instead). Needs one micro-batch per step (global_batch_size = micro_batch_size x
            devices), no max_norm, on_nonfinite stop, and an optimizer that steps without a closure; the gradient
            norm is then not measured.
        min_lr: The learning rate the cosine schedule ends at.
        activation_checkpointing: Recompute activations in the backward pass instead of keeping them, to trade speed
            for memory: false (keep everything); true or full (every block keeps only its input: least memory, ~30%
            slower); N or every:N (one block in N is recomputed, the others keep everything: e.g. 2 saves about
            half of what full saves); ops (every block keeps the outputs of its matmuls and attention and recomputes
            the cheap rest: norms, rotary embedding, activation functions, elementwise ops). `litgpt plan
            --activation_checkpointing` shows what each setting needs.
        offload_activations: Keep what the forward pass saves for the backward pass in host memory (pinned), copied
            back as the backward pass reads it, so the device holds about one block's activations at a time; costs
            the copies' time. With activation checkpointing only the checkpointed blocks' inputs are saved, and
            moved (with ops, the matmul and attention outputs it keeps stay on the device in eager blocks).
            Parameters are never copied. On a CPU the host is the device: it saves nothing there, but runs the same
            copies and gives the same results. `litgpt plan --train.offload_activations true` shows the device and
            host memory it needs.
        keep_last: Keep only this many newest complete step checkpoints, deleting older ones (None: keep all).
        on_nonfinite: What a NaN or infinite loss or gradient norm does: stop the run (naming the step; the last
            checkpoint stays as it was) or skip that step's update and go on.
        requeue: Under Slurm, after the checkpoint a SIGTERM or SIGUSR1 triggers, requeue the job
            (`scontrol requeue`); the requeued job continues with --resume auto.
        loss_chunk_size: Positions per chunk of the output head and loss, which never build the whole logits
            (None: automatic, one chunk's float32 logits about the size of the hidden states, at least 1024 positions;
            `litgpt.train.loss.auto_chunk_size`).
        float8_recipe: How --precision fp8-mixed scales each float8 operand (torchao's recipes): rowwise (the
            default: a power-of-two scale per row as each matmul reads its operands; under --parallel.tensor a
            scale covers each rank's share of a row where a layer splits it) or tensorwise (one scale per tensor:
            cheaper casts, coarser scales; on one H200 a Llama-3.2-1B MLP ran 1.25x bf16 with it, 0.92x with rowwise).
        tie_embeddings: LitGPT's: pretraining shares one matrix between the token embedding and the output head (true)
            or not (false); None keeps the model config's `tie_embeddings`. Finetuning keeps the checkpoint's.
        lr_warmup_fraction: LitGPT's warm-up as a fraction of an epoch; refused here: use lr_warmup_steps.
        max_time: LitGPT's time limit in seconds; refused here: use max_steps or max_tokens.
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
    optimizer_in_backward: bool = False
    min_lr: float = 6e-5
    activation_checkpointing: Union[bool, int, str] = False  # read through ActivationCheckpointing.parse
    offload_activations: bool = False
    keep_last: Optional[int] = None
    on_nonfinite: Literal["stop", "skip"] = "stop"
    requeue: bool = False
    loss_chunk_size: Optional[int] = None
    float8_recipe: Optional[Literal["rowwise", "tensorwise"]] = None
    tie_embeddings: Optional[bool] = None
    lr_warmup_fraction: Optional[float] = None
    max_time: Optional[float] = None

    def check(self) -> None:
        """UserError for a limit, interval or checkpointing setting that cannot work (before Lightning loads)."""
        for name in ("max_steps", "max_tokens", "epochs", "save_interval", "keep_last", "loss_chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--train.{name} must be at least 1, got {value}.")
        if self.log_interval < 1:
            raise UserError(f"--train.log_interval must be at least 1, got {self.log_interval}.")
        ActivationCheckpointing.parse(self.activation_checkpointing)

    def seq_length(self, config: Config) -> int:
        """The sample length in tokens (--train.max_seq_length, default the block size), checked against `config`."""
        length = self.max_seq_length or config.block_size
        if length > config.block_size:
            raise UserError(
                f"--train.max_seq_length {length} is longer than the model's block size {config.block_size}: "
                f"use at most {config.block_size}."
            )
        if length < 1:
            raise UserError(f"--train.max_seq_length must be at least 1, got {length}.")
        return length

    def planned_steps(self, seq_length: int) -> Optional[int]:
        """The optimizer steps --train.max_steps and --train.max_tokens allow (samples of `seq_length` tokens)
        before the data is known; None when only --train.epochs limits the run."""
        limits = [self.max_steps] if self.max_steps is not None else []
        if self.max_tokens is not None:
            limits.append(-(-self.max_tokens // (self.global_batch_size * seq_length)))
        return min(limits) if limits else None

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
        evaluate_example: LitGPT's choice of that prompt: "first" (what is done here); "random" or an index have no
            effect here (a note says so).
    """

    interval: int = 600
    max_iters: int = 100
    initial_validation: bool = False
    final_validation: bool = True
    max_new_tokens: Optional[int] = None
    evaluate_example: Union[str, int] = "first"


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
        forward_prefetch: In the forward pass, each block issues the all-gathers of the next N blocks as soon as its
            own parameters are gathered (more overlap of communication with compute, up to N more blocks' parameters
            held at once). 0: FSDP2's implicit behaviour (a block's all-gather is issued as the block starts). true
            (FSDP1's and Hugging Face Trainer's spelling) is 1, false or null 0. Shard groups of one device (NO_SHARD,
            HYBRID_SHARD with one device per node) gather nothing, so there it changes nothing.
        backward_prefetch: In the backward pass, each block issues the all-gathers of the N blocks before it
            (computed next) when its own backward starts. 0: FSDP2's implicit behaviour, which already prefetches
            the next block, so 1 behaves the same and 2 or more overlaps more. FSDP1's names are read too:
            BACKWARD_PRE is 1; BACKWARD_POST, NO_PREFETCH, false and null are 0, the nearest FSDP2 has (it neither
            waits for the gradient computation to prefetch nor turns backward prefetching off).
    """

    sharding_strategy: ShardingStrategy = "HYBRID_SHARD"
    state_dict_type: Literal["full", "sharded"] = "full"
    cpu_offload: bool = False
    timeout: float = 600.0
    forward_prefetch: Union[bool, int, str, None] = 0  # a number of blocks once built (prefetch_blocks)
    backward_prefetch: Union[bool, int, str, None] = 0

    def __post_init__(self) -> None:
        # Read here, so a bad value fails while the command line is parsed and the fields hold numbers afterwards.
        self.forward_prefetch = prefetch_blocks(self.forward_prefetch, "--fsdp.forward_prefetch")
        self.backward_prefetch = prefetch_blocks(self.backward_prefetch, "--fsdp.backward_prefetch", FSDP1_BACKWARD)


# The pipeline schedules of `torch.distributed.pipelining` we run, and the stages per device each fixes (None: two or
# more, interleaved).
PIPELINE_SCHEDULES = {"1F1B": 1, "Interleaved1F1B": None, "InterleavedZeroBubble": None, "ZBVZeroBubble": 2}
CONTEXT_ATTENTION = ("auto", "heads")  # --parallel.context_attention


@dataclass
class ParallelArgs:
    """How many devices split the model, beside the data parallelism (FSDP, `FSDPArgs`) that takes the rest of the
    world: the device mesh is (pipeline, replicate, shard, context, tensor), the pipeline dimension outermost (its
    stages may sit on different nodes: they exchange one micro-batch's activations at a time) and the tensor dimension
    innermost so that the ranks of one tensor-parallel group are neighbours on one node.

    Args:
        tensor: Tensor parallelism with sequence parallelism (Megatron's layout): each of N neighbouring devices holds
            1/N of every attention and MLP layer (its own heads, its own MLP columns) and of the vocabulary, and the
            residual stream between the layers is split over the sequence. N must divide the devices per node, the
            heads, the key-value groups and the MLP width (a mixture of experts: every expert's width, the router
            whole; latent attention: its heads); LoRA adapters are split with their layers (not yet QLoRA). 1: none.
        expert: Expert parallelism for mixture-of-experts models: each of N data-parallel devices holds 1/N of every
            MoE layer's experts (whole experts, or with --parallel.tensor T each 1/T of its width), and tokens travel
            to their experts' devices and back by all-to-all (with T, among the devices that share a tensor rank);
            the devices of one expert group still read different batches, and FSDP shards the experts over the
            data-parallel devices left (world / (N x T)). N must divide the experts and the data-parallel devices
            (with --parallel.context C: the data-parallel x context-parallel devices, a context group's first). 1:
            none.
        context: Context parallelism for long sequences: each of N devices holds 1/N of every sequence's positions (a
            contiguous slice; sequences are padded at their end to a multiple of N); FSDP shards over the
            data-parallel and context-parallel devices together. Attention runs as `context_attention` says. N must
            divide the devices per node (with the tensor degree) and the heads and key-value groups left on each
            tensor-parallel rank. 1: none.
        context_attention: How attention sees the whole sequence under --parallel.context: "heads" (Ulysses' head
            scatter: an all-to-all before and after each attention gives a device every position of 1/N of the
            heads; every attention kind, on every device type) or "auto": PyTorch's ring attention on CUDA where a
            layer's attention is plain causal (no sliding window, sinks, soft-capping, latent attention or packed
            samples: each device keeps its queries and the keys and values travel around the group, on the flash
            or memory-efficient kernel), the head scatter elsewhere.
        pipeline: Pipeline parallelism, the outermost dimension of the mesh: the layers are cut into N x
            `pipeline_stages_per_rank` stages of consecutive blocks (the first also holds the embedding, the last the
            final norm and the output head), each of N devices runs its stages, and a step's micro-batches (its
            gradient accumulation: --train.global_batch_size / (--train.micro_batch_size x data-parallel devices))
            flow through them by the schedule; FSDP shards each stage over the data-parallel devices (world / N). N
            must divide the world, and the model needs at least one block per stage, the micro-batches per step at
            least one per stage (1F1B; the interleaved schedules one per device, in whole rounds of N); every
            micro-batch is padded to --train.max_seq_length (the stages exchange tensors of one shape). It composes
            with the other degrees, mixture-of-experts models, tied embeddings (the head on the last stage, a copy on
            the first) and QLoRA; not yet with --parallel.context on packed samples. 1: none.
        pipeline_schedule: The order in which the stages run the micro-batches' forward and backward passes
            (`torch.distributed.pipelining`): 1F1B (one stage per device; keeps up to N micro-batches of activations
            on the first), Interleaved1F1B (several stages per device, looped: a smaller bubble, more transfers),
            InterleavedZeroBubble (interleaved, the weight gradients deferred to fill the bubble) or ZBVZeroBubble
            (two stages per device in a V: device d runs stages d and 2N-1-d).
        pipeline_stages_per_rank: Stages (virtual stages) per device: 1 for 1F1B, 2 for ZBVZeroBubble, 2 or more
            for the interleaved schedules (default 2).
    """

    tensor: int = 1
    expert: int = 1
    context: int = 1
    context_attention: str = "auto"
    pipeline: int = 1
    pipeline_schedule: str = "1F1B"
    pipeline_stages_per_rank: Optional[int] = None

    def __post_init__(self) -> None:
        if self.context_attention not in CONTEXT_ATTENTION:
            raise UserError(f"--parallel.context_attention {self.context_attention!r} is not one of "
                            f"{', '.join(CONTEXT_ATTENTION)}.")
        if isinstance(self.pipeline, bool) or not isinstance(self.pipeline, int) or self.pipeline < 1:
            raise UserError(f"--parallel.pipeline must be a whole number of devices >= 1, got {self.pipeline!r}.")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise UserError(f"--parallel.pipeline_schedule {self.pipeline_schedule!r} is not one of "
                            f"{', '.join(PIPELINE_SCHEDULES)}.")
        stages, fixed = self.stages_per_rank, PIPELINE_SCHEDULES[self.pipeline_schedule]
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise UserError(f"--parallel.pipeline_stages_per_rank must be a whole number >= 1, got {stages!r}.")
        if fixed is not None and stages != fixed:
            raise UserError(f"--parallel.pipeline_schedule {self.pipeline_schedule} runs {fixed} stage(s) per device, "
                            f"not {stages}: leave --parallel.pipeline_stages_per_rank out.")
        if fixed is None and stages < 2:
            raise UserError(f"--parallel.pipeline_schedule {self.pipeline_schedule} interleaves several stages per "
                            "device: use --parallel.pipeline_stages_per_rank 2 or more (or the 1F1B schedule).")
        if isinstance(self.tensor, bool) or not isinstance(self.tensor, int) or self.tensor < 1:
            raise UserError(f"--parallel.tensor must be a whole number of devices >= 1, got {self.tensor!r}.")
        if isinstance(self.expert, bool) or not isinstance(self.expert, int) or self.expert < 1:
            raise UserError(f"--parallel.expert must be a whole number of devices >= 1, got {self.expert!r}.")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise UserError(f"--parallel.context must be a whole number of devices >= 1, got {self.context!r}.")

    @property
    def stages_per_rank(self) -> int:
        """The pipeline stages each device runs: --parallel.pipeline_stages_per_rank, else the schedule's default."""
        if self.pipeline_stages_per_rank is not None:
            return self.pipeline_stages_per_rank
        return PIPELINE_SCHEDULES[self.pipeline_schedule] or 2

    @property
    def pipeline_stages(self) -> int:
        """The model's pipeline stages over all devices (1 without pipeline parallelism)."""
        return self.pipeline * self.stages_per_rank if self.pipeline > 1 else 1


# FSDP1's BackwardPrefetch names, as `--fsdp.backward_prefetch` reads them (see FSDPArgs).
FSDP1_BACKWARD = {"backward_pre": 1, "backward_post": 0, "no_prefetch": 0}


def prefetch_blocks(value: Union[bool, int, str, None], option: str, names: Optional[dict] = None) -> int:
    """The number of blocks a `--fsdp.*_prefetch` setting prefetches: N >= 0, true (1), false or null (0), or one
    of `names` (case-insensitive); UserError naming `option` for anything else."""
    if value is None or isinstance(value, bool):
        return int(bool(value))
    text = str(value).strip().lower()
    known = {"true": 1, "false": 0, "none": 0, "null": 0, **(names or {})}
    if text in known:
        return known[text]
    if text.isdigit():
        return int(text)
    spellings = "".join(f", {name.upper()} ({n})" for name, n in (names or {}).items())
    raise UserError(
        f"{option} {value!r} is not a setting: use a number of blocks N >= 0 (0: FSDP2's implicit prefetching, "
        f"1 or 2: gather the next N blocks ahead), true (1), false (0){spellings}."
    )


CheckpointingMode = Literal["none", "full", "every", "ops"]


@dataclass(frozen=True)
class ActivationCheckpointing:
    """What the backward pass recomputes instead of keeping: `--train.activation_checkpointing` (and `litgpt plan
    --activation_checkpointing`) as parsed, one value object for the recipes, the jobs and the planner.

    mode: none (nothing is recomputed), full (every block keeps only its input), every (blocks 0, N, 2N, ... keep
    only their input, the others everything), ops (every block keeps its input and the outputs of its matmuls and
    attention kernels; `litgpt.distributed.activation_checkpointing` holds that policy).
    """

    mode: CheckpointingMode = "none"
    every: int = 1  # with mode "every": one block in `every` is checkpointed

    @classmethod
    def parse(cls, value: Union[bool, int, str, "ActivationCheckpointing", None],
              option: str = "--train.activation_checkpointing") -> "ActivationCheckpointing":
        """The setting from what a command line, a YAML file or a caller gives (an instance is returned as is);
        UserError naming `option` for anything else."""
        if isinstance(value, cls):
            return value
        if value is None or isinstance(value, bool):
            return cls("full" if value else "none")
        text = str(value).strip().lower()
        if text in ("false", "none"):
            return cls("none")
        if text in ("true", "full"):
            return cls("full")
        if text == "ops":
            return cls("ops")
        number = text.removeprefix("every:")
        if isinstance(value, int) or text.startswith("every:") or number.lstrip("-").isdigit():
            n = int(number) if number.lstrip("-").isdigit() else 0
            if n < 1:
                raise UserError(f"{option} {value}: checkpointing one block in N needs a whole number N >= 1.")
            return cls("full") if n == 1 else cls("every", n)
        raise UserError(
            f"{option} {value!r} is not a setting: use false, true (or full: every block), N or every:N (one "
            "block in N, e.g. 2), or ops (keep matmul and attention outputs, recompute the rest)."
        )

    def __bool__(self) -> bool:
        return self.mode != "none"

    def __str__(self) -> str:
        return f"every:{self.every}" if self.mode == "every" else self.mode

    def checkpoints(self, block_index: int) -> bool:
        """Whether the block at `block_index` (counted from 0) is recomputed in the backward pass (wholly, or with
        ops its cheap operations)."""
        if self.mode == "every":
            return block_index % self.every == 0
        return self.mode in ("full", "ops")


KD_LOSSES = ("forward_kl", "reverse_kl", "js")


@dataclass
class KDArgs:
    """Knowledge distillation (`litgpt distill`): the student matches the teacher's temperature-softened
    distribution over the next token, mixed with the cross-entropy on the labels.

    Args:
        loss: forward_kl (KL(teacher || student), mass-covering), reverse_kl (KL(student || teacher), mode-seeking)
            or js (Jensen-Shannon: the mean KL of each to their 0.5/0.5 mixture).
        temperature: Both distributions are softmax(logits / temperature); the KD term is multiplied by
            temperature^2, so its gradient keeps its scale as the temperature changes.
        alpha: loss = alpha x KD + (1 - alpha) x cross-entropy on the labels (1: pure distillation). Both terms are
            means over the positions that have a label.
    """

    loss: str = "forward_kl"
    temperature: float = 1.0
    alpha: float = 1.0

    def check(self) -> None:
        """UserError for a setting that cannot train."""
        if self.loss not in KD_LOSSES:
            raise UserError(f"--kd.loss {self.loss!r} is not a distillation loss: use one of {', '.join(KD_LOSSES)}.")
        if not 0.0 <= self.alpha <= 1.0:
            raise UserError(f"--kd.alpha {self.alpha} is outside [0, 1]: it weighs the KD term against the "
                            "cross-entropy (1: pure distillation).")
        if not self.temperature > 0.0 or math.isinf(self.temperature):
            raise UserError(f"--kd.temperature {self.temperature} must be a finite number above 0 (1: the models' "
                            "own distributions).")


# Preference losses (`litgpt dpo`): those that compare with a reference model, and those that need none.
REFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")


@dataclass
class DPOArgs:
    """Preference optimization (`litgpt dpo`) on pairs of a chosen and a rejected answer to one prompt.

    Args:
        loss: sigmoid (DPO), ipo (its squared, length-normalized form), hinge (SLiC), robust (DPO robust to a share
            `label_smoothing` of flipped pairs), simpo (reference-free, length-normalized, with a target margin
            `simpo_gamma`) or orpo (reference-free odds ratio added to the chosen answer's cross-entropy).
        beta: How far the policy may move from the reference (DPO's beta, IPO's tau); SimPO's reward scale; ORPO's
            weight of the odds-ratio term (its lambda).
        label_smoothing: The share of pairs assumed flipped: robust (in [0, 0.5)), and conservative DPO with sigmoid
            and simpo (in [0, 0.5]).
        simpo_gamma: SimPO's target reward margin (gamma; the loss compares the margin with gamma / beta).
        precompute_reference: Compute the reference's log-probabilities of every pair once before training (kept in
            out_dir, reused on resume) instead of running the reference beside each step: full finetuning then
            holds no second model.
    """

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    precompute_reference: bool = False

    @property
    def uses_reference(self) -> bool:
        return self.loss in REFERENCE_LOSSES

    def check(self) -> None:
        """UserError for a setting that cannot train."""
        losses = (*REFERENCE_LOSSES, *REFERENCE_FREE_LOSSES)
        if self.loss not in losses:
            raise UserError(f"--dpo.loss {self.loss!r} is not a preference loss: use one of {', '.join(losses)}.")
        if not self.beta > 0.0 or math.isinf(self.beta):
            raise UserError(f"--dpo.beta {self.beta} must be a finite number above 0 (0.1 is DPO's usual value).")
        top = 0.5 if self.loss in ("sigmoid", "simpo") else 0.0
        if self.loss == "robust" and not 0.0 <= self.label_smoothing < 0.5:
            raise UserError(f"--dpo.label_smoothing {self.label_smoothing} must lie in [0, 0.5) for the robust loss.")
        if self.loss != "robust" and self.label_smoothing and not 0.0 <= self.label_smoothing <= top:
            where = "in [0, 0.5]" if top else "0: it applies to sigmoid, robust and simpo only"
            raise UserError(f"--dpo.label_smoothing {self.label_smoothing} must be {where} for --dpo.loss {self.loss}.")
        if self.loss != "simpo" and self.simpo_gamma != DPOArgs.simpo_gamma:
            raise UserError(f"--dpo.simpo_gamma is SimPO's target margin: it needs --dpo.loss simpo, not {self.loss}.")
        if self.precompute_reference and not self.uses_reference:
            raise UserError(f"--dpo.loss {self.loss} is reference-free: it has no reference to precompute; drop "
                            "--dpo.precompute_reference.")


GRPO_LOSSES = ("grpo", "dr_grpo", "dapo")


@dataclass
class GRPOArgs:
    """Online reinforcement learning with verifiable rewards (`litgpt grpo`): each prompt's group of sampled
    completions is scored, and each completion's advantage is its reward against the group's.

    Args:
        num_generations: Completions sampled per prompt (the group; at least 2).
        max_new_tokens: The longest completion, in tokens.
        temperature: Sampling temperature of the rollouts (above 0).
        top_k: Sample among the k most likely tokens only (None: all).
        top_p: Nucleus sampling's probability mass (1: all).
        loss: grpo (each completion's mean token loss, advantages scaled by the group's std; DeepSeekMath), dr_grpo
            (token sums over completions x max_new_tokens, advantages not scaled; Dr. GRPO) or dapo (every token of
            the step weighs the same, clip-higher, groups whose rewards all agree dropped; DAPO).
        epsilon: The ratio's lower clip (1 - epsilon), and its upper one unless epsilon_high is given.
        epsilon_high: The ratio's upper clip (1 + epsilon_high); default: epsilon, 0.28 for dapo.
        beta: Weight of the KL penalty to the reference (the initial weights); 0 holds no reference.
        steps_per_generation: Optimizer steps on one generation of rollouts, each on its own share of them (the
            ratio to the policy that sampled them corrects the later ones). A run resumes bit-exact from a checkpoint
            at the end of a generation (--train.save_interval a multiple of it); from one within, the rest of the
            generation's prompts are sampled anew from the resumed weights.
        max_batch_size: Sequences the generation engine decodes together.
        refill_rounds: dapo's dynamic sampling: rounds in which each group whose rewards all agree is replaced by
            the group of another prompt drawn at random from the data (0: such groups are only left out of the loss,
            as those that still agree after the last round are).
    """

    num_generations: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    loss: str = "grpo"
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    beta: float = 0.0
    steps_per_generation: int = 1
    max_batch_size: int = 64
    refill_rounds: int = 2

    @property
    def upper_clip(self) -> float:
        if self.epsilon_high is not None:
            return self.epsilon_high
        return 0.28 if self.loss == "dapo" else self.epsilon

    def check(self) -> None:
        """UserError for a setting that cannot train."""
        if self.loss not in GRPO_LOSSES:
            raise UserError(f"--grpo.loss {self.loss!r}: use one of {', '.join(GRPO_LOSSES)}.")
        if isinstance(self.num_generations, bool) or not isinstance(self.num_generations, int) or \
                self.num_generations < 2:
            raise UserError(f"--grpo.num_generations {self.num_generations}: a group needs at least 2 completions "
                            "(advantages compare each with its group's others); 8 is usual.")
        for name in ("max_new_tokens", "steps_per_generation", "max_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--grpo.{name} {getattr(self, name)} must be at least 1.")
        if self.refill_rounds < 0:
            raise UserError(f"--grpo.refill_rounds {self.refill_rounds} must be at least 0.")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(f"--grpo.temperature {self.temperature} must be a finite number above 0: rollouts are "
                            "sampled (greedy completions of a group would all agree).")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--grpo.top_k {self.top_k} must be at least 1, or None.")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--grpo.top_p {self.top_p} must be in (0, 1].")
        if not 0 < self.epsilon < 1 or not 0 < self.upper_clip:
            raise UserError(f"--grpo.epsilon {self.epsilon} must be in (0, 1) and --grpo.epsilon_high above 0.")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise UserError(f"--grpo.beta {self.beta} must be a finite number >= 0 (0: no KL penalty, no reference).")


# The trackers --logger_name picks, and the --logger.* settings each of them has (the others refuse them).
LOGGER_FIELDS = {
    "csv": ("name",),
    "tensorboard": ("name",),
    "wandb": ("project", "name", "entity", "group", "tags"),
    "mlflow": ("project", "name", "tags"),
}


@dataclass
class LoggerArgs:
    """The experiment tracker's run (--logger.*); --logger_name picks the tracker. A tracker takes only the settings
    it has: csv and tensorboard a name, W&B all five, MLflow a project (its experiment), a name and tags.

    Args:
        project: The W&B project, or the MLflow experiment (default: litgpt).
        name: The run's name (default: the command and the model, e.g. pretrain-pythia-14m); csv and tensorboard
            name the folder of the run's logs with it.
        entity: The W&B team or user the run belongs to (default: your W&B default entity).
        group: The W&B group of related runs.
        tags: Tags of the run, e.g. `--logger.tags '[baseline, 1b]'` (MLflow: tags with an empty value).
    """

    project: Optional[str] = None
    name: Optional[str] = None
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: Optional[list[str]] = None

    def check(self, logger_name: str) -> None:
        """UserError for an unknown tracker, a setting it does not have, or a value of the wrong type."""
        if logger_name not in LOGGER_FIELDS:
            raise UserError(f"--logger_name {logger_name!r} is not one of {', '.join(LOGGER_FIELDS)}.")
        for field in ("project", "name", "entity", "group"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise UserError(f"--logger.{field} {value!r} must be a non-empty string.")
        if self.tags is not None and (isinstance(self.tags, str) or not isinstance(self.tags, (list, tuple))
                                      or not all(isinstance(tag, str) and tag for tag in self.tags)):
            raise UserError(f"--logger.tags {self.tags!r} must be a list of non-empty strings, e.g. "
                            "--logger.tags '[baseline, 1b]'.")
        given = [field for field in ("project", "name", "entity", "group", "tags") if getattr(self, field) is not None]
        unknown = [field for field in given if field not in LOGGER_FIELDS[logger_name]]
        if unknown:
            raise UserError(f"--logger.{unknown[0]} is not a setting of the {logger_name} logger: it takes "
                            f"{', '.join('--logger.' + f for f in LOGGER_FIELDS[logger_name])}.")


@dataclass
class LogArgs:
    """LitGPT's logger settings, read so that its recipes and scripts work as written. With --logger_name wandb,
    project, run and group name the W&B run as in LitGPT (where --logger.project, --logger.name and --logger.group
    are not given); the others, and all of them with another tracker, have no effect and a note says so.

    Args:
        project: Weights & Biases project.
        run: Weights & Biases run name.
        group: Weights & Biases group.
        teamspace: Lightning AI teamspace.
        metadata: Tags for Lightning AI's logger.
        log_model: Upload checkpoints as artifacts.
        save_logs: Upload the terminal output.
        checkpoint_name: Name of uploaded checkpoints.
    """

    project: Optional[str] = None
    run: Optional[str] = None
    group: Optional[str] = None
    teamspace: Optional[str] = None
    metadata: Optional[dict] = None
    log_model: bool = False
    save_logs: bool = True
    checkpoint_name: Optional[str] = None

"""A training job: a recipe and the command's arguments, and everything from the first check to the trained model.

Entry points parse their arguments, build a `Job` and hand it to `launch`; every process of the run then executes
`run_job`: check the inputs, prepare the data, build the model the recipe describes, set it up on the devices,
restore a checkpoint, and give it all to the `Trainer`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from litgpt.args import ActivationCheckpointing, EvalArgs, LoggerArgs, TrainArgs
from litgpt.checkpoint.manager import CheckpointManager, check_disk_space, unwrap
from litgpt.checkpoint.run_lock import out_dir_claimed
from litgpt.checkpoint.store import check_writable
from litgpt.distributed.pipeline import keep_tied_copy
from litgpt.distributed.runtime import node_local_first, print_once, rank_zero_alone
from litgpt.distributed.topology import data_parallel
from litgpt.host_malloc import keep_freed_memory
from litgpt.loggers import start_tracking
from litgpt.precision import Precision
from litgpt.preemption import slurm_job_id
from litgpt.registry import ExtensionStrategy
from litgpt.tokenizer import Tokenizer, check_vocab_fits
from litgpt.train.objective import Objective
from litgpt.train.optimizer import base_learning_rate, build_optimizer, optimizer_spec
from litgpt.train.optimizer_in_backward import OptimizerInBackward, check_optimizer_in_backward
from litgpt.train.recipe import Recipe
from litgpt.train.run_record import write_run_args
from litgpt.train.state import TrainState
from litgpt.train.step_runner import step_runner
from litgpt.train.trainer import Trainer, TrainerSettings


@dataclass
class Job:
    """A training run's inputs, as the entry point resolved them."""

    recipe: Recipe
    out_dir: Path
    data: Any  # a litgpt.data.DataModule
    tokenizer_dir: Path
    train: TrainArgs
    eval: EvalArgs
    hyperparameters: dict  # the command's arguments, written to hyperparameters.yaml and run_args.json
    precision: Precision
    resume: Union[bool, str, Path] = False
    optimizer: Union[str, dict] = "AdamW"
    seed: int = 42
    profile: bool = False
    compile_blocks: bool = False  # torch.compile each transformer block (--compiler torch)
    timeout: float = 600.0  # seconds a collective may wait for the other ranks
    # Finetuning data lays samples out in a prompt style; pretraining data has none.
    prompt_style: Optional[Any] = None
    # torch.compile the training loss whole: the model's forward, the chunked head and the loss in one graph
    # (--compiler torch/auto on one CPU process, where it beats compiling each block)
    compile_loss: bool = False
    logger_name: str = "csv"  # the experiment tracker (--logger_name) and its run (--logger.*)
    logger: LoggerArgs = dataclasses.field(default_factory=LoggerArgs)
    # A LoRA run's base checkpoint (absolute), recorded in each checkpoint so merge/export find it from anywhere.
    base_checkpoint: Optional[Path] = None


def launch(fabric, job: Job) -> dict:
    """Start the run's processes (or join those a launcher started) and run the job in each."""
    return fabric.launch(run_job, job)


def run_job(fabric, job: Job) -> dict:
    """Check the inputs, prepare the data, build, shard and load the model, and train it; returns the metrics."""
    if fabric.device.type == "cpu":
        keep_freed_memory()  # the steps' tensors live in host memory: reuse it instead of faulting it in each step
    _, optimizer_class, _ = optimizer_spec(job.optimizer)  # a bad --optimizer stops the run before anything exists
    if job.train.optimizer_in_backward:
        check_optimizer_in_backward(job.train, optimizer_class, job.precision,
                                    job.train.gradient_accumulation_iters(data_parallel(fabric)[1]),
                                    isinstance(fabric.strategy, ExtensionStrategy))
    check_writable(job.out_dir)
    with out_dir_claimed(job.out_dir):  # one run per out_dir, the same folder on every node
        resume_dir = CheckpointManager.find_resume(job.out_dir, job.resume)
        if job.train.requeue and slurm_job_id() is None:
            print_once("Note: --train.requeue acts only in a Slurm job; here a stop signal saves and stops the run.")
        max_seq_length = job.train.seq_length(job.recipe.config)
        tokenizer = Tokenizer(job.tokenizer_dir)
        check_vocab_fits(tokenizer, job.recipe.config, job.tokenizer_dir)
        job.train.gradient_accumulation_iters(data_parallel(fabric)[1])  # fail early on impossible batch arithmetic
        fabric.seed_everything(job.seed)
        train_data, val_data = prepare_data(fabric, job, tokenizer, max_seq_length)
        style_used = getattr(job.data, "style", None)  # finetuning data records the prompt style it laid samples in
        if style_used is not None and style_used.name != job.recipe.config.prompt_style:
            # Checkpoints then name the style the model was tuned on, which `litgpt chat` will use.
            config = dataclasses.replace(job.recipe.config, prompt_style=style_used.name)
            job = dataclasses.replace(job, recipe=dataclasses.replace(job.recipe, config=config))
        return train_recipe(fabric, job, tokenizer, train_data, val_data, resume_dir)


def prepare_data(fabric, job: Job, tokenizer, max_seq_length: int):
    """Tokenize once and return (train, val) datasets: global rank 0 first, then the first process of every node (its
    cache may be on a node-local disk), then the others, who find the cache."""
    job.data.check_packing()
    job.data.connect(tokenizer, max_seq_length, job.prompt_style)
    with node_local_first("preparing the data"):
        job.data.prepare()
    return job.data.train_dataset(), job.data.val_dataset()


def train_recipe(fabric, job: Job, tokenizer, train_data, val_data, resume_dir: Optional[Path]) -> dict:
    """Build the recipe's model (and its frozen models) on the devices, its objective, optimizer and checkpoint
    manager, restore `resume_dir`, train, and finish final/ as the recipe asks."""
    recipe, train = job.recipe, job.train
    model = recipe.build_model()
    check_disk_space(job.out_dir, model, recipe.trains, train)
    load_initial = resume_dir is None or not recipe.checkpoint_holds_every_weight
    checkpointing = ActivationCheckpointing.parse(train.activation_checkpointing)
    model = recipe.materialize(fabric, model, job.precision, checkpointing, job.compile_blocks, load_initial,
                               train.offload_activations)
    model = fabric.setup(model)
    # Frozen models (a teacher, a reference) are the objective's alone: never in the optimizer or the checkpoints.
    frozen = recipe.materialize_frozen(fabric, job.precision, job.compile_blocks)
    frozen, train_data, val_data = recipe.prepare_samples(fabric, model, frozen, train_data, val_data,
                                                          train.micro_batch_size)
    objective = build_objective(fabric, job, model, frozen)
    io = checkpoint_io(fabric.strategy)  # after setup: a strategy that compiles the model knows its layout only now
    checkpoints = CheckpointManager(
        fabric, job.out_dir, io, keys=recipe.trains, weights_file=recipe.weights_file, config=recipe.config,
        hyperparameters=job.hyperparameters, tokenizer_dir=job.tokenizer_dir, keep_last=train.keep_last,
        precision=job.precision, base_checkpoint=job.base_checkpoint,
    )
    optimizer = training_optimizer(fabric, job, io.parameters(model))
    keep_tied_copy(unwrap(model), optimizer)
    base_lr = base_learning_rate(optimizer)  # before a restore overwrites it with the last scheduled value
    state = TrainState()
    if resume_dir is not None:
        checkpoints.restore(resume_dir, model, optimizer, state)
    if fabric.global_rank == 0:
        Path(job.out_dir).mkdir(parents=True, exist_ok=True)
        write_run_args(job.out_dir, job.hyperparameters)
    # Once every input is checked and the model loaded: a bad input leaves nothing on disk, the tracker's run included.
    with rank_zero_alone("starting the experiment tracker") as worker:
        if worker:
            start_tracking(fabric.loggers, job.hyperparameters)
    settings = TrainerSettings(train=train, eval=job.eval, out_dir=job.out_dir, precision=job.precision,
                               profile=job.profile, timeout=job.timeout, compiles_blocks=job.compile_blocks)
    runner = step_runner(fabric, model, objective, train.gradient_accumulation_iters(data_parallel(fabric)[1]),
                         train.micro_batch_size, train.seq_length(recipe.config))
    trainer = Trainer(
        fabric, model, optimizer, objective, runner, settings, tokenizer, checkpoints, state, base_lr,
        train_data=job.data.batches(train_data, train.micro_batch_size, job.seed, *data_parallel(fabric)),
        val_data=val_data,
    )
    metrics = trainer.fit()
    if trainer.stopped_by is None:
        with rank_zero_alone("finishing final/") as worker:  # a LoRA merge of a large model outlasts any timeout
            if worker:
                recipe.finish(checkpoints.final_dir)
                print_once(f"Saved the final checkpoint to {checkpoints.final_dir}")
                print_once(f"Try it: litgpt generate {checkpoints.final_dir} --prompt \"Once upon a time\"")
    return metrics


def training_optimizer(fabric, job: Job, parameters: list):
    """The run's optimizer: Fabric's wrapper of the --optimizer, or with --train.optimizer_in_backward one optimizer
    per parameter stepped in the backward pass (not given to Fabric: its wrapper steps an optimizer after the backward
    pass, through the precision plugin, and here nothing is left to step)."""
    if job.train.optimizer_in_backward:
        return OptimizerInBackward(lambda one: build_optimizer(job.optimizer, one, fabric.device), parameters)
    return fabric.setup_optimizers(build_optimizer(job.optimizer, parameters, fabric.device))


def build_objective(fabric, job: Job, model, frozen: dict) -> Objective:
    """The recipe's objective for this strategy (whole logits where the strategy's module is opaque), its training
    loss compiled whole with `job.compile_loss`, its head's loss compiled chunk by chunk where a GPU run compiles the
    blocks."""
    chunked = not (isinstance(fabric.strategy, ExtensionStrategy) and fabric.strategy.litgpt_loss_on_logits)
    objective = job.recipe.objective(frozen, job.train.loss_chunk_size, chunked)
    if job.compile_blocks and fabric.device.type == "cuda":  # measured there (benchmarks/gpu_profile.py)
        objective = objective.with_compiled_chunk_losses()
    context = getattr(fabric.strategy, "context_parallel", None)
    if context is not None:  # never with compile_loss, which is for one process
        return objective.over_positions(context)
    if not job.compile_loss:
        return objective
    gpt = unwrap(model)
    for local in {False, gpt.config.rope_local_base is not None}:
        gpt.rope_tables(fabric.device, local)  # built before tracing: a table built inside would recompile
    return objective.compiled()


def checkpoint_io(strategy):
    """The strategy's `CheckpointIO`: an extension strategy's own (`ExtensionStrategy.litgpt_checkpoint_io`, e.g.
    Thunder's), else FSDP2's."""
    # Imported here: they load Lightning, which the entry points import only after checking their arguments.
    from litgpt.checkpoint.fsdp_io import FSDPCheckpointIO
    from litgpt.distributed.fsdp import FSDPStrategy

    if isinstance(strategy, ExtensionStrategy):
        return strategy.litgpt_checkpoint_io
    if isinstance(strategy, FSDPStrategy):
        options = dataclasses.asdict(strategy.fsdp)
        return FSDPCheckpointIO(strategy.topology.sharding_strategy, strategy.fsdp.state_dict_type, options)
    return FSDPCheckpointIO()

"""How every training command starts its job: the logger, the compiler (the core's, or an extension found by name
that brings its own Fabric strategy), Fabric itself; then `litgpt.train.job.launch` runs the job in every process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from litgpt.args import FSDPArgs, ParallelArgs, TrainArgs
from litgpt.errors import UserError
from litgpt.registry import CORE_COMPILERS, CompilerExtension, load_compiler

if TYPE_CHECKING:
    from litgpt.train.job import Job
    from litgpt.train.recipe import Recipe


def run_fabric(job: "Job", *, devices, num_nodes: int, fsdp: FSDPArgs, run_name: str,
               compiler: Union[str, CompilerExtension] = "none", strategy: str = "auto", whole_loss: bool = True,
               parallel: ParallelArgs = ParallelArgs()):
    """The job's Fabric, logging to the job's tracker (`run_name` unless --logger.name names the run), with
    `parallel.tensor`-way tensor parallelism, `parallel.expert`-way expert parallelism and `parallel.context`-way
    context parallelism (`check_parallel`).

    `compiler`: auto, none or torch (`set_compilation`), the name of a registered extension, or
    an extension itself (its own entry point passes one with its options); the extension checks the job first and
    gives the Fabric strategy (`strategy`: --strategy auto|fsdp|ddp). `whole_loss`: torch.compile may compile the
    whole loss on one CPU process (a recipe with frozen models compiles their blocks instead)."""
    check_parallel(job, parallel, compiler)
    extension = None
    if not isinstance(compiler, str):
        extension = compiler
    elif compiler not in CORE_COMPILERS:
        extension = load_compiler(compiler)
    if extension is not None:
        if job.train.offload_activations:
            raise UserError(f"--train.offload_activations works with --compiler auto, none or torch; the "
                            f"{compiler if isinstance(compiler, str) else type(compiler).__name__} compiler runs "
                            "its own forward pass: leave the option off.")
        extension.check(job, fsdp)

    from litgpt.distributed.fabric import build_fabric  # Lightning: imported once the arguments are known to be good
    from litgpt.loggers import build_logger

    loggers = [build_logger(job.logger_name, job.out_dir, run_name, job.logger)]
    if extension is not None:
        return build_fabric(devices, num_nodes, job.precision, loggers=loggers,
                            strategy_for_world=lambda world: extension.strategy(world, strategy, fsdp.timeout))
    fabric = build_fabric(devices, num_nodes, job.precision, loggers=loggers, fsdp=fsdp, tensor=parallel.tensor,
                          expert=parallel.expert, context=parallel.context, pipeline=parallel)
    set_compilation(job, compiler, fabric.device, fabric.world_size, whole_loss)
    if parallel.pipeline > 1:
        check_pipeline_run(job, parallel, compiler, fabric)
    return fabric


def check_parallel(job: "Job", parallel: ParallelArgs, compiler) -> None:
    """UserError for any degree with a compiler extension (its strategy runs and splits the model its own way); for
    tensor parallelism the run cannot have: a model (or frozen model) the plans do not cover or whose sizes it does
    not divide; the same for expert parallelism (`check_expert_parallelism`), context parallelism
    (`check_context_parallelism`) and pipeline parallelism (`check_pipeline_model`)."""
    degrees = [(name, getattr(parallel, name)) for name in ("tensor", "expert", "context", "pipeline")]
    split = [(name, degree) for name, degree in degrees if degree > 1]
    if split and compiler not in CORE_COMPILERS:
        raise UserError(f"--parallel.{split[0][0]} {split[0][1]} works with --compiler auto, none or torch; an "
                        "extension compiler runs and splits the model its own way.")
    if parallel.pipeline > 1:
        check_pipeline_model(job.recipe, job.train, parallel)
        if parallel.context > 1 and getattr(job.data, "packing", False):
            raise UserError(f"--parallel.pipeline {parallel.pipeline} with --parallel.context {parallel.context} and "
                            "--data.packing is not supported yet (each packed micro-batch has its own attention mask "
                            "over the whole sequence): drop one of the three.")
    if parallel.expert > 1:
        check_expert_parallelism(job, parallel.expert)
    if parallel.context > 1:
        check_context_parallelism(job, parallel)
    if parallel.tensor == 1:
        return
    from litgpt.distributed.plans import check_tensor_parallel

    recipe = job.recipe
    for config in (recipe.config, *recipe.frozen_configs().values()):
        check_tensor_parallel(config, parallel.tensor, quantized=recipe.quantize is not None)


def check_expert_parallelism(job: "Job", degree: int) -> None:
    """UserError for expert parallelism the run cannot have: a dense model (or frozen model), experts the degree
    does not divide."""
    from litgpt.distributed.plans import check_expert_parallel

    check_expert_parallel(job.recipe.config, degree)
    for config in job.recipe.frozen_configs().values():
        if config.mlp_class_name == "LLaMAMoE":  # a dense teacher stays whole on every rank
            check_expert_parallel(config, degree)


def check_context_parallelism(job: "Job", parallel: ParallelArgs) -> None:
    """UserError for context parallelism the run cannot have: a model (or frozen model) whose attention it does not
    cover or whose heads the degrees do not divide."""
    from litgpt.distributed.plans import check_context_parallel

    for config in (job.recipe.config, *job.recipe.frozen_configs().values()):
        check_context_parallel(config, parallel.context, parallel.tensor)


def check_pipeline_model(recipe: "Recipe", train: TrainArgs, parallel: ParallelArgs) -> None:
    """UserError for pipeline parallelism the run cannot have: fewer blocks than stages, an optimizer stepped in the
    backward pass (the schedule scales the gradients after it). `litgpt plan` checks its plans with it too."""
    degree, stages, config = parallel.pipeline, parallel.pipeline_stages, recipe.config
    option = f"--parallel.pipeline {degree}"
    if config.n_layer < stages:
        raise UserError(f"{option} x {parallel.stages_per_rank} stage(s) per device makes {stages} pipeline stages, "
                        f"more than the model's {config.n_layer} layers: use fewer stages (a stage holds at least one "
                        "layer).")
    if train.optimizer_in_backward:
        raise UserError(f"{option} with --train.optimizer_in_backward is not supported yet: leave pipeline "
                        "parallelism out.")


def check_pipeline_run(job: "Job", parallel: ParallelArgs, compiler: str, fabric) -> None:
    """UserError for a pipeline run whose micro-batches per step do not fill the schedule
    (`check_microbatches`), or a zero-bubble schedule asked to run compiled blocks (its split backward pass runs
    eager only); --compiler auto leaves them eager."""
    from litgpt.distributed.pipeline import check_microbatches
    from litgpt.distributed.runtime import print_once
    from litgpt.distributed.topology import data_parallel

    accumulation = job.train.gradient_accumulation_iters(data_parallel(fabric)[1])
    check_microbatches(parallel.pipeline_schedule, parallel.pipeline_stages, parallel.pipeline, accumulation)
    if job.compile_blocks and "ZeroBubble" in parallel.pipeline_schedule:
        if compiler == "torch":
            raise UserError(f"--parallel.pipeline_schedule {parallel.pipeline_schedule} splits each backward pass in "
                            "two, which runs eager only: leave out --compiler torch, or use 1F1B or Interleaved1F1B.")
        job.compile_blocks = False
        print_once(f"Compiler: none (--parallel.pipeline_schedule {parallel.pipeline_schedule} runs eager)")


def set_compilation(job: "Job", compiler: str, device, world_size: int, whole_loss: bool = True) -> None:
    """What --compiler torch, none or auto (`auto_compiles`: this device and run length) compiles, said in one line:
    one CPU process compiles the whole loss (`Job.compile_loss`: forward, chunked head and loss in one graph,
    measured fastest there), GPUs and several processes (FSDP's hooks sit between the blocks) each block, and so
    does --train.offload_activations (its saved-tensor hooks stay outside compiled code)."""
    from litgpt.distributed.parallelize import auto_compiles
    from litgpt.distributed.runtime import print_once

    steps = job.train.planned_steps(job.train.max_seq_length or job.recipe.config.block_size)
    compiles = compiler == "torch" or (compiler == "auto" and auto_compiles(device, job.recipe.config, steps))
    whole_loss = whole_loss and not job.train.offload_activations
    job.compile_loss = compiles and whole_loss and device.type == "cpu" and world_size == 1
    job.compile_blocks = compiles and not job.compile_loss
    what = ("torch.compile of the whole loss (model, head and loss)" if job.compile_loss
            else "torch.compile of each transformer block" if job.compile_blocks else "none (eager)")
    why = f"--compiler auto on {device.type}{f' for {steps} steps' if steps is not None else ''}"
    print_once(f"Compiler: {what} ({why if compiler == 'auto' else f'--compiler {compiler}'})")

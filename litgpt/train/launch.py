"""How every training command starts its job: the logger, the compiler (the core's, or an extension found by name
that brings its own Fabric strategy), Fabric itself; then `litgpt.train.job.launch` runs the job in every process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from litgpt.args import FSDPArgs, ParallelArgs
from litgpt.errors import UserError
from litgpt.registry import CORE_COMPILERS, CompilerExtension, load_compiler

if TYPE_CHECKING:
    from litgpt.train.job import Job


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
                          expert=parallel.expert, context=parallel.context)
    set_compilation(job, compiler, fabric.device, fabric.world_size, whole_loss)
    return fabric


def check_parallel(job: "Job", parallel: ParallelArgs, compiler) -> None:
    """UserError for tensor parallelism the run cannot have: a model (or frozen model) the plans do not cover or
    whose sizes it does not divide, a compiler extension (its strategy splits the model its own way); the same for
    expert parallelism (`check_expert_parallelism`) and context parallelism (`check_context_parallelism`)."""
    if parallel.expert > 1:
        check_expert_parallelism(job, parallel.expert, compiler)
    if parallel.context > 1:
        check_context_parallelism(job, parallel, compiler)
    if parallel.tensor == 1:
        return
    from litgpt.distributed.plans import check_tensor_parallel

    refuse_extension_compiler(compiler, f"--parallel.tensor {parallel.tensor}", "shards the model its own way")
    recipe = job.recipe
    for config in (recipe.config, *recipe.frozen_configs().values()):
        check_tensor_parallel(config, parallel.tensor, quantized=recipe.quantize is not None)


def check_expert_parallelism(job: "Job", degree: int, compiler) -> None:
    """UserError for expert parallelism the run cannot have: a dense model (or frozen model), experts the degree
    does not divide, a compiler extension."""
    from litgpt.distributed.plans import check_expert_parallel

    refuse_extension_compiler(compiler, f"--parallel.expert {degree}", "shards the model its own way")
    check_expert_parallel(job.recipe.config, degree)
    for config in job.recipe.frozen_configs().values():
        if config.mlp_class_name == "LLaMAMoE":  # a dense teacher stays whole on every rank
            check_expert_parallel(config, degree)


def check_context_parallelism(job: "Job", parallel: ParallelArgs, compiler) -> None:
    """UserError for context parallelism the run cannot have: a model (or frozen model) whose attention it does not
    cover or whose heads the degrees do not divide, a compiler extension."""
    from litgpt.distributed.plans import check_context_parallel

    degree = parallel.context
    refuse_extension_compiler(compiler, f"--parallel.context {degree}", "runs its own attention")
    for config in (job.recipe.config, *job.recipe.frozen_configs().values()):
        check_context_parallel(config, degree, parallel.tensor)


def refuse_extension_compiler(compiler, option: str, because: str) -> None:
    """UserError when `compiler` is an extension's: `option` (a parallelism and its degree) needs the core's model,
    which the extension replaces (`because`: what it does its own way)."""
    if compiler not in CORE_COMPILERS:
        raise UserError(f"{option} works with --compiler auto, none or torch; an extension compiler {because}.")


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

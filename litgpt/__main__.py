"""The `litgpt` command line: `litgpt <command> [args]`.

Each command's module is imported only when that command runs, so `litgpt --help` starts without torch.
"""

from __future__ import annotations

import sys

# name -> ("module:function", one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "pretrain": ("litgpt.pretrain:setup", "Pretrain a model from scratch or continue pretraining."),
    "finetune_full": ("litgpt.finetune.full:setup", "Finetune all weights of a model."),
    "finetune_lora": ("litgpt.finetune.lora:setup", "Finetune a model with LoRA adapters (QLoRA with --quantize)."),
    "finetune": ("litgpt.finetune.lora:setup", "Same as finetune_lora."),
    "dpo": ("litgpt.dpo:setup", "Align a model on preference pairs: DPO, IPO, hinge, robust DPO, SimPO, ORPO."),
    "grpo": ("litgpt.grpo:setup", "Reinforcement learning on verifiable rewards of sampled completions: GRPO, Dr. GRPO, DAPO."),
    "distill": ("litgpt.distill:setup", "Distill a frozen teacher into a student (forward/reverse KL, Jensen-Shannon)."),
    "prepare": ("litgpt.prepare:setup", "Tokenize text, JSONL or Parquet files once into litdata's streaming format."),
    "download": ("litgpt.download:download", "Download a model from the Hugging Face hub and convert it."),
    "convert_to_litgpt": ("litgpt.convert.hf_to_litgpt:convert_hf_checkpoint", "Convert a Hugging Face model folder to litgpt."),
    "convert_from_litgpt": ("litgpt.convert.litgpt_to_hf:convert_lit_checkpoint", "Convert a litgpt checkpoint to a Hugging Face folder."),
    "generate": ("litgpt.generate:main", "Generate text from a prompt."),
    "chat": ("litgpt.chat:main", "Chat with a model interactively."),
    "serve": ("litgpt.serving.server:main", "Serve a model over HTTP with OpenAI's API (continuous batching)."),
    "merge_lora": ("litgpt.merge_lora:merge_lora", "Merge LoRA adapters into the base weights."),
    "compress_moe": ("litgpt.compress_moe:main", "Keep the most-routed experts of a mixture-of-experts model."),
    "consolidate": ("litgpt.consolidate:main", "Turn a sharded checkpoint into one lit_model.pth."),
    "evaluate": ("litgpt.evaluate:main", "Evaluate a model on lm-evaluation-harness tasks or a text file's perplexity."),
    "plan": ("litgpt.plan.command:main", "Estimate the memory per device of a training run before starting it."),
}

# ---- LitGPT 0.5.13's command names that are not ours (tests/fixtures/litgpt-0.5.13/commands.txt) ----------------
# Its name for one of our commands, or a command of LitGPT's that needs code of its own (litgpt/compat.py).
LITGPT_ALIASES: dict[str, tuple[str, str]] = {
    "generate_full": ("litgpt.generate:main", "LitGPT's name: same as generate (any model folder)."),
    "convert_pretrained_checkpoint": ("litgpt.compat:convert_pretrained_checkpoint",
                                      "Copy a pretraining checkpoint into a model folder of its own."),
}
# The ones not carried here: which of ours to use, and why (said in one line, exit code 1).
_ADAPTER = ("LLaMA-Adapter is not carried here; LoRA trains a similarly small set of weights with the same data, train "
            "and eval options: use `litgpt finetune_lora` (QLoRA with --quantize), whose final/ holds the merged model")
NOT_CARRIED: dict[str, str] = {
    "finetune_adapter": _ADAPTER + ".",
    "finetune_adapter_v2": _ADAPTER + ".",
    "generate_adapter": _ADAPTER + ": `litgpt generate OUT_DIR/final` then needs no adapter command.",
    "generate_adapter_v2": _ADAPTER + ": `litgpt generate OUT_DIR/final` then needs no adapter command.",
    "generate_sequentially": ("layers spread over several GPUs in turn are not carried here; `litgpt generate "
                              "--parallel.tensor N` splits a model too large for one device over N devices of one "
                              "machine, and --quantize bnb.nf4 (4-bit weights) fits one about four times larger on one "
                              "device."),
    "generate_tp": ("tensor-parallel generation is `litgpt generate --parallel.tensor N` here (N devices of one machine, "
                    "each holding 1/N of every layer; `litgpt serve` takes the flag too)."),
    "generate_speculatively": ("speculative decoding with a draft model is not carried here; use `litgpt generate` "
                               "(one model, greedy or sampled)."),
    "validate": ("LitGPT's pre-flight check is not carried here: `litgpt generate CHECKPOINT_DIR --max_new_tokens 1` "
                 "checks the folder's files and every weight against its config, and `litgpt plan` estimates the "
                 "memory of a training run."),
}

# Commands whose first argument may be given without its flag (`litgpt pretrain pythia-14m`).
OPTIONAL_POSITIONAL = {"pretrain": "model_name", "plan": "model_name", "distill": "student_dir"}


def print_commands() -> None:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: litgpt <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {description}" for name, (_, description) in COMMANDS.items()]
    litgpt_names = ", ".join([*LITGPT_ALIASES, *NOT_CARRIED])
    lines += ["", f"LitGPT's command names work too: {litgpt_names}", "(some say which command to use instead; "
              "see tutorials/coming_from_litgpt.md)."]
    lines += ["", "`litgpt <command> --help` shows a command's options; `--config FILE.yaml` reads them from YAML."]
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print_commands()
        return
    name, args = argv[0], argv[1:]
    if name in NOT_CARRIED:
        print(f"litgpt {name}: {NOT_CARRIED[name]}", file=sys.stderr)
        sys.exit(1)
    if name not in COMMANDS and name not in LITGPT_ALIASES:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        print(f"litgpt: unknown command {name!r}.{hint} `litgpt --help` lists the commands.", file=sys.stderr)
        sys.exit(1)
    run_command(name, args)


def exit_failed() -> None:
    """Exit with code 1. A process of a distributed run leaves at once: tearing down a process group whose peers
    are gone can abort the interpreter (SIGABRT) instead of exiting cleanly. The ranks it started (Fabric starts
    ranks 1.. as its children) go too, so that none is left waiting on a collective that will never come."""
    import os

    from litgpt.distributed.runtime import distributed_is_up

    stop_child_processes()
    if distributed_is_up():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(1)


def stop_child_processes(grace_seconds: float = 2.0) -> None:
    """SIGKILL this process's children that have not exited within `grace_seconds` (Linux: /proc lists them)."""
    import glob
    import os
    import signal
    import time

    children = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            children.update(int(pid) for pid in open(path).read().split())
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_seconds
    while children and time.monotonic() < deadline:
        children = {pid for pid in children if os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)}
        time.sleep(0.1)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _is_zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def distributed_failure_message(prog: str, error: BaseException) -> "str | None":
    """One line for a failure of the distributed layer itself (another rank died or hung, the ranks never met), or
    None if that is not what happened. Recognized by type: torch raises DistStoreError / DistNetworkError when the
    rendezvous fails and DistBackendError (NCCL) when a collective does; gloo's collectives raise a plain
    RuntimeError for a dead peer and a timeout alike, so for gloo it is that type raised inside a collective."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    from litgpt.distributed.runtime import distributed_is_up

    error = first_checkpoint_failure(error)
    if not distributed_is_up():
        if isinstance(error, dist.DistStoreError):
            return (f"{prog}: error: not every rank joined the run within --fsdp.timeout. Check that the launcher "
                    "starts --devices x --num_nodes processes and that MASTER_ADDR/MASTER_PORT reach rank 0; a slow "
                    "start-up needs a larger --fsdp.timeout.")
        if isinstance(error, dist.DistNetworkError):
            return (f"{prog}: error: this rank could not reach rank 0 at MASTER_ADDR/MASTER_PORT "
                    f"({' '.join(str(error).split())[:200]}). Check that rank 0 runs and that the address and port "
                    "are reachable from this node.")
        return None
    if isinstance(error, dist.DistError) or raised_by_a_collective(error):
        # The same words on every rank, so that print_error_once prints them once.
        return (f"{prog}: error: another rank died or stopped answering within --fsdp.timeout (a collective raised "
                f"{type(error).__name__}). Look for that rank's error above, or for a hung node.")
    return None


def first_checkpoint_failure(error: BaseException) -> BaseException:
    """The first rank's exception inside torch.distributed.checkpoint's CheckpointException, else `error`."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    if api is not None and isinstance(error, api.CheckpointException):
        cause = next(iter(error.failures.values()), (error, None))
        return cause[0] if isinstance(cause, tuple) else cause
    return error


def raised_by_a_collective(error: BaseException) -> bool:
    """A plain RuntimeError raised inside a torch.distributed collective (c10d or functional collectives)."""
    import traceback

    if type(error) is not RuntimeError:
        return False
    collective_modules = ("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py")
    return any(frame.filename.replace("\\", "/").endswith(collective_modules)
               for frame in traceback.extract_tb(error.__traceback__))


MODEL_CONFIG_OPTIONS = ("--model_config", "--teacher_config")


def model_config_files_read(args: list[str]) -> list[str]:
    """`args` with each --model_config / --teacher_config FILE replaced by the config it holds, in our fields.

    The model_config.yaml that our runs and LitGPT write holds LitGPT's field names (so that LitGPT reads our
    folders); `Config.from_file` reads both, the parser knows only ours."""
    import json
    from pathlib import Path

    from litgpt.config import Config

    def read(value: str) -> str:
        return json.dumps(Config.from_file(value).to_dict()) if Path(value).is_file() else value

    result, position = [], 0
    while position < len(args):
        arg = args[position]
        name, equals, value = arg.partition("=")
        if name in MODEL_CONFIG_OPTIONS and equals:
            result.append(f"{name}={read(value)}")
        elif arg in MODEL_CONFIG_OPTIONS and position + 1 < len(args):
            result += [arg, read(args[position + 1])]
            position += 1
        else:
            result.append(arg)
        position += 1
    return result


def check_config_files(args: list[str]) -> None:
    """Name a --config file that is not valid YAML, with the place of the problem (jsonargparse names neither)."""
    import os

    import yaml

    from litgpt.errors import UserError

    for index, arg in enumerate(args):
        path = args[index + 1] if arg == "--config" and index + 1 < len(args) else arg.partition("--config=")[2]
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    yaml.safe_load(f)
            except yaml.YAMLError as error:
                raise UserError(f"--config {path!r} is not valid YAML: {' '.join(str(error).split())}") from None


def wrapped_user_error(error: BaseException) -> "Exception | None":
    """The UserError behind an error of jsonargparse's, which wraps what an argument's class raised while it built
    it (e.g. a --model_config whose n_embd does not divide by n_head)."""
    from litgpt.errors import UserError

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def run_command(name: str, args: list[str]) -> None:
    import gc
    import importlib

    module_name, function_name = {**COMMANDS, **LITGPT_ALIASES}[name][0].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    # What the imports made (torch, Lightning: ~450,000 objects) lives as long as the process: out of the collector's
    # generations, neither a full collection during the run nor the one at exit walks it (~1 s of CPU per process).
    gc.freeze()
    if name in OPTIONAL_POSITIONAL and args and not args[0].startswith("-"):
        args = [f"--{OPTIONAL_POSITIONAL[name]}", *args]
    run_cli(function, args, prog=f"litgpt {name}")


def raised_by_the_parser(error: Exception) -> bool:
    """Whether `error` comes from inside jsonargparse (a combination of options it trips over), not from our code."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and "jsonargparse" in frames[-1].filename


def run_cli(function, args: list[str], prog: str) -> None:
    """Parse `args` for `function` and call it; every failure the user can fix becomes one line and exit code 1."""
    from jsonargparse import CLI, ArgumentError

    from litgpt.class_paths import check_class_paths
    from litgpt.distributed.runtime import print_error_once
    from litgpt.errors import UserError

    try:
        check_config_files(args)
        check_class_paths(args)  # before the parser, which imports a class path's module as it reads it
        args = model_config_files_read(args)
        CLI(function, args=args, prog=prog, as_positional=True, exit_on_error=False)
    except ArgumentError as error:
        # jsonargparse spreads one problem over indented lines; join them into one.
        message = " ".join(line.strip() for line in str(error).strip().splitlines())
        print(f"{prog}: error: {message} (`{prog} --help` lists the options)", file=sys.stderr)
        sys.exit(1)
    except UserError as error:
        print_error_once(f"{prog}: error: {error}")
        exit_failed()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # The reader of our output went away (`litgpt download list | head`): stop quietly.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except BaseException as error:  # Exception, or DCP's CheckpointException (a BaseException); others go on
        if not isinstance(error, Exception) and first_checkpoint_failure(error) is error:
            raise
        user_error = wrapped_user_error(error)
        if user_error is not None:
            print_error_once(f"{prog}: error: {user_error}")
            exit_failed()
        if raised_by_the_parser(error):
            print(f"{prog}: error: the arguments could not be read ({type(error).__name__}: {error}); give each "
                  f"option once, in the form `{prog} --help` shows", file=sys.stderr)
            sys.exit(1)
        peer_failure = distributed_failure_message(prog, error)
        if peer_failure is not None:
            print_error_once(peer_failure)
            exit_failed()
        if type(error).__name__ != "OutOfMemoryError":  # torch's, named so that this module need not import torch
            from litgpt.distributed.runtime import distributed_is_up, launcher_rank

            if distributed_is_up():  # a bug: its traceback marked with the rank, then leave without waiting on peers
                import traceback

                rank = f"[rank {launcher_rank()}]"
                print("\n".join(f"{rank} {line}" for line in traceback.format_exc().splitlines()), file=sys.stderr)
                exit_failed()
            raise
        print_error_once(
            f"{prog}: error: out of GPU memory ({str(error).splitlines()[0]}). Lower --train.micro_batch_size "
            "(the global batch stays the same), add --train.activation_checkpointing true, use more devices with "
            "--fsdp.sharding_strategy FULL_SHARD, or --fsdp.cpu_offload true; `litgpt plan` estimates the memory."
        )
        exit_failed()


if __name__ == "__main__":
    main()

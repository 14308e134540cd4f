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
    "download": ("litgpt.download:download", "Download a model from the Hugging Face hub and convert it."),
    "convert_to_litgpt": ("litgpt.convert.hf_to_litgpt:convert_hf_checkpoint", "Convert a Hugging Face model folder to litgpt."),
    "convert_from_litgpt": ("litgpt.convert.litgpt_to_hf:convert_lit_checkpoint", "Convert a litgpt checkpoint to a Hugging Face folder."),
    "generate": ("litgpt.generate:main", "Generate text from a prompt."),
    "chat": ("litgpt.chat:main", "Chat with a model interactively."),
    "merge_lora": ("litgpt.merge_lora:merge_lora", "Merge LoRA adapters into the base weights."),
    "consolidate": ("litgpt.consolidate:main", "Turn a sharded checkpoint into one lit_model.pth."),
    "plan": ("litgpt.plan:main", "Estimate the memory per device of a training run before starting it."),
}

# Commands whose first argument may be given without its flag (`litgpt pretrain pythia-14m`).
OPTIONAL_POSITIONAL = {"pretrain": "model_name", "plan": "model_name"}


def print_commands() -> None:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: litgpt <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {description}" for name, (_, description) in COMMANDS.items()]
    lines += ["", "`litgpt <command> --help` shows a command's options; `--config FILE.yaml` reads them from YAML."]
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print_commands()
        return
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        print(f"litgpt: unknown command {name!r}.{hint} `litgpt --help` lists the commands.", file=sys.stderr)
        sys.exit(1)
    run_command(name, args)


def print_error_once(text: str) -> None:
    """Print an error; in a run of several processes, once per machine however many ranks hit it, with the rank.

    The first rank to fail claims the message with an exclusive file; a claim older than a minute is from another run.
    """
    import hashlib
    import os
    import tempfile
    import time

    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or "1")
    if world > 1:
        rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or os.environ.get("LOCAL_RANK", "0")
        run_id = os.environ.get("MASTER_PORT", "") + os.environ.get("SLURM_JOB_ID", "")
        digest = hashlib.sha1(f"{run_id}{text}".encode()).hexdigest()[:16]
        claim = os.path.join(tempfile.gettempdir(), f"litgpt-error-{digest}")
        try:
            if time.time() - os.path.getmtime(claim) > 60:
                os.unlink(claim)
        except OSError:
            pass
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another rank of this run printed it
        text = f"[rank {rank}] {text}"
    print(text, file=sys.stderr)


def exit_failed() -> None:
    """Exit with code 1. A process of a distributed run leaves at once: tearing down a process group whose peers
    are gone can abort the interpreter (SIGABRT) instead of exiting cleanly."""
    import os

    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(1)


def run_command(name: str, args: list[str]) -> None:
    import importlib

    from jsonargparse import CLI

    from litgpt.errors import UserError

    from jsonargparse import ArgumentError

    module_name, function_name = COMMANDS[name][0].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    if name in OPTIONAL_POSITIONAL and args and not args[0].startswith("-"):
        args = [f"--{OPTIONAL_POSITIONAL[name]}", *args]
    try:
        CLI(function, args=args, prog=f"litgpt {name}", as_positional=True, exit_on_error=False)
    except ArgumentError as error:
        # jsonargparse spreads one problem over indented lines; join them into one.
        message = " ".join(line.strip() for line in str(error).strip().splitlines())
        print(f"litgpt {name}: error: {message} (`litgpt {name} --help` lists the options)", file=sys.stderr)
        sys.exit(1)
    except UserError as error:
        print_error_once(f"litgpt {name}: error: {error}")
        exit_failed()
    except KeyboardInterrupt:
        print(f"litgpt {name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        if type(error).__name__ != "OutOfMemoryError":  # torch's, named so that this module need not import torch
            raise
        print_error_once(
            f"litgpt {name}: error: out of GPU memory ({str(error).splitlines()[0]}). Lower --train.micro_batch_size "
            "(the global batch stays the same), add --train.activation_checkpointing true, use more devices with "
            "--fsdp.sharding_strategy FULL_SHARD, or --fsdp.cpu_offload true; `litgpt plan` estimates the memory."
        )
        exit_failed()
    except BrokenPipeError:
        # The reader of our output went away (`litgpt download list | head`): stop quietly.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    main()

"""`litgpt evaluate`: lm-evaluation-harness tasks, and the perplexity of a text file, on a litgpt checkpoint.

The harness runs on our own `GPT` (`litgpt.evaluation.harness.HarnessModel`): the weights of lit_model.pth are used
in place, no Hugging Face copy is written. Needs `pip install lm-eval`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional, Union

from litgpt.errors import UserError

RESULTS_FILE = "results.json"


def main(
    checkpoint_dir: Path,
    tasks: Optional[str] = None,
    *,
    perplexity: Optional[Path] = None,
    stride: Optional[int] = None,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    batch_size: Union[int, str] = 1,
    out_dir: Optional[Path] = None,
    include_path: Optional[Path] = None,
    max_length: Optional[int] = None,
    seed: int = 1234,
    precision: Optional[str] = None,
    device: str = "auto",
    devices: Union[int, str] = 1,
    apply_chat_template: bool = False,
    system_instruction: Optional[str] = None,
    fewshot_as_multiturn: Optional[bool] = None,
    dtype: Optional[str] = None,
    save_filepath: Optional[Path] = None,
    backend: str = "litgpt",
) -> None:
    """Evaluate a litgpt checkpoint on lm-evaluation-harness tasks, or measure its perplexity on a text file.

    Writes OUT_DIR/results.json (atomically) and prints a table. Offline (HF_HUB_OFFLINE=1) a task's data must be in
    the Hugging Face cache or be local files named by a task folder of `--include_path`.

    Args:
        checkpoint_dir: Folder with lit_model.pth, model_config.yaml and the tokenizer files.
        tasks: Comma-separated lm-eval task, group or tag names, e.g. "hellaswag,arc_easy", or tasks of
            `--include_path`; a name with wildcards (`mmlu_*`, `arc_?asy`) stands for every task it matches.
        perplexity: A UTF-8 text file: report its token-level mean negative log-likelihood and perplexity instead of
            (or beside) tasks. Every token of the file is predicted, the first from the BOS token (EOS without one).
        stride: Perplexity's sliding window: each window of `max_length` tokens scores the `stride` tokens after those
            scored before, which thus see at least max_length - stride tokens of context. Default: max_length // 2.
        num_fewshot: Examples put before each question (default: each task's own).
        limit: Evaluate only the first N examples of each task (a fraction < 1: that share of them).
        batch_size: Sequences scored per forward pass, or "auto": the most full-length sequences that fit (tried
            on a GPU, halving from 64 on out-of-memory; estimated from the free memory on a CPU).
        out_dir: Where results.json goes. Default: CHECKPOINT_DIR/evaluate.
        include_path: A folder of your own lm-eval task YAMLs (searched recursively), e.g. tasks on local files.
        max_length: The most tokens the model sees at once (default and maximum: the model's block_size).
        seed: Seed of the harness's sampling of few-shot examples, of torch, and of the tokens drawn by tasks whose
            generation_kwargs ask for sampling (do_sample, temperature, top_k, top_p; greedy otherwise).
        precision: The weights' precision: 32-true, 16-true or bf16-true. Default: bf16-true on GPUs
            (16-true without bf16 support) and on CPUs with native bf16 (AVX512-BF16 or AMX),
            32-true on other CPUs.
        device: Where to run: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.
        devices: Processes that evaluate the tasks together (data parallel), each on its share of the documents:
            GPUs 0..N-1 with --device cuda or auto, N CPU processes (gloo) with --device cpu. The metrics are those
            of one process.
        apply_chat_template: Lay each prompt out as a chat with the checkpoint's own chat template (its prompt
            style where the folder has none), as lm-eval's --apply_chat_template.
        system_instruction: A system message put before each prompt (with --apply_chat_template; as plain text
            before the prompt without it).
        fewshot_as_multiturn: Few-shot examples as earlier turns of the chat. Default: on with
            --apply_chat_template (which it needs).
        dtype: LitGPT's name for --precision (float32, bfloat16, float16); give one of the two.
        save_filepath: Where the results JSON goes instead of OUT_DIR/results.json (as in LitGPT).
        backend: "litgpt" runs the tasks on our model, on lit_model.pth as it is. "hf" runs them on lm-eval's
            transformers model instead, on a Hugging Face copy it writes to OUT_DIR/hf_model once (as LitGPT did).
            --perplexity always runs on our model.
    """
    from litgpt.checkpoint.model_files import find_checkpoint_dir
    from litgpt.distributed.runtime import node_local_first
    from litgpt.evaluation.batch_size import parse_batch_size

    checkpoint_dir = find_checkpoint_dir(Path(checkpoint_dir))
    if dtype is not None and precision is not None:
        raise UserError("Give either --precision or --dtype (LitGPT's name for it), not both.")
    precision = precision or dtype
    if backend not in ("litgpt", "hf"):
        raise UserError(f"--backend must be 'litgpt' (our model, the default) or 'hf' (transformers), got {backend!r}.")
    batch_size = parse_batch_size(batch_size)
    task_names = check_arguments(tasks, perplexity, limit, num_fewshot, stride, include_path)
    fewshot_as_multiturn = check_chat_options(apply_chat_template, fewshot_as_multiturn, task_names)
    text = read_text_file(perplexity) if perplexity is not None else None
    task_manager, task_names = find_tasks(task_names, include_path) if task_names else (None, [])
    rank, world_size, device = start_ranks(devices, device, backend, perplexity)
    if task_manager is not None:
        with node_local_first("loading the tasks' data"):  # rank 0 fills the datasets cache, the others read it
            load_task_data(task_manager, task_names)

    out_dir = Path(out_dir) if out_dir is not None else checkpoint_dir / "evaluate"
    report: dict = {"checkpoint_dir": str(checkpoint_dir), "backend": backend}
    lm = None
    if perplexity is not None or backend == "litgpt":
        lm = litgpt_harness_model(checkpoint_dir, precision, device, batch_size, max_length, seed,
                                  apply_chat_template, rank, world_size)
    if task_manager is not None:
        task_lm = lm if backend == "litgpt" else hf_harness_model(
            checkpoint_dir, out_dir / "hf_model", precision, device, batch_size, max_length)
        chat = {"apply_chat_template": apply_chat_template, "system_instruction": system_instruction,
                "fewshot_as_multiturn": fewshot_as_multiturn}
        results = run_tasks(task_lm, task_names, task_manager, num_fewshot, limit, seed, chat)
        if results is None:  # a rank other than 0: rank 0 has gathered the metrics and reports them
            return
        report.update(results, batch_size=task_lm.batch_size)
    if text is not None:
        report["perplexity"] = file_perplexity(lm, perplexity, text, stride or max(1, lm.max_length // 2))
    write_report(report, Path(save_filepath) if save_filepath is not None else out_dir / RESULTS_FILE)


def checked_max_length(max_length: Optional[int], block_size: int) -> int:
    if max_length is not None and not 1 < max_length <= block_size:
        raise UserError(f"--max_length must be in 2..{block_size} (the model's block_size), got {max_length}.")
    return max_length or block_size


def litgpt_harness_model(checkpoint_dir: Path, precision, device: str, batch_size, max_length, seed: int,
                         apply_chat_template: bool, rank: int, world_size: int):
    """The harness's model over our GPT with the weights of lit_model.pth; with `apply_chat_template`, the
    checkpoint's chat format lays out lm-eval's chats."""
    from litgpt.chat_template import ChatFormat
    from litgpt.evaluation.batch_size import auto_batch_size
    from litgpt.evaluation.harness import HarnessModel
    from litgpt.generate import load_model_and_tokenizer

    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(checkpoint_dir, precision, device)
    max_length = checked_max_length(max_length, model.config.block_size)
    print(f"Loaded the model from {str(checkpoint_dir)!r} in {time.perf_counter() - start:.02f} s.", file=sys.stderr)
    if batch_size == "auto":
        batch_size = auto_batch_size(model, max_length)
    chat_format = ChatFormat.from_checkpoint(checkpoint_dir, tokenizer, model.config) if apply_chat_template else None
    return HarnessModel(model, tokenizer, batch_size=batch_size, max_length=max_length, seed=seed,
                        chat_format=chat_format, rank=rank, world_size=world_size)


def hf_harness_model(checkpoint_dir: Path, hf_dir: Path, precision, device: str, batch_size: int, max_length):
    """lm-eval's own transformers model (HFLM) on a Hugging Face copy of the checkpoint in `hf_dir`, written by
    `convert_from_litgpt` unless the folder holds one already (delete it to convert again)."""
    from lm_eval.models.huggingface import HFLM

    from litgpt.config import Config
    from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint
    from litgpt.generate import announce_precision, resolve_device, resolve_precision

    max_length = checked_max_length(max_length, Config.from_checkpoint(checkpoint_dir).block_size)
    target = resolve_device(device)
    dtype = resolve_precision(precision, target)
    if (hf_dir / "config.json").is_file():
        print(f"Using the Hugging Face copy in {str(hf_dir)!r} (delete it to convert again).", file=sys.stderr)
    else:
        convert_lit_checkpoint(checkpoint_dir, hf_dir)
    model = HFLM(pretrained=str(hf_dir), backend="causal", batch_size=batch_size, max_length=max_length,
                 device=str(target), dtype=str(dtype).removeprefix("torch."))
    announce_precision(precision, dtype, target)
    return model


def check_arguments(tasks, perplexity, limit, num_fewshot, stride, include_path) -> list[str]:
    """The task names; UserError for bad options, before anything heavy runs."""
    task_names = [name.strip() for name in (tasks or "").split(",") if name.strip()]
    if not task_names and perplexity is None:
        raise UserError("Name what to evaluate: --tasks NAME[,NAME...] (lm-eval tasks) and/or --perplexity FILE.txt.")
    if task_names:
        import_lm_eval()
    if limit is not None and not limit > 0:
        raise UserError(f"--limit must be > 0 (a count of examples, or a fraction below 1), got {limit}.")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num_fewshot must be >= 0, got {num_fewshot}.")
    if stride is not None and stride < 1:
        raise UserError(f"--stride must be >= 1, got {stride}.")
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include_path {str(include_path)!r} is not a folder; give the folder of your task YAMLs.")
    return task_names


def check_chat_options(apply_chat_template: bool, fewshot_as_multiturn: Optional[bool], task_names: list[str]) -> bool:
    """--fewshot_as_multiturn as lm-eval's CLI resolves it: by default on exactly when a chat template is applied."""
    if apply_chat_template and not task_names:
        raise UserError("--apply_chat_template lays out the prompts of tasks: give --tasks (perplexity reads the "
                        "text as it is).")
    if fewshot_as_multiturn and not apply_chat_template:
        raise UserError("--fewshot_as_multiturn puts the few-shot examples in earlier chat turns: it needs "
                        "--apply_chat_template.")
    return bool(apply_chat_template) if fewshot_as_multiturn is None else fewshot_as_multiturn


def import_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError("`litgpt evaluate --tasks` needs lm-evaluation-harness: `pip install lm-eval`.") from None


def find_tasks(patterns: list[str], include_path: Optional[Path]):
    """(the TaskManager, the task/group/tag names) that `patterns` name, wildcards expanded as lm-eval's CLI does
    (`TaskManager.match_tasks`). The user's folder is indexed alone first: indexing lm-eval's own thousands of tasks
    takes seconds, and is needed only for a pattern that matches nothing there."""
    from lm_eval.tasks import TaskManager

    manager = None
    if include_path is not None:
        manager = TaskManager(include_path=str(include_path), include_defaults=False, verbosity="ERROR")
        if not all(matching_tasks(manager, pattern) for pattern in patterns):
            manager = None
    if manager is None:
        include = str(include_path) if include_path is not None else None
        manager = TaskManager(include_path=include, verbosity="ERROR")
    names: list[str] = []
    for pattern in patterns:
        found = matching_tasks(manager, pattern)
        if not found:
            raise UserError(unknown_task_message(pattern, manager.all_tasks, include_path))
        names.extend(name for name in found if name not in names)
    return manager, names


def matching_tasks(manager, pattern: str) -> list[str]:
    return [pattern] if pattern in manager.all_tasks else manager.match_tasks([pattern])


def unknown_task_message(pattern: str, known: list[str], include_path: Optional[Path]) -> str:
    import difflib

    where = f"in --include_path {str(include_path)!r} nor " if include_path is not None else ""
    close = difflib.get_close_matches(pattern, known, n=5, cutoff=0.6)
    hint = f" (close: {', '.join(close)})" if close else ""
    return (f"Task {pattern!r} matches nothing {where}among lm-eval's tasks{hint}: check the name (`lm-eval ls "
            "tasks`), or write a task YAML with local data files into a folder and pass it with --include_path FOLDER.")


def load_task_data(manager, task_names: list[str]) -> None:
    """Load each task's data once (bad input fails here, before the model is loaded; the harness loads them again,
    from the datasets cache)."""
    try:
        manager.load(task_names)
    except Exception as error:  # datasets raises many types (offline, missing file, bad config): name the cause
        cause = " ".join(str(error).split())[:300]
        raise UserError(
            f"The data of task(s) {', '.join(task_names)} could not be loaded ({type(error).__name__}: {cause}). "
            "Offline (HF_HUB_OFFLINE=1) a task's dataset must be in the Hugging Face cache, or be local files named "
            "by a task YAML of --include_path (dataset_path: json, dataset_kwargs: {data_files: ...})."
        ) from None


def start_ranks(devices, device: str, backend: str, perplexity: Optional[Path]) -> tuple[int, int, str]:
    """(this process's rank, the number of processes, its device). With --devices N > 1 Fabric starts the other
    N - 1 processes (each runs this command again) and the process group (gloo on CPUs, NCCL on GPUs)."""
    from litgpt.distributed.fabric import resolve_devices
    from litgpt.generate import resolve_device

    target = resolve_device(device)
    count = resolve_devices(devices, on_cpu=target.type == "cpu")
    if count == 1:
        return 0, 1, device
    if backend != "litgpt" or perplexity is not None:
        raise UserError(f"--devices {count} evaluates tasks on litgpt's model: --backend hf and --perplexity run "
                        "in one process (--devices 1).")
    if target.type == "mps" or target.index is not None:
        raise UserError(f"--devices {count} runs on GPUs 0..{count - 1} (--device cuda or auto) or on CPUs (--device "
                        f"cpu), not on {device!r}.")
    if target.type == "cpu" and count > (os.cpu_count() or 1):
        raise UserError(f"--devices {count} asks for more CPU processes than this machine has cores "
                        f"({os.cpu_count()}): use at most that many.")
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        fabric = Fabric(accelerator=target.type, devices=count, strategy="ddp")
    except (ValueError, RuntimeError, TypeError, MisconfigurationException) as error:
        raise UserError(f"Cannot set up the devices: {' '.join(str(error).split())}") from None
    fabric.launch()
    return fabric.global_rank, fabric.world_size, str(fabric.device)


def run_tasks(lm, task_names: list[str], manager, num_fewshot: Optional[int], limit: Optional[float],
              seed: int, chat: dict) -> Optional[dict]:
    """Run the harness (`chat`: its apply_chat_template, system_instruction and fewshot_as_multiturn); returns the
    parts of its results worth keeping, and prints its table. None on ranks other than 0."""
    from lm_eval import simple_evaluate
    from lm_eval.utils import make_table

    results = simple_evaluate(
        lm,
        tasks=task_names,
        task_manager=manager,
        num_fewshot=num_fewshot,
        limit=limit,
        log_samples=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        **chat,
    )
    if results is None:
        return None
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    kept = ("results", "groups", "group_subtasks", "n-shot", "n-samples", "versions", "higher_is_better")
    return {key: results[key] for key in kept if key in results}


def read_text_file(path: Path) -> str:
    """The text of --perplexity's file; UserError when it is missing, not UTF-8 or empty."""
    if not Path(path).is_file():
        raise UserError(f"--perplexity {str(path)!r} is not a file; give a UTF-8 text file.")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"--perplexity {str(path)!r} is not UTF-8 text ({error}).") from None
    if not text:
        raise UserError(f"--perplexity {str(path)!r} is empty: give a file with text to score.")
    return text


def file_perplexity(lm, path: Path, text: str, stride: int) -> dict:
    """Mean negative log-likelihood per token (nats) and perplexity of `text` (read from `path`), with
    `lm.rolling_scores`' sliding windows of `lm.max_length` tokens moving by `stride`."""
    tokens = lm.tok_encode(text, add_special_tokens=False)
    if not tokens:
        raise UserError(f"--perplexity {str(path)!r} holds no text to score (its text gives no tokens).")
    stride = min(stride, lm.max_length)
    nll = -sum(score for score, _ in lm.rolling_scores(tokens, stride=stride))
    mean_nll = nll / len(tokens)
    result = {"file": str(path), "tokens": len(tokens), "mean_nll": mean_nll, "perplexity": math.exp(mean_nll),
              "max_length": lm.max_length, "stride": stride}
    print(f"perplexity of {str(path)!r}: {result['perplexity']:.4f} (mean NLL {mean_nll:.4f} nats over "
          f"{len(tokens)} tokens; windows of {lm.max_length} tokens, stride {stride})")
    return result


def write_report(report: dict, path: Path) -> None:
    from litgpt.io import atomic_write_text

    default = str
    if "results" in report:
        from lm_eval.utils import handle_non_serializable as default
    atomic_write_text(path, json.dumps(report, indent=2, default=default) + "\n")
    print(f"Results written to {str(path)!r}.", file=sys.stderr)

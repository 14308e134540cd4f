"""`litgpt prepare`: tokenize a corpus once into litdata's optimized format, for `--data LitData` to stream to every
node (or litdata's own `StreamingDataset` to read).

litdata's `optimize` does the work: the input files are spread over `--num_workers` processes, each writing chunks of
token ids, with its progress bar. It checkpoints after every chunk (`.checkpoints/` in the output folder), so the same
command after a kill goes on from there. `index.json` is written last, so a folder without it is never mistaken for a
complete one; `litgpt_tokenizer.json` beside it records the tokenizer, which training checks against its own.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from functools import partial
from pathlib import Path
from typing import Optional

from litgpt.errors import UserError


def setup(
    input_dir: Path = Path("data/text"),
    output_dir: Path = Path("data/optimized"),
    tokenizer_dir: Optional[Path] = None,
    text_field: str = "text",
    num_workers: Optional[int] = None,
    chunk_bytes: str = "64MB",
) -> None:
    """Tokenize text files, JSON Lines and Parquet files into a litdata optimized folder.

    Args:
        input_dir: A folder searched recursively for .txt (each file one document), .jsonl and .parquet files (one
            document per record, its text in `text_field`), or one such file.
        output_dir: The folder to write (index.json and chunk files); an interrupted run's folder is continued.
        tokenizer_dir: The folder with the tokenizer (tokenizer.json) the model will be trained with.
        text_field: The field of JSONL records and the column of Parquet files that holds the text.
        num_workers: Processes tokenizing in parallel (default: the CPU cores).
        chunk_bytes: The size of each chunk file, e.g. 64MB.
    """
    from litgpt.data.corpus_files import check_text_field, find_corpus_files, parts, tokenized_part
    from litgpt.data.streaming import INDEX_FILE, import_litdata
    from litgpt.tokenizer import Tokenizer

    if tokenizer_dir is None:
        raise UserError("Name the tokenizer the model will train with: --tokenizer_dir (a folder with tokenizer.json).")
    files = find_corpus_files(input_dir)
    check_text_field(files, text_field)
    tokenizer = Tokenizer(tokenizer_dir)
    output_dir = Path(output_dir).expanduser()
    if (output_dir / INDEX_FILE).is_file():
        report_existing(output_dir, tokenizer)
        return
    litdata = import_litdata()
    inputs = [part for path in files for part in parts(path)]
    workers = interrupted_workers(output_dir, inputs) or min(num_workers or os.cpu_count() or 1, len(inputs))
    print(f"Tokenizing {len(files)} file(s) ({len(inputs)} parts) into {output_dir} with {workers} worker(s).",
          flush=True)
    litdata.optimize(
        fn=partial(tokenized_part, tokenizer_dir=str(Path(tokenizer_dir).resolve()), text_field=text_field),
        inputs=inputs, output_dir=str(output_dir), chunk_bytes=chunk_bytes,
        item_loader=litdata.TokensLoader(), num_workers=workers, use_checkpoint=True, reorder_files=False,
        # Forked workers start at once; spawned ones would each import torch and litgpt again.
        start_method="fork" if sys.platform == "linux" else None,
    )
    record_tokenizer(output_dir, tokenizer)
    shutil.rmtree(output_dir / ".checkpoints", ignore_errors=True)
    print(f"Prepared {output_dir}: {count_tokens(output_dir):,} tokens. Train on it with --data LitData "
          f"--data.data_path {output_dir}.", flush=True)


def interrupted_workers(output_dir: Path, inputs: list) -> Optional[int]:
    """The workers of an interrupted run into `output_dir` (litdata goes on only with as many), or None; one line when
    that run had other inputs."""
    config_path = output_dir / ".checkpoints" / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    if sorted(part for worker in config["workers_user_items"] for part in worker) != sorted(inputs):
        raise UserError(
            f"{str(output_dir)!r} holds an interrupted run over other input files: give another --output_dir, or "
            "delete that folder to start over."
        )
    print(f"Continuing the interrupted run into {output_dir} with its {config['num_workers']} worker(s).", flush=True)
    return int(config["num_workers"])


def record_tokenizer(output_dir: Path, tokenizer) -> None:
    from litgpt.data.streaming import TOKENIZER_RECORD, tokenizer_record
    from litgpt.io import write_json

    write_json(output_dir / TOKENIZER_RECORD, tokenizer_record(tokenizer))


def count_tokens(output_dir: Path) -> int:
    from litgpt.data.streaming import INDEX_FILE

    return sum(int(chunk["dim"]) for chunk in json.loads((output_dir / INDEX_FILE).read_text())["chunks"])


def report_existing(output_dir: Path, tokenizer) -> None:
    """A complete folder is left as it is: said so when it holds this tokenizer's ids, refused otherwise."""
    from litgpt.data.streaming import check_tokenizer_record

    check_tokenizer_record(str(output_dir), tokenizer)
    print(f"{output_dir} is prepared already ({count_tokens(output_dir):,} tokens): nothing to do.", flush=True)

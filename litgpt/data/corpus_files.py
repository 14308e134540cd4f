"""The documents of a corpus's files, for `litgpt prepare`: plain text (.txt, each file one document), JSON Lines
(.jsonl, one record a line) and Parquet (.parquet), the last two with the text in a named field.

The files are cut into parts (`parts`: a Parquet row group, some 64 MB of JSON lines, a text file) that litdata's
`optimize` hands to its workers; `tokenized_part` turns one part into the token ids of its documents, one after the
other. It is a module-level function of plain arguments so that spawned workers can import it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterator

import torch

from litgpt.data.text_files import read_text
from litgpt.errors import UserError

SUFFIXES = (".txt", ".jsonl", ".parquet")
# Parquet rows read at once: bounded memory whatever the file's size.
PARQUET_BATCH_ROWS = 1024
# A part of a JSONL file: about this many bytes of whole lines.
JSONL_PART_BYTES = 64 << 20


def find_corpus_files(folder: Path) -> list[Path]:
    """The .txt, .jsonl and .parquet files under `folder` (recursively), sorted; one line when there are none."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise UserError(f"The input folder {str(folder)!r} does not exist.")
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    files = [path for path in files if path.suffix in SUFFIXES and path.stat().st_size > 0]
    if not files:
        raise UserError(f"{str(folder)!r} holds no non-empty .txt, .jsonl or .parquet file (searched recursively).")
    return files


def fields_of(path: Path) -> list[str]:
    """The fields of a JSONL file's first record or a Parquet file's columns."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    with open(path, encoding="utf-8") as file:
        for line in file:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as error:
                    raise UserError(f"{str(path)!r}: the first record is not JSON ({error}).") from None
                return list(record) if isinstance(record, dict) else []
    return []


def check_text_field(files: list[Path], text_field: str) -> None:
    """Every JSONL and Parquet file has `text_field` (checked before any worker starts)."""
    for path in files:
        if path.suffix == ".txt":
            continue
        fields = fields_of(path)
        if text_field not in fields:
            raise UserError(
                f"{str(path)!r} has no field {text_field!r} (its fields: {', '.join(fields) or 'none'}): name the "
                "text's field with --text_field."
            )


def parts(path: Path) -> list[list]:
    """[file, start, end] of each part of a file (lists: litdata compares them with its checkpoint's JSON): Parquet row groups [start, end), JSONL byte ranges (the lines that
    start in [start, end)), a whole text file (0, 0)."""
    name = str(Path(path).resolve())
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        groups = pq.ParquetFile(path).num_row_groups
        return [[name, group, group + 1] for group in range(groups)]
    if path.suffix == ".jsonl":
        size = path.stat().st_size
        return [[name, start, min(start + JSONL_PART_BYTES, size)] for start in range(0, size, JSONL_PART_BYTES)]
    return [[name, 0, 0]]


def _jsonl_lines(path: Path, start: int, end: int) -> Iterator[str]:
    """The lines of a JSONL file that start at a byte offset in [start, end)."""
    with open(path, "rb") as file:
        file.seek(start)
        if start > 0:
            file.seek(start - 1)
            file.readline()  # the line under way at `start` belongs to the part before
        while file.tell() < end:
            line = file.readline()
            if not line:
                break
            yield line.decode("utf-8")


def documents(part: list, text_field: str) -> Iterator[str]:
    """The texts of one part of a file, in order (empty ones skipped)."""
    path, start, end = Path(part[0]), part[1], part[2]
    if path.suffix == ".txt":
        yield read_text(path)
    elif path.suffix == ".jsonl":
        for line in _jsonl_lines(path, start, end):
            if line.strip():
                text = json.loads(line).get(text_field)
                if text:
                    yield text
    else:
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=range(start, end),
                                       columns=[text_field]):
            yield from (text for text in batch.column(0).to_pylist() if text)


@functools.lru_cache(maxsize=1)
def _tokenizer(tokenizer_dir: str):
    from litgpt.tokenizer import Tokenizer

    return Tokenizer(Path(tokenizer_dir))


def tokenized_part(part: list, tokenizer_dir: str, text_field: str) -> torch.Tensor:
    """The int32 token ids of a part's documents, each ending in EOS (BOS first when the tokenizer adds one)."""
    tokenizer = _tokenizer(tokenizer_dir)
    ids = [tokenizer.encode(text, eos=True).to(torch.int32) for text in documents(part, text_field)]
    return torch.cat(ids) if ids else torch.empty(0, dtype=torch.int32)

"""Pretraining on a folder of plain text files, and the readers that cut text files into documents.

Each .txt file is one document (it gets one EOS at its end). The files are found recursively and sorted by path.
The validation set is either a second folder (`val_data_path`) or a deterministic sample of the files
(`val_split_fraction` of them, at least one, drawn with `seed`). When the folder holds a single file and no validation
folder is given, that file is cut at blank lines into documents (its paragraphs or stories), each its own document
with its own EOS, and the validation set is a sample of those.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from litgpt.data.token_cache import Corpus, TokenCorpus, pick_validation
from litgpt.errors import UserError

READ_CHUNK_CHARS = 1 << 20


def read_text(path: Path) -> str:
    """The UTF-8 text of `path` (a leading byte-order mark dropped)."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise UserError(
            f"{str(path)!r} is not UTF-8 text (byte {error.start}: {error.reason}). Convert it to UTF-8."
        ) from None


def _open_text(path: Path):
    return open(path, encoding="utf-8-sig", newline=None)


def blank_line_documents(path: Path) -> Iterator[str]:
    """The blocks of lines of a text file that blank lines (or lines of only whitespace) separate, read line by line.

    Lines keep their text and are joined with "\\n"; runs of blank lines count as one separator.
    """
    lines: list[str] = []
    try:
        with _open_text(path) as file:
            for line in file:
                line = line.rstrip("\n")
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "\n".join(lines)
                    lines = []
    except UnicodeDecodeError as error:
        raise UserError(f"{str(path)!r} is not UTF-8 text ({error.reason}). Convert it to UTF-8.") from None
    if lines:
        yield "\n".join(lines)


def delimited_documents(path: Path, delimiter: str) -> Iterator[str]:
    """The pieces of a text file between occurrences of `delimiter` (e.g. "<|endoftext|>"), stripped of surrounding
    whitespace, read in chunks; empty pieces are skipped."""
    rest = ""
    try:
        with _open_text(path) as file:
            while True:
                chunk = file.read(READ_CHUNK_CHARS)
                if not chunk:
                    break
                pieces = (rest + chunk).split(delimiter)
                rest = pieces.pop()  # may continue in the next chunk (or hold the start of a delimiter)
                for piece in pieces:
                    piece = piece.strip()
                    if piece:
                        yield piece
    except UnicodeDecodeError as error:
        raise UserError(f"{str(path)!r} is not UTF-8 text ({error.reason}). Convert it to UTF-8.") from None
    rest = rest.strip()
    if rest:
        yield rest


def find_text_files(folder: Path, what: str) -> list[Path]:
    """The non-empty .txt files under `folder` (recursively), sorted; a UserError when there are none."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise UserError(f"The {what} data folder {str(folder)!r} does not exist.")
    if folder.is_file():
        if folder.suffix != ".txt":
            raise UserError(f"The {what} data path {str(folder)!r} is not a folder of .txt files.")
        files = [folder]
    else:
        files = sorted(path for path in folder.rglob("*.txt") if path.is_file())
    if not files:
        raise UserError(f"The {what} data folder {str(folder)!r} has no .txt files (searched recursively).")
    non_empty = [path for path in files if path.stat().st_size > 0]
    if not non_empty:
        raise UserError(
            f"All {len(files)} .txt file(s) in the {what} data folder {str(folder)!r} are empty; put text in them."
        )
    return non_empty


def _file_documents(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield read_text(path)


@dataclass
class TextFiles(TokenCorpus):
    """Plain .txt files, each file one document.

    Args:
        train_data_path: Folder searched recursively for .txt files.
        val_data_path: Folder of validation .txt files. Without it, `val_split_fraction` of the training files (or,
            with a single file, of its blank-line-separated documents) are held out, picked with `seed`.
        val_split_fraction: Share of the training files (or documents) held out for validation.
        seed: Seed of that split.
        cache_dir: Folder for the token caches (default: keyed folders under ~/.cache/litgpt/tokens).
    """

    train_data_path: Path
    val_data_path: Optional[Path] = None
    val_split_fraction: float = 0.05
    seed: int = 42
    cache_dir: Optional[Path] = None

    def corpora(self) -> dict[str, Corpus]:
        train_files = find_text_files(self.train_data_path, "training")
        if self.val_data_path is not None:
            val_files = find_text_files(self.val_data_path, "validation")
            return {
                "train": Corpus("textfiles-train", train_files, lambda: _file_documents(train_files)),
                "val": Corpus("textfiles-val", val_files, lambda: _file_documents(val_files)),
            }

        options = {"val_split_fraction": self.val_split_fraction, "seed": self.seed}
        if len(train_files) > 1:
            held_out = pick_validation(len(train_files), self.val_split_fraction, self.seed, "files")
            train = [path for i, path in enumerate(train_files) if i not in held_out]
            val = [path for i, path in enumerate(train_files) if i in held_out]
            options["unit"] = "file"
            return {
                "train": Corpus("textfiles-train", train_files, lambda: _file_documents(train), options),
                "val": Corpus("textfiles-val", train_files, lambda: _file_documents(val), options),
            }

        (path,) = train_files
        options["unit"] = "blank-line document"

        def split(want_val: bool) -> Iterator[str]:
            count = sum(1 for _ in blank_line_documents(path))
            held_out = pick_validation(count, self.val_split_fraction, self.seed, f"documents in {str(path)!r}")
            for index, document in enumerate(blank_line_documents(path)):
                if (index in held_out) == want_val:
                    yield document

        return {
            "train": Corpus("textfiles-train", train_files, lambda: split(False), options),
            "val": Corpus("textfiles-val", train_files, lambda: split(True), options),
        }

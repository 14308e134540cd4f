"""The RedPajama-Data-1T sample (Together, 2023): about 930,000 documents (1B tokens) drawn from the RedPajama
sources (Common Crawl, C4, GitHub, books, arXiv, Wikipedia, StackExchange).

The files are those of the Hugging Face dataset `togethercomputer/RedPajama-Data-1T-Sample`: `*_sample.jsonl` at the
top of the repo (`arxiv_sample.jsonl`, `c4_sample.jsonl`, ...), one JSON object per line with the document in
"text" (and its origin in "meta"). They are downloaded into `data_path` unless *.jsonl files are there already; every
*.jsonl file of `data_path` is used, in sorted order. Each line is one document; a deterministic `val_split_fraction`
of them (chosen by a hash of `seed` and the document's position) is the validation set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from litgpt.data.token_cache import Corpus, TokenCorpus, hub_snapshot, in_validation
from litgpt.errors import UserError

REPO_ID = "togethercomputer/RedPajama-Data-1T-Sample"
PATTERNS = ("*.jsonl",)


def jsonl_texts(path: Path, field: str = "text") -> Iterator[str]:
    """The `field` string of every line of a JSON-lines file (blank lines skipped)."""
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise UserError(f"{str(path)!r}, line {number}: invalid JSON ({error}).") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{str(path)!r}, line {number}: expected an object with a string {field!r} field.")
            yield text


@dataclass
class RedPajama(TokenCorpus):
    """The 1B-token RedPajama sample.

    Args:
        data_path: Folder holding (or to receive) the *.jsonl files of the dataset repo.
        val_split_fraction: Share of the documents held out for validation.
        seed: Seed of that split.
        cache_dir: Folder for the token caches (default: keyed folders under ~/.cache/litgpt/tokens).
    """

    data_path: Path = Path("data/redpajama_sample")
    val_split_fraction: float = 0.0005
    seed: int = 42
    cache_dir: Optional[Path] = None

    def download(self) -> None:
        hub_snapshot(REPO_ID, self.data_path, PATTERNS)

    def corpora(self) -> dict[str, Corpus]:
        files = sorted(Path(self.data_path).glob("*.jsonl"))
        if not files:
            raise UserError(
                f"{str(self.data_path)!r} has no .jsonl files: prepare() downloads them, or put the *_sample.jsonl "
                f"files of the Hugging Face dataset {REPO_ID} there yourself."
            )
        in_validation(0, self.val_split_fraction, self.seed)  # checks the fraction before anything is read
        options = {"val_split_fraction": self.val_split_fraction, "seed": self.seed, "field": "text"}

        def documents(want_val: bool) -> Iterator[str]:
            index = 0
            for path in files:
                for text in jsonl_texts(path):
                    if in_validation(index, self.val_split_fraction, self.seed) == want_val:
                        yield text
                    index += 1

        return {
            "train": Corpus("redpajama-train", files, lambda: documents(False), options),
            "val": Corpus("redpajama-val", files, lambda: documents(True), options),
        }

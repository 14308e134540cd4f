"""Databricks Dolly 15k: 15,000 instruction records written by Databricks employees.

The file is `databricks-dolly-15k.jsonl` of the Hugging Face dataset `databricks/databricks-dolly-15k`, one
{"instruction", "context", "response", "category"} object per line; "context" is the instruction's input and
"response" its output. It is downloaded into `download_dir` unless it is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from litgpt.data.base import IGNORE_INDEX
from litgpt.data.json_data import Record, SFTDataModule, load_records, normalize_record
from litgpt.data.token_cache import hub_download

REPO_ID = "databricks/databricks-dolly-15k"
DOLLY_FIELDS = {"instruction": "instruction", "input": "context", "output": "response"}


@dataclass
class Dolly(SFTDataModule):
    """The Dolly 15k instruction set.

    Args:
        mask_prompt: Leave the prompt out of the loss.
        val_split_fraction: Share of records held out for validation.
        prompt_style: Prompt style name (default: a chat model's own, alpaca for a base model).
        ignore_index: The label of tokens without loss.
        seed: Seed of the validation split.
        download_dir: Folder of the data file (downloaded there when missing).
        repo_id: The Hugging Face dataset.
        file_name: The file of the dataset repo.
    """

    mask_prompt: bool = True
    val_split_fraction: float = 0.1
    prompt_style: Optional[str] = None
    ignore_index: int = IGNORE_INDEX
    seed: int = 42
    download_dir: Path = Path("data/dolly")
    repo_id: str = REPO_ID
    file_name: str = "databricks-dolly-15k.jsonl"

    def download(self) -> None:
        hub_download(self.repo_id, [self.file_name], Path(self.download_dir))

    def load(self) -> tuple[list[Record], list[Record]]:
        records = load_records(
            Path(self.download_dir) / self.file_name, lambda raw, where: [normalize_record(raw, where, DOLLY_FIELDS)]
        )
        return self.split(records)

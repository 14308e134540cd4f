"""Alpaca instruction data: the cleaned Stanford Alpaca set (about 52,000 records) and its 2,000-record sample.

- `Alpaca`: `alpaca_data_cleaned_archive.json` of github.com/tloen/alpaca-lora (a JSON list of
  {"instruction", "input", "output"}), downloaded into `download_dir` unless the file is there.
- `Alpaca2k`: the Hugging Face dataset `mhenrichsen/alpaca_2k_test` (one file, `alpaca_2000.parquet`, with the same
  fields), downloaded into `download_dir` unless it is there. Reading parquet needs `pyarrow`; a .json/.jsonl file of
  the same records placed in `download_dir` is used instead when present (no pyarrow, no network).
- `AlpacaGPT4`: the Alpaca instructions with answers written by GPT-4 (Peng et al., 2023: `alpaca_gpt4_data.json` of
  github.com/Instruction-Tuning-with-GPT-4/GPT-4-LLM, the same fields), read like `Alpaca`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from litgpt.data.base import IGNORE_INDEX
from litgpt.data.json_data import Record, SFTDataModule, load_records, normalize_record
from litgpt.data.token_cache import hub_download
from litgpt.fetch import url_download
from litgpt.errors import UserError

ALPACA_URL = "https://raw.githubusercontent.com/tloen/alpaca-lora/main/alpaca_data_cleaned_archive.json"
ALPACA_GPT4_URL = (
    "https://raw.githubusercontent.com/Instruction-Tuning-with-GPT-4/GPT-4-LLM/main/data/alpaca_gpt4_data.json"
)
ALPACA_2K_REPO = "mhenrichsen/alpaca_2k_test"
ALPACA_2K_FILE = "alpaca_2000.parquet"


@dataclass
class Alpaca(SFTDataModule):
    """The cleaned Alpaca instruction set.

    Args:
        mask_prompt: Leave the prompt out of the loss.
        val_split_fraction: Share of records held out for validation (0.03865: about 2,000 records).
        prompt_style: Prompt style name (default: a chat model's own, alpaca for a base model).
        ignore_index: The label of tokens without loss.
        seed: Seed of the validation split.
        download_dir: Folder of the data file (downloaded there when missing).
        file_url: Where the file is downloaded from.
        file_name: Name of the file in `download_dir`.
    """

    mask_prompt: bool = True
    val_split_fraction: float = 0.03865
    prompt_style: Optional[str] = None
    ignore_index: int = IGNORE_INDEX
    seed: int = 42
    download_dir: Path = Path("data/alpaca")
    file_url: str = ALPACA_URL
    file_name: str = "alpaca_data_cleaned_archive.json"

    def download(self) -> None:
        url_download(self.file_url, Path(self.download_dir) / self.file_name)

    def load(self) -> tuple[list[Record], list[Record]]:
        return self.split(load_records(Path(self.download_dir) / self.file_name))


@dataclass
class AlpacaGPT4(Alpaca):
    """The Alpaca instructions with GPT-4's answers (LitGPT's `AlpacaGPT4`, with its file name and split).

    Args: those of `Alpaca`.
    """

    val_split_fraction: float = 0.03847  # about 2,000 of the 52,002 records
    download_dir: Path = Path("data/alpacagpt4")
    file_url: str = ALPACA_GPT4_URL
    file_name: str = "alpacagpt4_data_cleaned_archive.json"


@dataclass
class Alpaca2k(SFTDataModule):
    """A 2,000-record sample of Alpaca, for quick runs.

    Args:
        mask_prompt: Leave the prompt out of the loss.
        val_split_fraction: Share of records held out for validation.
        prompt_style: Prompt style name (default: a chat model's own, alpaca for a base model).
        ignore_index: The label of tokens without loss.
        seed: Seed of the validation split.
        download_dir: Folder of the data file (downloaded there when missing).
        repo_id: The Hugging Face dataset.
        file_name: The parquet file of the dataset repo.
    """

    mask_prompt: bool = True
    val_split_fraction: float = 0.05
    prompt_style: Optional[str] = None
    ignore_index: int = IGNORE_INDEX
    seed: int = 42
    download_dir: Path = Path("data/alpaca2k")
    repo_id: str = ALPACA_2K_REPO
    file_name: str = ALPACA_2K_FILE

    def _local_json(self) -> Optional[Path]:
        stem = Path(self.file_name).stem
        for suffix in (".jsonl", ".json"):
            path = Path(self.download_dir) / f"{stem}{suffix}"
            if path.is_file():
                return path
        return None

    def download(self) -> None:
        if self._local_json() is None:
            hub_download(self.repo_id, [self.file_name], Path(self.download_dir))

    def load(self) -> tuple[list[Record], list[Record]]:
        local = self._local_json()
        if local is not None:
            return self.split(load_records(local))
        path = Path(self.download_dir) / self.file_name
        return self.split(read_parquet_records(path))


def read_parquet_records(path: Path) -> list[Record]:
    """The instruction records of a parquet file with instruction/input/output columns (needs pyarrow)."""
    if not path.is_file():
        raise UserError(f"{str(path)!r} does not exist: prepare() downloads it.")
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise UserError(
            f"Reading {str(path)!r} needs pyarrow (`pip install pyarrow`); or save its records as "
            f"{str(path.with_suffix('.jsonl'))!r}."
        ) from None
    rows = parquet.read_table(path).to_pylist()
    if not rows:
        raise UserError(f"{str(path)!r} holds no records.")
    return [normalize_record(row, f"{str(path)!r}, row {index} (counting from 0)") for index, row in enumerate(rows)]

"""LitGPT 0.5.13's data modules that litgpt does not carry, under their names and with their init args.

A recipe of LitGPT's that names one (`data: Deita`, `class_path: litgpt.data.FLAN`) parses as written, and
building the module stops with one line that says which of our data modules to use instead. Overriding `--data` on
the command line after `--config` replaces it before it is built, so the rest of such a recipe still runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from litgpt.data.base import DataModule
from litgpt.errors import UserError

class NotCarried(DataModule):
    """A LitGPT data module that is refused with `instead` when it is built."""

    instead: ClassVar[str]

    def __post_init__(self) -> None:
        raise UserError(f"--data {type(self).__name__} is LitGPT's and is not carried here: {self.instead}.")

    # Never reached (building the module raises); DataModule's abstract methods need bodies.
    def prepare(self) -> None:
        raise NotImplementedError

    train_dataset = val_dataset = prepare


@dataclass
class Deita(NotCarried):
    """LitGPT's Deita 10k conversations (not carried)."""

    mask_prompt: bool = False
    prompt_style: str = "alpaca"
    ignore_index: int = -100
    seed: int = 42
    include_multiturn_conversations: bool = False
    download_dir: Path = Path("data/deita")
    repo_id: str = "HuggingFaceH4/deita-10k-v0-sft"
    instead: ClassVar[str] = (
        "save its conversations as a .jsonl file of {\"messages\": [{\"role\", \"content\"}, ...]} records and use "
        "--data JSON --data.json_path FILE, or use --data LIMA (conversations of the same kind)"
    )


@dataclass
class FLAN(NotCarried):
    """LitGPT's FLAN collection (not carried)."""

    mask_prompt: bool = False
    prompt_style: str = "flan"
    ignore_index: int = -100
    seed: int = 42
    download_dir: Path = Path("data/flan")
    url: str = "https://huggingface.co/datasets/Muennighoff/flan/resolve/main"
    subsets: Optional[str] = None
    instead: ClassVar[str] = (
        "save the subsets you want as {\"instruction\", \"input\", \"output\"} records and use --data JSON "
        "--data.json_path FILE (there is no flan prompt style here: the checkpoint's or alpaca)"
    )


@dataclass
class LongForm(NotCarried):
    """LitGPT's LongForm instructions (not carried)."""

    mask_prompt: bool = False
    prompt_style: str = "longform"
    ignore_index: int = -100
    seed: int = 42
    download_dir: Path = Path("data/longform")
    instead: ClassVar[str] = (
        "save its records as {\"instruction\", \"output\"} objects and use --data JSON --data.json_path FILE "
        "(there is no longform prompt style here: the checkpoint's or alpaca)"
    )

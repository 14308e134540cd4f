"""LIMA (Zhou et al., 2023): 1,000 carefully chosen prompts and answers, some of them multi-turn.

The file is `train.jsonl` of the Hugging Face dataset `GAIR/lima`, one {"conversations": [str, ...], "source"}
object per line, the strings alternating user and assistant. The dataset is gated: accept its terms on the Hub and
set HF_TOKEN (or pass `access_token`). It is downloaded into `download_dir` unless it is there.

Each conversation becomes a chat record: its first exchange only, or with `include_multiturn_conversations`, one
record per assistant turn with the whole conversation before it as the prompt. Conversations (not records) are
split into training and validation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from litgpt.data.base import IGNORE_INDEX
from litgpt.data.json_data import Record, SFTDataModule, load_records
from litgpt.data.token_cache import hub_download
from litgpt.errors import UserError

REPO_ID = "GAIR/lima"


def conversation_record(raw: Any, where: str) -> list[Record]:
    """The chat record of one LIMA line: its turns as alternating user and assistant messages."""
    turns = raw.get("conversations") if isinstance(raw, dict) else None
    if not isinstance(turns, list) or not all(isinstance(turn, str) for turn in turns):
        raise UserError(f'{where}: expected an object with "conversations", a list of strings.')
    if len(turns) < 2:
        raise UserError(f"{where}: the conversation needs a prompt and an answer, it has {len(turns)} turn(s).")
    messages = [
        {"role": "user" if index % 2 == 0 else "assistant", "content": turn} for index, turn in enumerate(turns)
    ]
    return [{"messages": messages}]


def expand(records: list[Record], multiturn: bool) -> list[Record]:
    """One record per conversation ending at its first answer, or (multiturn) one per assistant turn."""
    result = []
    for record in records:
        messages = record["messages"]
        ends = range(1, len(messages), 2) if multiturn else [1]
        result.extend({"messages": messages[: end + 1]} for end in ends)
    return result


@dataclass
class LIMA(SFTDataModule):
    """The LIMA conversations.

    Args:
        mask_prompt: Leave the prompt out of the loss.
        val_split_fraction: Share of records held out for validation.
        prompt_style: Prompt style name (default: a chat model's own, alpaca for a base model).
        ignore_index: The label of tokens without loss.
        seed: Seed of the validation split.
        include_multiturn_conversations: Learn every assistant turn of a conversation, not only the first.
        download_dir: Folder of the data file (downloaded there when missing).
        repo_id: The Hugging Face dataset.
        file_name: The file of the dataset repo.
        access_token: Hugging Face token of an account that accepted the dataset's terms (default: $HF_TOKEN).
    """

    mask_prompt: bool = True
    val_split_fraction: float = 0.1
    prompt_style: Optional[str] = None
    ignore_index: int = IGNORE_INDEX
    seed: int = 42
    include_multiturn_conversations: bool = False
    download_dir: Path = Path("data/lima")
    repo_id: str = REPO_ID
    file_name: str = "train.jsonl"
    access_token: Optional[str] = field(default=None, repr=False)

    def download(self) -> None:
        token = self.access_token or os.environ.get("HF_TOKEN")
        hub_download(self.repo_id, [self.file_name], Path(self.download_dir), token=token)

    def load(self) -> tuple[list[Record], list[Record]]:
        # Conversations are split first, so that the turns of one conversation stay on one side.
        train, val = self.split(load_records(Path(self.download_dir) / self.file_name, conversation_record))
        multiturn = self.include_multiturn_conversations
        return expand(train, multiturn), expand(val, multiturn)

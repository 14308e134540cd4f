"""Prompts for online training (`litgpt grpo --data Prompts`): JSON/JSONL rows or a Hugging Face dataset, each with a
`prompt` (plain text, or chat messages) and any other fields, which reach the reward functions unchanged (an
`answer` for `exact_answer`, say).

A sample is one prompt: its tokens laid out by the checkpoint's chat template (messages) or the prompt style, and
its row's index, by which the recipe finds the row's fields again. Its labels are all masked: the tokens trained on
are the completions the policy samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from litgpt.data.base import IGNORE_INDEX, DataModule, collate
from litgpt.data.json_data import iter_json, split_records, train_and_val_files
from litgpt.data.preference import hf_dataset_rows
from litgpt.errors import UserError
from litgpt.prompts import ROLES, PromptStyle

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

Row = dict[str, Any]


def prompt_row(raw: Any, where: str) -> Row:
    """A row with a text or conversation `prompt`; a UserError naming the row otherwise."""
    if not isinstance(raw, dict) or "prompt" not in raw:
        fields = ", ".join(sorted(raw)) if isinstance(raw, dict) else type(raw).__name__
        raise UserError(f"{where} has no \"prompt\" field (it has: {fields}): every row needs a prompt (text or "
                        "chat messages); its other fields reach the reward functions.")
    prompt = raw["prompt"]
    if isinstance(prompt, str):
        return dict(raw)
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in prompt):
        raise UserError(f'{where}: "prompt" must be text or a non-empty list of {{"role", "content"}} messages '
                        f"(roles: {', '.join(ROLES)}).")
    return dict(raw)


class PromptDataset:
    """The prompts' tokens, and their rows for the rewards."""

    def __init__(self, rows: list[Row], tokenizer: "Tokenizer", style: PromptStyle, template, max_seq_length: int,
                 which: str) -> None:
        self.rows, self.tokenizer, self.max_seq_length = rows, tokenizer, max_seq_length
        self.ids = []
        for index, row in enumerate(rows):
            prompt = row["prompt"]
            if isinstance(prompt, str):
                text = style.apply(prompt)
            elif template is not None:
                text = template.render(prompt, add_generation_prompt=True)
            else:
                text = style.apply_messages(prompt)
            ids = tokenizer.encode(text, bos=True, eos=False).long()
            if ids.numel() >= max_seq_length:
                raise UserError(f"The {which} prompt {index} has {ids.numel()} tokens, leaving no room for a "
                                f"completion within --train.max_seq_length {max_seq_length}: shorten it or raise "
                                "--train.max_seq_length.")
            self.ids.append(ids)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index]
        return {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX), "index": torch.tensor(index)}

    @staticmethod
    def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = collate([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples])
        return {**batch, "index": torch.stack([s["index"] for s in samples])}

    def fields(self, indices: list[int]) -> dict[str, list]:
        """Every field but the prompt, as columns over `indices` (a field a row lacks is None there)."""
        names = dict.fromkeys(name for i in indices for name in self.rows[i] if name != "prompt")
        return {name: [self.rows[i].get(name) for i in indices] for name in names}


@dataclass
class Prompts(DataModule):
    """Prompts, with the fields their rewards check, from JSON/JSONL files or a Hugging Face dataset.

    Args:
        json_path: A .json file (a list of rows), a .jsonl file (one row per line), or a folder with train.json(l)
            and val.json(l).
        dataset: Instead of json_path: a Hugging Face dataset, by hub name or as a local folder or data file.
        name: The dataset's configuration name, if it has several.
        split: The dataset's split to train on.
        val_split: The dataset's split to validate on (else val_split_fraction of `split` is held out).
        val_split_fraction: The share of rows held out for validation (a single file, or a dataset without val_split).
        prompt_style: Prompt style name for text prompts, and for conversations where the checkpoint has no chat
            template (default: a chat model's own, else the prompt as it is).
        seed: Seed of the validation split.
    """

    json_path: Optional[Path] = None
    dataset: Optional[str] = None
    name: Optional[str] = None
    split: str = "train"
    val_split: Optional[str] = None
    val_split_fraction: Optional[float] = None
    prompt_style: Optional[str] = None
    seed: int = 42

    def connect(self, tokenizer: "Tokenizer", max_seq_length: int, prompt_style: Optional[PromptStyle] = None) -> None:
        from litgpt.chat_template import ChatTemplate

        self.tokenizer, self.max_seq_length = tokenizer, max_seq_length
        self.style = PromptStyle.from_name(self.prompt_style) if self.prompt_style else (prompt_style or PromptStyle())
        self.template = ChatTemplate.from_checkpoint(tokenizer.checkpoint_dir)

    def check_packing(self) -> None:
        if self.packing:
            raise UserError("--data.packing does not apply to prompts: each prompt's completions are sampled and "
                            "trained on as sequences of their own; drop --data.packing.")

    def prepare(self) -> None:
        self.records()

    def records(self) -> tuple[list[Row], list[Row]]:
        cached = getattr(self, "_records", None)
        if cached is None:
            cached = self._records = self._load()
        return cached

    def _load(self) -> tuple[list[Row], list[Row]]:
        if (self.json_path is None) == (self.dataset is None):
            raise UserError("--data Prompts needs its rows: give --data.json_path (a .json/.jsonl file or a folder "
                            "with train/val files) or --data.dataset (a Hugging Face dataset), one of the two.")
        if self.dataset is not None:
            train = [prompt_row(row, where) for row, where in hf_dataset_rows(self.dataset, self.name, self.split)]
            if self.val_split is None:
                return self._split(train)
            return train, [prompt_row(row, where) for row, where in hf_dataset_rows(self.dataset, self.name, self.val_split)]
        path = Path(self.json_path).expanduser()
        if path.is_dir():
            train, val = train_and_val_files(path)
            return ([prompt_row(row, where) for row, where in iter_json(train)],
                    [prompt_row(row, where) for row, where in iter_json(val)])
        return self._split([prompt_row(row, where) for row, where in iter_json(path)])

    def _split(self, rows: list[Row]) -> tuple[list[Row], list[Row]]:
        return split_records(rows, 0.05 if self.val_split_fraction is None else self.val_split_fraction, self.seed)

    def train_dataset(self) -> PromptDataset:
        return PromptDataset(self.records()[0], self.tokenizer, self.style, self.template, self.max_seq_length,
                             "training")

    def val_dataset(self) -> PromptDataset:
        return PromptDataset(self.records()[1], self.tokenizer, self.style, self.template, self.max_seq_length,
                             "validation")

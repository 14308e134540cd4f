"""Supervised finetuning data: records from JSON files, laid out by a prompt style and tokenized with a loss mask.

A record is either an instruction:

    {"instruction": "...", "input": "... (optional context)", "output": "..."}

or a conversation:

    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

For an instruction, the prompt is the prompt style applied to the instruction (and its input: styles that take an
`input` argument, such as "alpaca", place it themselves; for the others it follows the instruction after a blank
line), and the response is the output. For a conversation, the response is the LAST assistant message and the prompt
every message before it; messages after it are not used. A conversation is laid out by the checkpoint's own chat
template when its folder has one (and no --data.prompt_style is given), else by the prompt style (`apply_messages`).

A sample is tokens = encode(prompt) (with BOS when the tokenizer adds one) + encode(response, bos=False) + [EOS],
cut to max_seq_length + 1 tokens; input_ids = tokens[:-1] and labels = tokens[1:], with the labels of the prompt
set to `ignore_index` when `mask_prompt` (the first response token, predicted from the last prompt token, keeps its
label). With a chat template, as TRL does: tokens are the template's text of the conversation up to that reply,
tokenized as `apply_chat_template(tokenize=True)` does (the template writes BOS and the reply's end-of-turn; no EOS is
added), and the prompt is what the template writes before the reply (its text with the generation prompt, as far as
the two agree).

`JSON` reads a .json file (a list of records) or a .jsonl file (one record per line), or a folder with
train.json(l) and val.json(l). `SFTDataset` and `SFTDataModule` are shared by every instruction data module (Alpaca,
Dolly, LIMA, ...).
"""

from __future__ import annotations

import inspect
import json
import os
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from litgpt.chat_template import REASONING_FIELDS, ChatTemplate, encode_rendered_with_offsets
from litgpt.data.base import IGNORE_INDEX, DataModule
from litgpt.data.packing import PackedDataset
from litgpt.data.token_cache import pick_validation
from litgpt.distributed.runtime import print_once
from litgpt.errors import UserError
from litgpt.prompts import ROLES, Alpaca as AlpacaStyle, PromptStyle

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

Record = dict[str, Any]
# Our names of the instruction fields -> the names a file uses for them.
INSTRUCTION_FIELDS = {"instruction": "instruction", "input": "input", "output": "output"}


# ---- reading records ------------------------------------------------------------------------------------------------
def iter_json(path: Path) -> Iterator[tuple[Any, str]]:
    """The raw values of a .json file (which must hold a list) or a .jsonl file, each with where it comes from
    ("FILE, line N" or "FILE, record I")."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"Data file {str(path)!r} does not exist.")
    if path.suffix not in (".json", ".jsonl"):
        raise UserError(f"{str(path)!r} is neither a .json nor a .jsonl file.")
    if path.stat().st_size == 0:
        raise UserError(f"{str(path)!r} is empty: it needs at least one record.")
    try:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8-sig") as file:
                for number, line in enumerate(file, start=1):
                    if not line.strip():
                        continue
                    try:
                        value = json.loads(line)
                    except ValueError as error:
                        raise UserError(f"{str(path)!r}, line {number}: invalid JSON ({_reason(error)}).") from None
                    yield value, f"{str(path)!r}, line {number}"
            return
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise UserError(f"{str(path)!r} is not UTF-8 text ({error.reason}).") from None
    if not text.strip():
        raise UserError(f"{str(path)!r} is empty: it needs at least one record.")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(
            f"{str(path)!r}: invalid JSON at line {error.lineno}, column {error.colno} ({error.msg})."
        ) from None
    if not isinstance(values, list):
        raise UserError(
            f"{str(path)!r} must hold a JSON list of records, not a {_type_name(values)}. (For one record per line, "
            "name the file .jsonl.)"
        )
    for index, value in enumerate(values):
        yield value, f"{str(path)!r}, record {index} (counting from 0)"


def normalize_record(raw: Any, where: str, fields: dict[str, str] = INSTRUCTION_FIELDS) -> Record:
    """A checked record: {"instruction", "input", "output"} or {"messages": [{"role", "content"}, ...]}.

    `fields` maps the names used here to those of the file (e.g. Dolly's "context" and "response").
    """
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a JSON object, got a {_type_name(raw)}.")
    if "messages" in raw:
        return {"messages": _check_messages(raw["messages"], where)}
    names = fields
    if names["instruction"] not in raw:
        raise UserError(
            f'{where}: missing "{names["instruction"]}" (a record needs "{names["instruction"]}" and '
            f'"{names["output"]}", or "messages").'
        )
    if names["output"] not in raw:
        raise UserError(f'{where}: missing "{names["output"]}".')
    record = {
        "instruction": raw[names["instruction"]],
        "input": raw.get(names["input"]) or "",
        "output": raw[names["output"]],
    }
    for ours, value in record.items():
        if not isinstance(value, str):
            raise UserError(f'{where}: "{names[ours]}" must be a string, not a {_type_name(value)}.')
    return record


def _check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects.')
    result = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise UserError(f'{where}: messages[{index}] must be an object with "role" and "content".')
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise UserError(f"{where}: messages[{index}] has role {role!r}; use one of {', '.join(ROLES)}.")
        if not isinstance(content, str):
            raise UserError(f'{where}: messages[{index}]: "content" must be a string, not a {_type_name(content)}.')
        # A message's reasoning is kept for the chat templates of reasoning models, which show it.
        reasoning = {k: v for k, v in message.items() if k in REASONING_FIELDS and isinstance(v, str)}
        result.append({"role": role, "content": content, **reasoning})
    last = max((i for i, m in enumerate(result) if m["role"] == "assistant"), default=None)
    if last is None:
        raise UserError(f"{where}: the conversation has no assistant message to learn from.")
    if not any(m["role"] == "user" for m in result[:last]):
        raise UserError(f"{where}: the last assistant message has no user message before it.")
    return result


def load_records(
    path: Path, convert: Optional[Callable[[Any, str], Iterable[Record]]] = None
) -> list[Record]:
    """The checked records of a .json or .jsonl file; `convert(raw, where)` turns a raw value into records (default:
    `normalize_record`)."""
    records: list[Record] = []
    for raw, where in iter_json(path):
        if convert is None:
            records.append(normalize_record(raw, where))
        else:
            records.extend(convert(raw, where))
    if not records:
        raise UserError(f"{str(Path(path))!r} holds no records.")
    return records


def split_records(records: Sequence[Record], fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """(train, val): `fraction` of the records (at least one) drawn with `seed`, the rest in their order."""
    held_out = pick_validation(len(records), fraction, seed, "records")
    train = [r for i, r in enumerate(records) if i not in held_out]
    val = [r for i, r in enumerate(records) if i in held_out]
    return train, val


def _reason(error: ValueError) -> str:
    return error.msg if isinstance(error, json.JSONDecodeError) else str(error)


def _type_name(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


# ---- samples ----------------------------------------------------------------------------------------------------------
def prompt_and_response(record: Record, style: PromptStyle) -> tuple[str, str]:
    """The prompt text and the response text of a record under `style`."""
    if "messages" in record:
        messages = record["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return style.apply_messages(messages[:last]), messages[last]["content"]
    instruction, context = record["instruction"], record.get("input", "")
    if "input" in inspect.signature(style.apply).parameters:
        return style.apply(instruction, input=context), record["output"]
    text = f"{instruction}\n\n{context}" if context else instruction
    return style.apply(text), record["output"]


def templated_text(template: ChatTemplate, messages: list[dict]) -> tuple[str, int]:
    """The chat template's text of a conversation up to its last assistant message, and how many of its characters
    are the prompt (what the template writes before that reply)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    opened = template.render(messages[:last], add_generation_prompt=True)
    whole = template.render(messages[: last + 1])
    shared = len(os.path.commonprefix([opened, whole]))  # a reasoning template may open the reply differently
    if shared >= len(whole):
        raise UserError(f"The chat template of {template.where} writes nothing for the last assistant message, so "
                        "there is no reply to learn: check the roles, or give --data.prompt_style to lay the "
                        "conversations out with a prompt style.")
    return whole, shared


def templated_tokens(template: ChatTemplate, tokenizer: "Tokenizer", messages: list[dict]) -> tuple[list[int], int]:
    """The ids of `templated_text` as `apply_chat_template(tokenize=True)` gives them, and how many of them are the
    prompt (the tokens wholly within its prompt's characters)."""
    whole, shared = templated_text(template, messages)
    ids, offsets = encode_rendered_with_offsets(tokenizer, whole)
    prompt_tokens = next((i for i, (_, end) in enumerate(offsets) if end > shared), len(ids))
    return ids, prompt_tokens


class SFTDataset:
    """Instruction/conversation records turned into samples on access (see the module docstring).

    Args:
        records: Checked records (`normalize_record`).
        tokenizer: The model's tokenizer.
        prompt_style: How prompts are laid out.
        max_seq_length: Longest sample; longer ones are cut at the end (-1: no limit).
        mask_prompt: Leave the prompt out of the loss.
        ignore_index: The label of tokens without loss.
        chat_template: The checkpoint's chat template, which lays out conversations instead of the prompt style.
    """

    def __init__(
        self,
        records: Sequence[Record],
        tokenizer: "Tokenizer",
        prompt_style: PromptStyle,
        max_seq_length: int = -1,
        mask_prompt: bool = True,
        ignore_index: int = IGNORE_INDEX,
        chat_template: Optional[ChatTemplate] = None,
    ) -> None:
        if tokenizer.eos_id is None:
            raise UserError(
                f"The tokenizer in {str(getattr(tokenizer, 'checkpoint_dir', '?'))!r} has no EOS token to end responses."
            )
        self.records = records
        self.tokenizer = tokenizer
        self.prompt_style = prompt_style
        self.max_seq_length = max_seq_length
        self.mask_prompt = mask_prompt
        self.ignore_index = ignore_index
        self.chat_template = chat_template
        if chat_template is not None:  # a conversation the template refuses stops the run before training starts
            for number, record in enumerate(records):
                if "messages" in record:
                    try:
                        templated_text(chat_template, record["messages"])
                    except UserError as error:
                        raise UserError(f"Conversation {number} of the data (counting from 0): {error}") from None

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        record = self.records[index]
        if self.chat_template is not None and "messages" in record:
            ids, prompt_length = templated_tokens(self.chat_template, self.tokenizer, record["messages"])
            tokens = torch.tensor(ids, dtype=torch.long)
        else:
            prompt, response = prompt_and_response(record, self.prompt_style)
            prompt_ids = self.tokenizer.encode(prompt, eos=False)
            response_ids = self.tokenizer.encode(response, bos=False, eos=False)
            eos = torch.tensor([self.tokenizer.eos_id], dtype=torch.long)
            tokens = torch.cat([prompt_ids.long(), response_ids.long(), eos])
            prompt_length = prompt_ids.numel()
        if self.max_seq_length > 0:
            tokens = tokens[: self.max_seq_length + 1]
        input_ids = tokens[:-1].clone()
        labels = tokens[1:].clone()
        if self.mask_prompt:
            labels[: max(prompt_length - 1, 0)] = self.ignore_index
        return {"input_ids": input_ids, "labels": labels}


# ---- data modules -----------------------------------------------------------------------------------------------------
class SFTDataModule(DataModule):
    """Base of the finetuning data modules.

    Subclasses are dataclasses with the fields `mask_prompt`, `val_split_fraction`, `prompt_style` (a style name,
    or None for the one `connect` passes, the checkpoint's; "alpaca" when there is neither), `ignore_index` and
    `seed`; they implement `load()` and, when their files can be fetched, `download()`.

    The `prompt_style` field keeps what the user chose; the style in use after `connect` is `self.style`.
    Conversations are laid out by the checkpoint's chat template (`self.chat_template`) when the tokenizer's folder
    has one and the user chose no style.
    """

    mask_prompt: bool = True
    val_split_fraction: Optional[float] = None
    prompt_style: Optional[Union[str, PromptStyle]] = None
    ignore_index: int = IGNORE_INDEX
    seed: int = 42

    def connect(
        self, tokenizer: "Tokenizer", max_seq_length: int, prompt_style: Optional[PromptStyle] = None
    ) -> None:
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        chosen = self.prompt_style
        if isinstance(chosen, str):
            self.style = PromptStyle.from_name(chosen)
        elif isinstance(chosen, PromptStyle):
            self.style = chosen
        elif prompt_style is not None:
            self.style = prompt_style
        else:
            self.style = AlpacaStyle()
        self.chat_template = None
        folder = getattr(tokenizer, "checkpoint_dir", None)
        if chosen is None and folder is not None:
            self.chat_template = ChatTemplate.from_checkpoint(folder)

    def download(self) -> None:
        """Fetch missing source files."""

    @abstractmethod
    def load(self) -> tuple[list[Record], list[Record]]:
        """(train records, val records), checked."""

    def prepare(self) -> None:
        self.download()
        self.records()

    def records(self) -> tuple[list[Record], list[Record]]:
        """(train, val) records, read once."""
        cached = getattr(self, "_records", None)
        if cached is None:
            cached = self._records = self.load()
        return cached

    def split(self, records: Sequence[Record]) -> tuple[list[Record], list[Record]]:
        if self.val_split_fraction is None:
            raise UserError(f"{type(self).__name__}: set val_split_fraction to hold out part of the data for validation.")
        return split_records(records, self.val_split_fraction, self.seed)

    def check_packing(self) -> None:
        """Any instruction data can be packed (`litgpt.data.packing`)."""

    def train_dataset(self) -> Union[SFTDataset, PackedDataset]:
        """The training samples; with `packing`, packed into sequences of max_seq_length tokens (validation samples
        stay one per sequence, so the validation loss reads the same with and without packing)."""
        samples = self._dataset(self.records()[0])
        if not self.packing:
            return samples
        if self.max_seq_length < 1:
            raise RuntimeError("packing needs the max_seq_length that connect() sets")
        packed = PackedDataset(samples, self.max_seq_length, self.seed)
        print_once(f"Packed {len(samples):,} training samples into {len(packed):,} sequences of up to "
                   f"{self.max_seq_length} tokens ({packed.fill():.1%} of their tokens are samples' tokens).")
        return packed

    def val_dataset(self) -> SFTDataset:
        return self._dataset(self.records()[1])

    def _dataset(self, records: list[Record]) -> SFTDataset:
        if self.tokenizer is None:
            raise RuntimeError(f"{type(self).__name__}.connect(tokenizer, max_seq_length) must be called first.")
        return SFTDataset(
            records, self.tokenizer, self.style, self.max_seq_length, self.mask_prompt, self.ignore_index,
            getattr(self, "chat_template", None),
        )


def train_and_val_files(folder: Path) -> tuple[Path, Path]:
    """A data folder's train and val files (each .json or .jsonl), or a UserError saying what it needs."""
    train, val = find_split_file(folder, "train"), find_split_file(folder, "val")
    if train is None or val is None:
        raise UserError(f"The folder {str(folder)!r} needs train.json (or train.jsonl) and val.json (or val.jsonl); or "
                        "pass a single file with --data.val_split_fraction.")
    return train, val


def find_split_file(folder: Path, split: str) -> Optional[Path]:
    """`folder/split.json` or `folder/split.jsonl` (a UserError when both exist), or None."""
    found = [folder / f"{split}{suffix}" for suffix in (".json", ".jsonl") if (folder / f"{split}{suffix}").is_file()]
    if len(found) > 1:
        raise UserError(f"{str(folder)!r} has both {split}.json and {split}.jsonl; keep one.")
    return found[0] if found else None


@dataclass
class JSON(SFTDataModule):
    """Instruction or chat records from your own JSON files.

    Args:
        json_path: A .json file (a list of records), a .jsonl file (one record per line), or a folder with
            train.json(l) and val.json(l).
        mask_prompt: Leave the prompt out of the loss.
        val_split_fraction: For a single file: the share of records held out for validation (required then).
        prompt_style: Prompt style name (default: a chat model's own, alpaca for a base model).
        ignore_index: The label of tokens without loss.
        seed: Seed of the validation split.
    """

    json_path: Path
    mask_prompt: bool = True
    val_split_fraction: Optional[float] = None
    prompt_style: Optional[str] = None
    ignore_index: int = IGNORE_INDEX
    seed: int = 42

    def load(self) -> tuple[list[Record], list[Record]]:
        path = Path(self.json_path).expanduser()
        if path.is_dir():
            train, val = train_and_val_files(path)
            if self.val_split_fraction is not None:
                raise UserError(
                    f"{str(path)!r} has its own validation file: leave val_split_fraction unset, or pass a single file."
                )
            return load_records(train), load_records(val)
        if not path.exists():
            raise UserError(f"{str(path)!r} does not exist: pass a .json or .jsonl file, or a folder with train/val files.")
        if self.val_split_fraction is None:
            raise UserError(
                f"{str(path)!r} is a single file: set --data.val_split_fraction (e.g. 0.05) to hold out part of it for "
                "validation, or pass a folder with train.json(l) and val.json(l)."
            )
        return self.split(load_records(path))

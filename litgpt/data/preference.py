"""Preference data (`litgpt dpo`): a prompt with a chosen and a rejected answer, in TRL's two formats.

Standard (text):         {"prompt": "...", "chosen": "...", "rejected": "..."}
Conversational:          {"prompt": [{"role": "user", "content": "..."}, ...],
                          "chosen": [{"role": "assistant", "content": "..."}], "rejected": [...]}

Without "prompt" (TRL's implicit prompt), chosen and rejected are whole texts or conversations and the prompt is
what they share at the start. Other fields of a row are ignored.

Layout: a conversation is laid out by the checkpoint's own chat template where it has one (the prompt with the
assistant's opening, the answer as what the template writes after it), else by the prompt style, the answer ending
with EOS; a text prompt by the prompt style (the checkpoint's, or --data.prompt_style). Only the answer tokens have
labels: a sequence's log-probability is the sum over its answer.

Pairs longer than max_seq_length are cut as TRL does: the prompt loses tokens from its start, down to
`max_prompt_length` tokens if the longer answer needs the room, and the answers are cut at their end; how many pairs
were cut is said once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from litgpt.data.base import IGNORE_INDEX, DataModule
from litgpt.data.json_data import _check_messages, _type_name, iter_json, split_records, train_and_val_files
from litgpt.distributed.runtime import print_once
from litgpt.errors import UserError
from litgpt.prompts import ROLES, Alpaca as AlpacaStyle, PromptStyle

if TYPE_CHECKING:
    from litgpt.chat_template import ChatTemplate
    from litgpt.tokenizer import Tokenizer

Conversation = list[dict[str, str]]
Text = Union[str, Conversation]
PreferenceRecord = dict[str, Text]  # prompt, chosen, rejected: all strings, or all conversations
HF_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


# ---- reading and checking rows ---------------------------------------------------------------------------------------
def preference_record(raw: Any, where: str) -> PreferenceRecord:
    """A checked row: prompt, chosen and rejected, all text or all conversations (an implicit prompt taken out)."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected an object with \"prompt\", \"chosen\" and \"rejected\", got a "
                        f"{_type_name(raw)}.")
    for field in ("chosen", "rejected"):
        if field not in raw:
            raise UserError(f'{where}: missing "{field}" (a preference row needs "chosen" and "rejected", and '
                            'usually "prompt").')
    chosen, rejected = (_text(raw[field], where, field, answer=True) for field in ("chosen", "rejected"))
    if "prompt" in raw:
        prompt = _text(raw["prompt"], where, "prompt", answer=False)
    else:
        prompt, chosen, rejected = _split_implicit_prompt(chosen, rejected, where)
    if {type(prompt), type(chosen), type(rejected)} != {type(chosen)}:
        raise UserError(f'{where}: "prompt", "chosen" and "rejected" must all be text or all be lists of messages.')
    if chosen == rejected:
        raise UserError(f'{where}: "chosen" and "rejected" are the same answer, so the pair prefers nothing; fix or '
                        "drop the row.")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _text(value: Any, where: str, field: str, answer: bool) -> Text:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise UserError(f'{where}: "{field}" must be a string or a non-empty list of {{"role", "content"}} messages, '
                        f"not a {_type_name(value)}.")
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) or "role" not in message:
            raise UserError(f'{where}: {field}[{index}] must be an object with "role" and a string "content".')
        if message["role"] not in ROLES:
            raise UserError(f"{where}: {field}[{index}] has role {message['role']!r}; use one of {', '.join(ROLES)}.")
    if answer and value[-1]["role"] != "assistant":
        raise UserError(f'{where}: "{field}" must end with an assistant message (the answer).')
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _split_implicit_prompt(chosen: Text, rejected: Text, where: str) -> tuple[Text, Text, Text]:
    """TRL's implicit prompt: the longest shared start of two conversations (whole messages) or texts (without the
    space the answers start with)."""
    if type(chosen) is not type(rejected):
        raise UserError(f'{where}: "chosen" and "rejected" must both be text or both be lists of messages.')
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if isinstance(chosen, list):
        if shared == 0:
            raise UserError(f'{where}: no "prompt", and the two conversations share no first message to take as one.')
        _check_messages(chosen, where)
        return chosen[:shared], chosen[shared:], rejected[shared:]
    if shared > 0 and chosen[shared - 1] == " ":  # the answers keep the space they start with, as TRL splits them
        shared -= 1
    if shared == 0:
        raise UserError(f'{where}: no "prompt", and "chosen" and "rejected" share no start to take as one.')
    return chosen[:shared], chosen[shared:], rejected[shared:]


def load_preference_rows(rows, source: str) -> list[PreferenceRecord]:
    """Checked records of (raw row, where) pairs; a UserError names the first bad row."""
    records = [preference_record(raw, where) for raw, where in rows]
    if not records:
        raise UserError(f"{source} holds no preference rows.")
    return records


# ---- tokens ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairLayout:
    """How a record becomes prompt and answer text: the chat template for conversations where the checkpoint has
    one, else the prompt style (the answers then end with EOS)."""

    style: PromptStyle
    template: Optional["ChatTemplate"]

    def texts(self, record: PreferenceRecord) -> tuple[str, str, str, bool]:
        """(prompt, chosen, rejected, whether the answers still need EOS)."""
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
        if isinstance(prompt, str):
            return self.style.apply(prompt), chosen, rejected, True
        if self.template is None:
            return (self.style.apply_messages(prompt), _assistant_text(chosen), _assistant_text(rejected), True)
        opened = self.template.render(prompt, add_generation_prompt=True)
        answers = []
        for answer in (chosen, rejected):
            whole = self.template.render(prompt + answer)
            if not whole.startswith(opened):
                raise UserError(f"The chat template of {self.template.where} lays out the prompt differently when an "
                                "answer follows it, so the answer cannot be told apart from the prompt.")
            answers.append(whole[len(opened):])
        return opened, answers[0], answers[1], False


def _assistant_text(messages: Conversation) -> str:
    return "\n\n".join(m["content"] for m in messages)


def cut_pair(prompt: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, budget: int,
             max_prompt_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The pair within `budget` tokens per sequence: the prompt keeps its end (at least `max_prompt_length` tokens of
    it where the answers need the room), then the answers keep their start. Also whether anything was cut."""
    longer = max(chosen.numel(), rejected.numel())
    if prompt.numel() + longer <= budget:
        return prompt, chosen, rejected, False
    keep = max(budget - longer, min(prompt.numel(), max_prompt_length))
    prompt = prompt[prompt.numel() - keep:]
    room = budget - prompt.numel()
    return prompt, chosen[:room], rejected[:room], True


def shifted(prompt: torch.Tensor, answer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of prompt + answer for next-token prediction, only the answer's tokens labelled."""
    tokens = torch.cat([prompt, answer])
    labels = tokens[1:].clone()
    labels[: max(prompt.numel() - 1, 0)] = IGNORE_INDEX
    return tokens[:-1].clone(), labels


class PreferenceDataset:
    """Pairs tokenized once: sample i is {"input_ids", "labels"} of the chosen sequence and {"rejected_input_ids",
    "rejected_labels"} of the rejected one; `collate` stacks a micro-batch as one (2B, T) batch, chosen rows first."""

    def __init__(self, records: Sequence[PreferenceRecord], tokenizer: "Tokenizer", layout: PairLayout,
                 max_seq_length: int, max_prompt_length: int) -> None:
        if tokenizer.eos_id is None:
            raise UserError(f"The tokenizer in {str(tokenizer.checkpoint_dir)!r} has no EOS token to end answers.")
        eos = torch.tensor([tokenizer.eos_id])
        self.samples, self.truncated = [], 0
        for record in records:
            prompt, chosen, rejected, needs_eos = layout.texts(record)
            templated = layout.template is not None and not needs_eos
            prompt_ids = tokenizer.encode(prompt, bos=False if templated else None, eos=False)
            answers = [tokenizer.encode(text, bos=False, eos=False) for text in (chosen, rejected)]
            if needs_eos:
                answers = [torch.cat([ids, eos]) for ids in answers]
            prompt_ids, chosen_ids, rejected_ids, cut = cut_pair(prompt_ids, *answers, max_seq_length + 1,
                                                                 max_prompt_length)
            self.truncated += cut
            (input_ids, labels), (rejected_input_ids, rejected_labels) = (
                shifted(prompt_ids, chosen_ids), shifted(prompt_ids, rejected_ids))
            self.samples.append({"input_ids": input_ids, "labels": labels, "rejected_input_ids": rejected_input_ids,
                                 "rejected_labels": rejected_labels})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.samples[index]

    @staticmethod
    def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """{"input_ids", "labels"}: (2B, T), the chosen sequences then the rejected ones, right-padded (input 0,
        label IGNORE_INDEX); and "reference_logps" (2B,) in the same order where the samples carry them."""
        rows = [(s["input_ids"], s["labels"]) for s in samples]
        rows += [(s["rejected_input_ids"], s["rejected_labels"]) for s in samples]
        length = max(ids.numel() for ids, _ in rows)
        input_ids = torch.zeros(len(rows), length, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        for row, (ids, row_labels) in enumerate(rows):
            input_ids[row, : ids.numel()] = ids
            labels[row, : ids.numel()] = row_labels
        batch = {"input_ids": input_ids, "labels": labels}
        if "reference_logps" in samples[0]:
            pairs = torch.stack([s["reference_logps"] for s in samples])  # (B, 2): chosen, rejected
            batch["reference_logps"] = torch.cat([pairs[:, 0], pairs[:, 1]])
        return batch


class WithReferenceLogps:
    """A `PreferenceDataset` whose samples also carry the reference's summed log-probabilities, (chosen, rejected)."""

    def __init__(self, dataset: PreferenceDataset, logps: torch.Tensor) -> None:
        if logps.shape != (len(dataset), 2):
            raise ValueError(f"expected ({len(dataset)}, 2) reference log-probabilities, got {tuple(logps.shape)}")
        self.dataset, self.logps = dataset, logps
        self.collate = dataset.collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**self.dataset[index], "reference_logps": self.logps[index]}


# ---- the data module -------------------------------------------------------------------------------------------------
@dataclass
class Preference(DataModule):
    """Preference pairs from JSON/JSONL files or a Hugging Face dataset (see the module docstring).

    Args:
        json_path: A .json file (a list of rows), a .jsonl file (one row per line), or a folder with train.json(l)
            and val.json(l).
        dataset: Instead of json_path: a Hugging Face dataset, by hub name or as a local folder or a .json(l),
            .parquet, .csv or .arrow file (read with `datasets.load_dataset`).
        name: The dataset's configuration name, if it has several.
        split: The dataset's split to train on.
        val_split: The dataset's split to validate on (else val_split_fraction of `split` is held out).
        val_split_fraction: The share of rows held out for validation (a single file, or a dataset without
            val_split).
        prompt_style: Prompt style name for text prompts, and for conversations where the checkpoint has no chat
            template (default: a chat model's own, alpaca for a base model).
        max_prompt_length: The tokens a prompt keeps at least (its end) when a pair is longer than max_seq_length
            (default: half of max_seq_length).
        seed: Seed of the validation split.
    """

    json_path: Optional[Path] = None
    dataset: Optional[str] = None
    name: Optional[str] = None
    split: str = "train"
    val_split: Optional[str] = None
    val_split_fraction: Optional[float] = None
    prompt_style: Optional[str] = None
    max_prompt_length: Optional[int] = None
    seed: int = 42

    def connect(self, tokenizer: "Tokenizer", max_seq_length: int, prompt_style: Optional[PromptStyle] = None) -> None:
        from litgpt.chat_template import ChatTemplate

        self.tokenizer, self.max_seq_length = tokenizer, max_seq_length
        if self.prompt_style is not None:
            style = PromptStyle.from_name(self.prompt_style)
        else:
            style = prompt_style or AlpacaStyle()
        self.style = style  # what checkpoints record as the style the model was tuned in
        self.layout = PairLayout(style, ChatTemplate.from_checkpoint(tokenizer.checkpoint_dir))

    def check_packing(self) -> None:
        if self.packing:
            raise UserError("--data.packing does not apply to preference pairs: each pair's chosen and rejected "
                            "answers are compared as whole sequences; drop --data.packing.")

    def prompt_budget(self) -> int:
        """The tokens a cut prompt keeps at least; a UserError when that leaves the answers no room."""
        budget = self.max_seq_length + 1
        keep = self.max_prompt_length if self.max_prompt_length is not None else budget // 2
        if not 0 < keep < budget - 1:
            raise UserError(
                f"--data.max_prompt_length {keep} leaves no room for the answer in sequences of --train.max_seq_length "
                f"{self.max_seq_length} tokens: give a prompt length between 1 and {self.max_seq_length - 2}, or "
                "raise --train.max_seq_length.")
        return keep

    def prepare(self) -> None:
        self.records()

    def records(self) -> tuple[list[PreferenceRecord], list[PreferenceRecord]]:
        """(train, val) records, read and checked once."""
        cached = getattr(self, "_records", None)
        if cached is None:
            cached = self._records = self._load()
        return cached

    def _load(self) -> tuple[list[PreferenceRecord], list[PreferenceRecord]]:
        if (self.json_path is None) == (self.dataset is None):
            raise UserError("--data Preference needs its pairs: give --data.json_path (a .json/.jsonl file or a folder "
                            "with train and val files) or --data.dataset (a Hugging Face dataset), one of the two.")
        if self.json_path is not None:
            return self._load_json(Path(self.json_path).expanduser())
        train = load_preference_rows(hf_dataset_rows(self.dataset, self.name, self.split), f"{self.dataset!r}")
        if self.val_split is not None:
            if self.val_split_fraction is not None:
                raise UserError("Give --data.val_split or --data.val_split_fraction, not both.")
            return train, load_preference_rows(hf_dataset_rows(self.dataset, self.name, self.val_split), f"{self.dataset!r}")
        return self._split(train, f"{self.dataset!r} has no --data.val_split")

    def _load_json(self, path: Path) -> tuple[list[PreferenceRecord], list[PreferenceRecord]]:
        if path.is_dir():
            train, val = train_and_val_files(path)
            if self.val_split_fraction is not None:
                raise UserError(f"{str(path)!r} has its own validation file: leave val_split_fraction unset.")
            return (load_preference_rows(iter_json(train), repr(str(train))),
                    load_preference_rows(iter_json(val), repr(str(val))))
        if not path.exists():
            raise UserError(f"{str(path)!r} does not exist: pass a .json or .jsonl file, or a folder with train/val "
                            "files.")
        return self._split(load_preference_rows(iter_json(path), repr(str(path))), f"{str(path)!r} is a single file")

    def _split(self, records, what: str):
        if self.val_split_fraction is None:
            raise UserError(f"{what}: set --data.val_split_fraction (e.g. 0.05) to hold out part of it for validation.")
        return split_records(records, self.val_split_fraction, self.seed)

    def train_dataset(self) -> PreferenceDataset:
        return self._dataset(self.records()[0], "training")

    def val_dataset(self) -> PreferenceDataset:
        return self._dataset(self.records()[1], "validation")

    def _dataset(self, records: list[PreferenceRecord], which: str) -> PreferenceDataset:
        if self.tokenizer is None:
            raise RuntimeError("Preference.connect(tokenizer, max_seq_length) must be called first.")
        dataset = PreferenceDataset(records, self.tokenizer, self.layout, self.max_seq_length, self.prompt_budget())
        if dataset.truncated:
            print_once(f"Cut {dataset.truncated:,} of {len(dataset):,} {which} pairs to --train.max_seq_length "
                       f"{self.max_seq_length} (prompts from their start, then answers from their end).")
        return dataset


def hf_dataset_rows(dataset: str, name: Optional[str], split: str):
    """(row, where) of a Hugging Face dataset's split: a local data file, a local folder, or a hub name."""
    try:
        import datasets
    except ImportError:
        raise UserError("--data.dataset reads Hugging Face datasets: `pip install datasets`.") from None
    path = Path(dataset).expanduser()
    try:
        if path.is_file():
            builder = HF_FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise UserError(f"{str(path)!r}: a dataset file must be one of {', '.join(HF_FILE_BUILDERS)}.")
            loaded = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
        else:
            loaded = datasets.load_dataset(str(path) if path.is_dir() else dataset, name, split=split)
    except UserError:
        raise
    except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as error:
        raise UserError(f"Could not read the dataset {dataset!r} (split {split!r}): {error}") from None
    for index, row in enumerate(loaded):
        yield row, f"{dataset!r} {split}[{index}]"

"""Reward functions of `litgpt grpo`: the built-ins and a user's own, with TRL's signature
`fn(prompts, completions, **row_fields) -> list[float]`, so that a reward written for TRL's GRPOTrainer works here
unchanged. `prompts` and `completions` are texts, or chat messages when the row's prompt is a conversation (each
completion then one assistant message); every other field of the data's rows arrives as a keyword, one value per
completion.

`--reward module:function` imports the user's code as they ask: a module on the path (`my_rewards:accuracy`) or a
Python file (`path/to/rewards.py:accuracy`). Built-ins take an optional argument after `=`: `regex_format=PATTERN`,
`length_penalty=CHARACTERS`.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from litgpt.errors import UserError

RewardFunction = Callable[..., Sequence[float]]
DEFAULT_FORMAT = r"(?s)\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"  # DeepSeek-R1's reasoning layout
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def completion_text(completion: Any) -> str:
    """A completion as text: itself, or the content of its (assistant) messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)


def boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} in `text` (braces nested inside it kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for position in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth < 0:
            return text[begin:position]
    return None


def final_answer(text: str) -> Optional[str]:
    """The answer a completion gives: its last \\boxed{} content, else its last number, else None."""
    inside = boxed(text)
    if inside is not None:
        return inside.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def same_answer(given: Optional[str], expected: Any) -> bool:
    """Equal as numbers where both read as numbers (1,000 = 1000.0), else as trimmed text."""
    if given is None:
        return False
    given, expected = given.strip(), str(expected).strip()
    try:
        return math.isclose(float(given.replace(",", "")), float(expected.replace(",", "")), rel_tol=1e-9)
    except ValueError:
        return given == expected


def exact_answer(prompts, completions, answer, **fields) -> list[float]:
    """1 where the completion's final answer (\\boxed{} or its last number) equals the row's `answer`, else 0."""
    return [float(same_answer(final_answer(completion_text(c)), a)) for c, a in zip(completions, answer)]


def regex_format(pattern: str = DEFAULT_FORMAT) -> RewardFunction:
    """1 where the whole completion matches `pattern` (default: <think>...</think><answer>...</answer>), else 0."""
    compiled = re.compile(pattern)

    def reward(prompts, completions, **fields) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c)) is not None) for c in completions]

    return reward


def length_penalty(limit: str = "1000") -> RewardFunction:
    """0 up to `limit` characters, then falling linearly to -1 at twice the limit (and staying there)."""
    characters = int(limit)

    def reward(prompts, completions, **fields) -> list[float]:
        return [-min(1.0, max(0, len(completion_text(c)) - characters) / characters) for c in completions]

    return reward


BUILT_INS: dict[str, Callable[..., RewardFunction]] = {
    "exact_answer": lambda: exact_answer, "regex_format": regex_format, "length_penalty": length_penalty,
}


def load_reward(spec: str) -> RewardFunction:
    """The reward function `spec` names: a built-in (with its `=argument`), or `module:function`."""
    name, _, argument = spec.partition("=")
    if name in BUILT_INS:
        try:
            return BUILT_INS[name](*([argument] if argument else []))
        except (TypeError, ValueError, re.error) as error:
            raise UserError(f"--reward {spec!r}: {name} cannot take {argument!r} ({error}).") from None
    module_name, colon, function_name = spec.rpartition(":")
    if not colon or not module_name or not function_name:
        raise UserError(f"--reward {spec!r} is neither a built-in ({', '.join(BUILT_INS)}) nor module:function "
                        "(an importable module or a .py file, and the function's name).")
    module = import_user_module(module_name, spec)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserError(f"--reward {spec!r}: {module_name} has no function {function_name!r}.")
    return function


def import_user_module(name: str, spec: str):
    """The user's module: a .py file by path, else an importable module (their own code, imported as they ask)."""
    path = Path(name).expanduser()
    try:
        if name.endswith(".py"):
            if not path.is_file():
                raise UserError(f"--reward {spec!r}: there is no file {str(path)!r}.")
            module_spec = importlib.util.spec_from_file_location(f"litgpt_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(name)
    except UserError:
        raise
    except Exception as error:  # the user's code failed to import: say which and why, in one line
        raise UserError(f"--reward {spec!r}: importing {name} failed ({type(error).__name__}: {error}).") from None


@dataclass
class Rewards:
    """The run's reward functions, by the names they are logged under, and their weights in the total."""

    names: list[str]
    functions: list[RewardFunction]
    weights: list[float]

    @classmethod
    def from_specs(cls, specs: Sequence[str], weights: Optional[Sequence[float]]) -> "Rewards":
        if not specs:
            raise UserError("Give at least one reward: --reward exact_answer (or regex_format, length_penalty, or your "
                            "own module:function).")
        if weights is not None and len(weights) != len(specs):
            raise UserError(f"--reward_weights has {len(weights)} values for {len(specs)} rewards: give one per "
                            "--reward, in the same order.")
        names = [spec.partition("=")[0].rpartition(":")[2] for spec in specs]
        names = [f"{name}_{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]
        return cls(names, [load_reward(spec) for spec in specs],
                   [1.0] * len(specs) if weights is None else [float(w) for w in weights])

    def score(self, prompts: list, completions: list, fields: dict[str, list]) -> torch.Tensor:
        """(completions, rewards) float64 values of every reward function; a UserError where one does not return a
        finite number per completion."""
        columns = []
        for name, function in zip(self.names, self.functions):
            values = function(prompts=prompts, completions=completions, **fields)
            columns.append(checked_values(values, len(completions), name))
        return torch.tensor(columns, dtype=torch.float64).T.reshape(len(completions), len(self.names))

    def total(self, scores: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each completion's rewards, (completions,)."""
        return scores @ torch.tensor(self.weights, dtype=scores.dtype)


def checked_values(values: Any, count: int, name: str) -> list[float]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        numbers = [float(v) for v in values] if not isinstance(values, (str, bytes)) else None
    except (TypeError, ValueError):
        numbers = None
    if numbers is None or len(numbers) != count or not all(math.isfinite(v) for v in numbers):
        shown = repr(values)[:80]
        raise UserError(f"The reward {name} returned {shown}: it must return one finite number per completion "
                        f"({count} here), as TRL's reward functions do.")
    return numbers

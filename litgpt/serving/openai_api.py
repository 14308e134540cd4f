"""The OpenAI API's request fields and response objects, as far as `litgpt serve` supports them.

Requests are checked field by field: a wrong type or value, or a feature the server does not have (logprobs, tools,
penalties), is a `RequestError` that the server answers with a 4xx JSON error in OpenAI's shape; fields it does not
know are ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

MAX_STOP_STRINGS = 4  # as OpenAI's API

# Fields of features the server does not have, with the values that mean "off" (accepted and ignored).
UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
}


class RequestError(Exception):
    """A request the server refuses: HTTP `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: Optional[str] = None,
                 param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def invalid(param: str, message: str) -> RequestError:
    return RequestError(400, message, code="invalid_value", param=param)


@dataclass
class Sampling:
    """How to generate: the request's values, or the defaults of OpenAI's API (and the server's token cap)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def optional_field(body: dict, name: str, check, expected: str, default: Any) -> Any:
    """body[name] if present and not null, after `check(value)`; else `default`."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise invalid(name, f"'{name}' must be {expected}, got {value!r}.")
    return value


def parse_sampling(body: dict, max_new_tokens: int, max_n: int) -> Sampling:
    """The sampling options of a request; `max_tokens` above the server's `--max_new_tokens` is lowered to it."""
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise invalid(name, f"'{name}' is not supported by litgpt serve; leave it out.")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and not (is_int(max_tokens) and max_tokens >= 1):
        raise invalid("max_tokens", f"'max_tokens' must be a whole number >= 1, got {max_tokens!r}.")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
                                 and all(isinstance(s, str) and s for s in stop)):
        raise invalid("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them.")
    stream_options = optional_field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    return Sampling(
        max_tokens=min(max_tokens or max_new_tokens, max_new_tokens),
        temperature=optional_field(body, "temperature", lambda v: is_number(v) and 0 <= v <= 2, "in [0, 2]", 1.0),
        top_p=optional_field(body, "top_p", lambda v: is_number(v) and 0 < v <= 1, "in (0, 1]", 1.0),
        top_k=optional_field(body, "top_k", lambda v: is_int(v) and v >= 1, "a whole number >= 1", None),
        seed=optional_field(body, "seed", is_int, "a whole number", None),
        stop=tuple(stop or ()),
        n=optional_field(body, "n", lambda v: is_int(v) and 1 <= v <= max_n, f"a whole number in [1, {max_n}]", 1),
        stream=optional_field(body, "stream", lambda v: isinstance(v, bool), "true or false", False),
        include_usage=bool(stream_options.get("include_usage", False)),
    )


def chat_messages(body: dict) -> list[tuple[str, str]]:
    """The request's messages as (role, text) pairs; text parts of a message's content list are joined."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects.",
                           code="missing_required_parameter" if messages is None else "invalid_value",
                           param="messages")
    pairs = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}]", f"messages[{i}] must be an object with a 'role' and a 'content'.")
        role = "system" if message["role"] == "developer" else message["role"]
        if role not in ("system", "user", "assistant"):
            raise invalid(f"messages[{i}].role", f"messages[{i}] has role {role!r}; use system, user or assistant.")
        pairs.append((role, message_text(message.get("content"), i)))
    return pairs


def message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid(f"messages[{i}].content",
                  f"messages[{i}].content must be a string or a list of {{\"type\": \"text\", \"text\"}} parts.")


def completion_prompt(body: dict) -> "str | list[int]":
    """The request's prompt: a string, a list holding one string, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(i) for i in prompt)):
        return prompt
    if prompt is None:
        raise RequestError(400, "'prompt' is required: the text to continue.", code="missing_required_parameter",
                           param="prompt")
    raise invalid("prompt", "'prompt' must be a string, or a list of token ids (one prompt per request).")


# ---- response objects -----------------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(chat: bool, index: int, text: Optional[str], finish_reason: Optional[str], stream: bool,
           first: bool = False) -> dict:
    """One entry of `choices`: a whole answer, or (stream) one piece of it."""
    if not chat:
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if not stream:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}
    delta = {} if text is None else {"content": text}
    if first:
        delta["role"] = "assistant"
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def response(chat: bool, id: str, model: str, choices: list[dict], stream: bool,
             usage: Optional[dict] = None) -> dict:
    object = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    body = {"id": id, "object": object, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None or not stream:
        body["usage"] = usage
    return body


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "litgpt"}

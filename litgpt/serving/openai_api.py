"""The OpenAI API's request models and response objects, as far as `litgpt serve` supports them.

Requests are pydantic models of OpenAI's schema, checked strictly ("5" is not a number): a wrong type or value, or a
feature the server does not have (logprobs, penalties), is a `RequestError` that the server answers with a 4xx JSON
error in OpenAI's shape; fields it does not know are ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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
    "functions": (None, []),
    "tool_choice": (None, "auto", "none"),
    "response_format": (None, {"type": "text"}),
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


# ---- requests -------------------------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both completion endpoints share."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=1)  # an extension of OpenAI's fields, as vLLM's
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    n: Optional[int] = Field(None, ge=1)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > MAX_STOP_STRINGS or not all(stops)):
            raise ValueError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
        return stops


class ChatMessage(BaseModel):
    """A message; its other fields (tool_calls, tool_call_id, name, reasoning_content, ...) go to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        if isinstance(content, list):
            if not all(part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
                raise ValueError('content parts must be {"type": "text", "text": ...}: this server reads text only')
            return "".join(part["text"] for part in content)
        return content


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[dict]] = None
    chat_template_kwargs: Optional[dict] = None  # as vLLM's: extra variables for the template (enable_thinking, ...)


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, list) and not all(isinstance(i, int) for i in prompt):
            raise ValueError("'prompt' must be a string or a list of token ids (one prompt per request)")
        return prompt


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


TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list"}  # pydantic names a union's member in an error's place


def parse_request(raw: bytes, chat: bool) -> Union[ChatRequest, CompletionRequest]:
    """The request model of a JSON body, or the RequestError that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(400, f"The request body is not valid JSON: {error}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.", code="invalid_json")
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise invalid(name, f"'{name}' is not supported by litgpt serve; leave it out.")
    try:
        return (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if str(part) not in TYPE_TAGS and "[" not in str(part))
        if first["type"] == "missing":
            what = "the messages of the conversation" if chat else "the text to continue"
            raise RequestError(400, f"'{param}' is required: {what}.", code="missing_required_parameter",
                               param=param) from None
        raise invalid(param, f"'{param}': {first['msg']} (got {first.get('input')!r:.80}).") from None


def sampling_of(request: SamplingRequest, max_new_tokens: int, max_n: int) -> Sampling:
    """The sampling options of a request; `max_tokens` above the server's `--max_new_tokens` is lowered to it."""
    if request.n is not None and request.n > max_n:
        raise invalid("n", f"'n' must be at most {max_n} (the server's --max_batch_size), got {request.n}.")
    max_tokens = request.max_completion_tokens or request.max_tokens or max_new_tokens
    return Sampling(
        max_tokens=min(max_tokens, max_new_tokens),
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=tuple(request.stop or ()),
        n=request.n or 1,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
    )


def template_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The messages as chat templates read them: "developer" is "system", tool calls' JSON arguments are objects
    (as transformers' templates expect them)."""
    messages = []
    for message in request.messages:
        fields = message.model_dump()
        if fields["role"] == "developer":
            fields["role"] = "system"
        for call in fields.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass  # left as the client wrote it
        messages.append(fields)
    return messages


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

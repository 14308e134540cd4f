"""From a checked request to text: the prompt's token ids, the sequences handed to an engine, and the text pieces
that come back, cut at the request's stop strings. The HTTP layer (`app.py`) only reads and writes.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

from litgpt.errors import UserError
from litgpt.serving import openai_api as api
from litgpt.serving.engine import BatchingEngine, Sequence


class StopStrings:
    """Cuts streamed text at the first of `stops`, holding back a tail that could begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that is sure to come before any stop string, and whether a stop string was found."""
        self.buffer += text
        found = [i for i in (self.buffer.find(stop) for stop in self.stops) if i >= 0]
        if found:
            out, self.buffer = self.buffer[: min(found)], ""
            return out, True
        keep = max((n for stop in self.stops for n in range(min(len(stop) - 1, len(self.buffer)), 0, -1)
                    if self.buffer.endswith(stop[:n])), default=0)
        out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


@dataclass
class Event:
    """A piece of one choice's text; `finish_reason` is set on its last piece."""

    index: int
    text: str
    finish_reason: Optional[str] = None


class GenerationFailed(Exception):
    """The engine ended a sequence with an error (logged by the engine; the client is told "internal error")."""


class RequestTimedOut(Exception):
    """The request ran past the server's --request_timeout."""


class LoopQueue:
    """An asyncio queue that the engine's thread fills (`put`), read on the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: tuple) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Generation:
    """The n choices of one request in flight: `async for` its `Event`s; `close()` drops what is still running."""

    def __init__(self, service: "Service", engine: BatchingEngine, prompt_ids: list[int], sampling: api.Sampling,
                 stops: list[list[int]]) -> None:
        from litgpt.tokenizer import IncrementalDecoder

        self.events = LoopQueue()
        self.deadline = time.monotonic() + service.request_timeout
        self.sequences = []
        for index in range(sampling.n):
            generator = None
            if sampling.temperature > 0:
                seed = random.randrange(2**62) if sampling.seed is None else sampling.seed + index
                generator = torch.Generator(device=engine.device).manual_seed(seed)
            self.sequences.append(Sequence(
                prompt_ids, sampling.max_tokens, sampling.temperature, sampling.top_k, sampling.top_p, stops,
                generator, self.events, index,
            ))
        self.decoders = [IncrementalDecoder(service.tokenizer, prompt_ids=prompt_ids) for _ in self.sequences]
        self.stop_strings = [StopStrings(sampling.stop) for _ in self.sequences]
        self.running = len(self.sequences)
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        for sequence in self.sequences:
            engine.submit(sequence)

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> Event:
        while self.running:
            try:
                kind, index, value = await asyncio.wait_for(self.events.queue.get(), self.deadline - time.monotonic())
            except asyncio.TimeoutError:
                self.close()
                raise RequestTimedOut() from None
            if self.sequences[index].cancelled:
                continue
            if kind == "error":
                self.close()
                raise GenerationFailed(value)
            if kind == "tokens":
                self.completion_tokens += len(value)
                text, stopped = self.stop_strings[index].feed("".join(self.decoders[index].step(t) for t in value))
                if stopped:
                    self.sequences[index].cancelled = True
                    self.running -= 1
                return Event(index, text, "stop" if stopped else None)
            self.running -= 1
            text, stopped = self.stop_strings[index].feed(self.decoders[index].finish())
            return Event(index, text + ("" if stopped else self.stop_strings[index].flush()),
                         "stop" if stopped else value)
        raise StopAsyncIteration

    async def collect(self) -> tuple[list[str], list[Optional[str]]]:
        """Every choice's whole text and finish reason."""
        texts, reasons = [""] * len(self.sequences), [None] * len(self.sequences)
        async for event in self:
            texts[event.index] += event.text
            reasons[event.index] = event.finish_reason or reasons[event.index]
        return texts, reasons

    def close(self) -> None:
        for sequence in self.sequences:
            sequence.cancelled = True


class Service:
    """What the routes share: the served names, the tokenizer, the chat layout and the engines, and the limits."""

    def __init__(self, names: list[str], tokenizer, chat_format, engines: list[BatchingEngine], max_new_tokens: int,
                 max_waiting: int, request_timeout: float) -> None:
        self.names, self.tokenizer, self.chat_format, self.engines = names, tokenizer, chat_format, engines
        self.max_new_tokens, self.max_waiting, self.request_timeout = max_new_tokens, max_waiting, request_timeout
        self.max_seq_length = engines[0].max_seq_length
        self.max_n = engines[0].max_batch_size
        self.created = int(time.time())

    @property
    def name(self) -> str:
        return self.names[0]

    def failure(self) -> Optional[str]:
        """Why the server cannot serve (an engine stopped), or None."""
        return next((engine.failure or "the generation engine stopped" for engine in self.engines
                     if not engine.alive), None)

    def stats(self) -> dict:
        totals: dict = {}
        for engine in self.engines:
            for key, value in engine.stats().items():
                totals[key] = max(totals.get(key, 0), value) if key == "largest_batch" else totals.get(key, 0) + value
        return totals

    def start(self, request: Union[api.ChatRequest, api.CompletionRequest], chat: bool) -> tuple[Generation,
                                                                                                    api.Sampling]:
        """Check a request and start generating its choices."""
        if request.model is not None and request.model not in self.names:
            raise api.RequestError(404, f"The model {request.model!r} does not exist: this server serves "
                                        f"{self.name!r}.", code="model_not_found", param="model")
        sampling = api.sampling_of(request, self.max_new_tokens, self.max_n)
        if chat:
            prompt_ids, stops = self.chat_prompt(request), self.chat_format.stop_sequences()
        else:
            prompt_ids, stops = self.encode_prompt(request.prompt), [[i] for i in self.tokenizer.stop_ids]
        if not prompt_ids:
            raise api.invalid("prompt", "The prompt is empty: give at least one token of text.")
        if len(prompt_ids) >= self.max_seq_length:
            raise api.RequestError(
                400, f"The prompt is {len(prompt_ids)} tokens long, but this server serves sequences of up to "
                     f"{self.max_seq_length} tokens: shorten it to at most {self.max_seq_length - 1}.",
                code="context_length_exceeded", param="messages" if chat else "prompt")
        if self.failure() is not None:
            raise api.RequestError(503, "The server cannot generate anymore; see its log.", type="server_error",
                                   code="unavailable")
        engine = min((e for e in self.engines if e.alive), key=BatchingEngine.load)
        if engine.queued + sampling.n - engine.free_rows() > self.max_waiting:
            raise api.RequestError(429, f"{engine.queued} sequences are waiting for a batch row (the server's "
                                        f"--max_waiting is {self.max_waiting}): retry later.",
                                   type="rate_limit_error", code="too_many_requests")
        return Generation(self, engine, prompt_ids, sampling, stops), sampling

    def chat_prompt(self, request: api.ChatRequest) -> list[int]:
        try:
            return self.chat_format.prompt_ids(api.template_messages(request), add_generation_prompt=True,
                                               tools=request.tools, **(request.chat_template_kwargs or {}))
        except UserError as error:  # roles out of the order the template needs, tools without a template, ...
            raise api.invalid("messages", str(error)) from None

    def encode_prompt(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).tolist()
        vocab_size = self.engines[0].model.config.padded_vocab_size
        if not all(0 <= i < vocab_size for i in prompt):
            raise api.invalid("prompt", f"Token ids of 'prompt' must be in [0, {vocab_size}).")
        return prompt

"""`litgpt serve`: the HTTP server (standard library only) and the command.

Each connection is handled by a thread of `ThreadingHTTPServer`: it checks and tokenizes the request, hands its
sequences to the least busy `BatchingEngine` and turns the token ids the engine sends back into text, cut at the
request's stop strings, written as one JSON object or as server-sent events.
"""

from __future__ import annotations

import json
import queue
import random
import sys
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from litgpt.errors import UserError
from litgpt.serving import openai_api as api
from litgpt.serving.engine import BatchingEngine, Sequence

MAX_BODY_BYTES = 8 << 20


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


class Generation:
    """The n choices of one request in flight: iterate it for `Event`s; `close()` drops what is still running."""

    def __init__(self, service: "Service", prompt_ids: list[int], sampling: api.Sampling,
                 stops: list[list[int]]) -> None:
        from litgpt.tokenizer import IncrementalDecoder

        engine = min(service.engines, key=BatchingEngine.load)
        self.events: "queue.Queue[tuple]" = queue.Queue()
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
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        for sequence in self.sequences:
            engine.submit(sequence)

    def __iter__(self) -> Iterator[Event]:
        running = len(self.sequences)
        while running:
            kind, index, value = self.events.get()
            if self.sequences[index].cancelled:
                continue
            if kind == "error":
                self.close()
                raise RuntimeError(value)
            if kind == "tokens":
                self.completion_tokens += len(value)
                text, stopped = self.stop_strings[index].feed("".join(self.decoders[index].step(t) for t in value))
                if stopped:
                    self.sequences[index].cancelled = True
                    running -= 1
                yield Event(index, text, "stop" if stopped else None)
            else:
                running -= 1
                text, stopped = self.stop_strings[index].feed(self.decoders[index].finish())
                yield Event(index, text + ("" if stopped else self.stop_strings[index].flush()),
                            "stop" if stopped else value)

    def close(self) -> None:
        for sequence in self.sequences:
            sequence.cancelled = True


class Service:
    """What the request handlers share: the model's name, tokenizer, prompt style and engines."""

    def __init__(self, name: str, tokenizer, style, engines: list[BatchingEngine], max_new_tokens: int) -> None:
        self.name, self.tokenizer, self.style, self.engines = name, tokenizer, style, engines
        self.max_new_tokens = max_new_tokens
        self.block_size = engines[0].block_size
        self.max_n = engines[0].max_batch_size
        self.created = int(time.time())

    def start(self, body: dict, chat: bool) -> tuple[Generation, api.Sampling]:
        """Check a request and start generating its choices."""
        model = body.get("model")
        if model is not None and model != self.name:
            raise api.RequestError(404, f"The model {model!r} does not exist: this server serves {self.name!r}.",
                                   code="model_not_found", param="model")
        sampling = api.parse_sampling(body, self.max_new_tokens, self.max_n)
        if chat:
            messages = api.chat_messages(body)
            try:
                prompt_ids = self.tokenizer.encode(self.style.apply_messages(messages)).tolist()
            except UserError as error:  # e.g. roles out of the order the template needs
                raise api.invalid("messages", str(error)) from None
            stops = [list(s) for s in self.style.stop_tokens(self.tokenizer)]
        else:
            prompt_ids = self.encode_prompt(api.completion_prompt(body))
            stops = [[i] for i in self.tokenizer.stop_ids]
        if not prompt_ids:
            raise api.invalid("prompt", "The prompt is empty: give at least one token of text.")
        if len(prompt_ids) >= self.block_size:
            raise api.RequestError(
                400, f"The prompt is {len(prompt_ids)} tokens long, but the model's context is {self.block_size} "
                     f"tokens: shorten it to at most {self.block_size - 1}.", code="context_length_exceeded",
                param="messages" if chat else "prompt")
        return Generation(self, prompt_ids, sampling, stops), sampling

    def encode_prompt(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).tolist()
        vocab_size = self.engines[0].model.config.padded_vocab_size
        if not all(0 <= i < vocab_size for i in prompt):
            raise api.invalid("prompt", f"Token ids of 'prompt' must be in [0, {vocab_size}).")
        return prompt


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "litgpt-serve"
    service: Service  # set on the subclass made by `make_server`

    # ---- routing -------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        service = self.service
        if path in ("/health", "/v1/health"):
            busy = sum(engine.load() for engine in service.engines)  # decoding or waiting for a row
            largest = max(engine.largest_batch for engine in service.engines)
            self.send_json(200, {"status": "ok", "model": service.name, "requests_in_flight": busy,
                                 "largest_batch": largest})
        elif path == "/v1/models":
            self.send_json(200, api.model_list(service.name, service.created))
        elif path == f"/v1/models/{service.name}":
            self.send_json(200, api.model_card(service.name, service.created))
        elif path.startswith("/v1/models/"):
            self.send_error_json(api.RequestError(404, f"The model {path[len('/v1/models/'):]!r} does not exist: "
                                                       f"this server serves {service.name!r}.", code="model_not_found"))
        else:
            self.send_error_json(api.RequestError(404, f"No route {path!r}; see /v1/models.", code="not_found"))

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        routes = {"/v1/chat/completions": True, "/v1/completions": False}
        try:
            body = self.read_json()  # read before answering, even a 404, so that the connection stays usable
            if path not in routes:
                raise api.RequestError(404, f"No route {path!r}: POST to /v1/chat/completions or /v1/completions.",
                                       code="not_found")
            generation, sampling = self.service.start(body, chat=routes[path])
        except api.RequestError as error:
            self.send_error_json(error)
            return
        except Exception as error:  # a bug of ours: answer, log its traceback, keep serving
            traceback.print_exc()
            self.send_error_json(api.RequestError(500, f"{type(error).__name__}: {error}", type="server_error",
                                                  code="internal_error"))
            return
        try:
            if sampling.stream:
                self.stream(generation, sampling, routes[path])
            else:
                self.answer(generation, routes[path])
        finally:
            generation.close()

    # ---- requests and answers ------------------------------------------------------------------------------------
    def read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise api.RequestError(411, "The request needs a Content-Length header.", code="length_required")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise api.RequestError(413, f"The request body is over {MAX_BODY_BYTES} bytes.", code="too_large")
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise api.RequestError(400, f"The request body is not valid JSON: {error}.", code="invalid_json") from None
        if not isinstance(body, dict):
            raise api.RequestError(400, "The request body must be a JSON object.", code="invalid_json")
        return body

    def answer(self, generation: Generation, chat: bool) -> None:
        texts, reasons = [""] * len(generation.sequences), [None] * len(generation.sequences)
        try:
            for event in generation:
                texts[event.index] += event.text
                reasons[event.index] = event.finish_reason or reasons[event.index]
        except RuntimeError as error:
            self.send_error_json(api.RequestError(500, str(error), type="server_error", code="generation_failed"))
            return
        choices = [api.choice(chat, i, texts[i], reasons[i], stream=False) for i in range(len(texts))]
        usage = api.usage(generation.prompt_tokens, generation.completion_tokens)
        self.send_json(200, api.response(chat, api.new_id(chat), self.service.name, choices, False, usage))

    def stream(self, generation: Generation, sampling: api.Sampling, chat: bool) -> None:
        """Server-sent events: one chunk per piece of text, a last chunk per choice with its finish_reason, the
        usage (with stream_options.include_usage), then `data: [DONE]`. The connection closes after it."""
        id, name = api.new_id(chat), self.service.name
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        started = set()
        try:
            for event in generation:
                first = chat and event.index not in started
                started.add(event.index)
                if event.text or first:
                    self.send_event(api.response(chat, id, name, [
                        api.choice(chat, event.index, event.text, None, stream=True, first=first)], stream=True))
                if event.finish_reason:
                    self.send_event(api.response(chat, id, name, [
                        api.choice(chat, event.index, None, event.finish_reason, stream=True)], stream=True))
            if sampling.include_usage:
                usage = api.usage(generation.prompt_tokens, generation.completion_tokens)
                self.send_event(api.response(chat, id, name, [], stream=True, usage=usage))
        except RuntimeError as error:
            self.send_event(api.RequestError(500, str(error), type="server_error", code="generation_failed").body())
        except (BrokenPipeError, ConnectionResetError):
            return  # the client left; `close()` frees its rows
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def send_event(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()

    def send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, error: api.RequestError) -> None:
        self.send_json(error.status, error.body())

    def log_message(self, format: str, *args) -> None:
        sys.stderr.write(f"{self.address_string()} {format % args}\n")


# ---- the command -------------------------------------------------------------------------------------------------
def make_server(host: str, port: int) -> ThreadingHTTPServer:
    """Bind the server (port 0 picks a free port: `server.server_address[1]`); it answers once its handler class has
    a `service` and `serve_forever` runs."""
    handler = type("ServiceHandler", (Handler,), {})
    # The standard library's listen backlog of 5 resets connections when more clients connect at once.
    server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128, "daemon_threads": True})
    try:
        server = server_class((host, port), handler)
    except OSError as error:
        raise UserError(f"Cannot listen on {host}:{port} ({error.strerror or error}); pick another --port or --host.")
    return server


def engine_devices(device: str, devices: int) -> list[str]:
    """One device per engine: `device` itself, or with --devices N > 1 the GPUs cuda:0..N-1 (one model copy each)."""
    if devices < 1:
        raise UserError(f"devices must be >= 1, got {devices}.")
    if devices == 1:
        return [device]
    if device not in ("auto", "cuda") or not torch.cuda.is_available():
        raise UserError(f"--devices {devices} serves one copy of the model per GPU and needs CUDA with --device auto "
                        "or cuda; on one device use --devices 1.")
    if devices > torch.cuda.device_count():
        raise UserError(f"--devices {devices} asks for more GPUs than the {torch.cuda.device_count()} here.")
    return [f"cuda:{i}" for i in range(devices)]


def main(
    checkpoint_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_new_tokens: int = 512,
    max_batch_size: int = 16,
    precision: Optional[str] = None,
    device: str = "auto",
    devices: int = 1,
) -> None:
    """Serve a litgpt checkpoint over HTTP with OpenAI's API: chat and text completions, streamed or not.

    The endpoints are /v1/chat/completions, /v1/completions, /v1/models and /health. Chat messages are laid out
    with the checkpoint's prompt style (model_config.yaml's prompt_style); completions continue the prompt as it is.
    Requests in flight are decoded together (continuous batching): each joins the batch between two decoding steps
    and leaves it when done. Ctrl-C stops the server.

    Args:
        checkpoint_dir: Folder with lit_model.pth, model_config.yaml and the tokenizer files. Its name is the
            model's name in the API (the "model" field of requests).
        host: The address to listen on; 0.0.0.0 listens on every interface (anyone who reaches it may use it).
        port: The port to listen on (0 picks a free one, printed at start).
        max_new_tokens: The most tokens of an answer: the default of a request's max_tokens and its cap.
        max_batch_size: The most sequences decoded together (each holds a row of the KV cache, of the model's
            context length); further requests wait for a free row.
        precision: The weights' precision: 32-true, 16-true or bf16-true. Default: bf16-true on GPUs
            (16-true without bf16 support) and on CPUs with native bf16 (AVX512-BF16 or AMX),
            32-true on other CPUs.
        device: Where to run: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.
        devices: With N > 1, one copy of the model on each of the GPUs cuda:0..N-1; a request goes to the least busy.
    """
    from litgpt.checkpoint.model_files import find_checkpoint_dir
    from litgpt.generate import load_model_and_tokenizer
    from litgpt.prompts import PromptStyle

    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if max_batch_size < 1:
        raise UserError(f"max_batch_size must be >= 1, got {max_batch_size}.")
    if not 0 <= port <= 65535:
        raise UserError(f"port must be in [0, 65535], got {port}.")
    checkpoint_dir = find_checkpoint_dir(Path(checkpoint_dir))
    targets = engine_devices(device, devices)
    server = make_server(host, port)  # before loading the model: a port in use is found at once
    engines, tokenizer = [], None
    for target in targets:
        model, tokenizer = load_model_and_tokenizer(checkpoint_dir, precision, target)
        engines.append(BatchingEngine(model, max_batch_size))
    style = PromptStyle.from_config(engines[0].model.config)
    name = checkpoint_dir.resolve().name
    server.RequestHandlerClass.service = Service(name, tokenizer, style, engines, max_new_tokens)
    for engine in engines:
        engine.start()
    address = f"http://{host}:{server.server_address[1]}"
    where = ", ".join(str(engine.device) for engine in engines)
    print(f"Serving {name!r} (prompt style {style.name!r}) at {address}/v1 on {where}, batches of up "
          f"to {max_batch_size}; Ctrl-C stops.", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("litgpt serve: stopped", file=sys.stderr)
    finally:
        server.server_close()

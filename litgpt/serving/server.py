"""`litgpt serve`: the command. It binds the port, loads the model on each device, sizes each paged KV cache, starts
the engines and runs the HTTP app (`app.py`) with uvicorn.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Optional, Union

import torch

from litgpt.errors import UserError

GENERIC_FOLDER_NAMES = ("final", "latest")  # a run's checkpoint folders: named with their run's folder too


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), bound before the model loads: a port in use is found at once."""
    if not 0 <= port <= 65535:
        raise UserError(f"port must be in [0, 65535], got {port}.")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        raise UserError(f"Cannot listen on {host}:{port} ({error.strerror or error}); pick another --port or --host.")
    return sock


def default_model_name(checkpoint_dir: Path) -> str:
    """The checkpoint folder's name; a run's `final` or `step-N` folder with its run's folder (`lora/final`)."""
    folder = checkpoint_dir.resolve()
    if folder.name in GENERIC_FOLDER_NAMES or folder.name.startswith("step-"):
        return f"{folder.parent.name}/{folder.name}"
    return folder.name


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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
    api_key: Optional[str] = None,
    served_model_name: Union[str, list[str], None] = None,
    max_new_tokens: int = 512,
    max_batch_size: int = 16,
    max_seq_length: Optional[int] = None,
    kv_cache_gb: Optional[float] = None,
    kv_cache_fraction: Optional[float] = None,
    kv_block_size: int = 16,
    prefill_tokens: int = 512,
    max_waiting: int = 256,
    max_connections: int = 1024,
    request_timeout: float = 600.0,
    read_timeout: float = 30.0,
    idle_timeout: float = 5.0,
    precision: Optional[str] = None,
    quantize: Optional[str] = None,
    compile: bool = False,
    device: str = "auto",
    devices: int = 1,
) -> None:
    """Serve a litgpt checkpoint over HTTP with OpenAI's API: chat and text completions, streamed or not.

    The endpoints are /v1/chat/completions, /v1/completions, /v1/models and /health. Chat messages are laid out with
    the checkpoint's chat template (chat_template.jinja or tokenizer_config.json), or with its prompt style when it has
    none. Requests in flight are decoded together (continuous batching) over a paged KV cache: each sequence holds
    the cache blocks its tokens fill, and new prompts are prefilled together in chunks. Ctrl-C stops the server.

    Args:
        checkpoint_dir: Folder with lit_model.pth, model_config.yaml and the tokenizer files.
        host: The address to listen on; 0.0.0.0 listens on every interface: set an API key then.
        port: The port to listen on (0 picks a free one, printed at start).
        api_key: Require `Authorization: Bearer <api_key>` on every route but /health (401 otherwise). Default: the
            LITGPT_API_KEY environment variable; none when that is unset.
        served_model_name: The model's name in the API (the "model" field of requests and answers); a list gives it
            several, the first being the one answers carry. Default: the checkpoint folder's name (a run's `final`
            or `step-N` folder with its run folder's name: "lora/final").
        max_new_tokens: The most tokens of an answer: the default of a request's max_tokens and its cap.
        max_batch_size: The most sequences decoded together; further requests wait for a row. Also the cap of `n`.
        max_seq_length: The longest sequence (prompt and answer) served. Default: the model's context, or what the
            KV cache holds when that is less.
        kv_cache_gb: The KV cache's size in GiB. Default: `kv_cache_fraction` of the memory free after loading.
        kv_cache_fraction: The share of the free memory (the GPU's, or the host's available RAM) the KV cache may
            take. Default: 0.9 on GPUs, 0.5 on the CPU. The cache never takes more than `max_batch_size` sequences
            of `max_seq_length` tokens need.
        kv_block_size: Tokens per block of the paged KV cache.
        prefill_tokens: The most prompt tokens prefilled in one pass (several prompts padded together, a long one in
            chunks), between two decoding steps.
        max_waiting: The most sequences waiting for a batch row; a request beyond it gets 429.
        max_connections: The most open connections and requests; beyond it the server answers 503.
        request_timeout: Seconds a request may take from arrival to its last token (408 or, streamed, an error
            event).
        read_timeout: Seconds a client has to send its whole request body (408 after).
        idle_timeout: Seconds an idle keep-alive connection stays open.
        precision: The weights' precision: 32-true, 16-true or bf16-true. Default: bf16-true on GPUs (16-true
            without bf16 support) and on CPUs with native bf16 (AVX512-BF16 or AMX), 32-true on other CPUs.
        quantize: Quantize the weights at load, as `litgpt generate --quantize` does.
        compile: Compile the model's forward pass with torch.compile (dynamic shapes: one graph for every batch).
        device: Where to run: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.
        devices: With N > 1, one copy of the model on each of the GPUs cuda:0..N-1; a request goes to the least busy.
    """
    import uvicorn

    from litgpt.chat_template import ChatFormat
    from litgpt.checkpoint.model_files import find_checkpoint_dir
    from litgpt.generate import check_quantize
    from litgpt.serving.app import Limits, build_app
    from litgpt.serving.generation import Service

    check_limits(max_new_tokens=max_new_tokens, max_batch_size=max_batch_size, prefill_tokens=prefill_tokens,
                 max_waiting=max_waiting, max_connections=max_connections, request_timeout=request_timeout,
                 read_timeout=read_timeout, idle_timeout=idle_timeout)
    check_quantize(quantize)
    api_key = api_key or os.environ.get("LITGPT_API_KEY") or None
    checkpoint_dir = find_checkpoint_dir(Path(checkpoint_dir))
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [default_model_name(checkpoint_dir)]
    targets = engine_devices(device, devices)
    sock = bind(host, port)
    cache = dict(page_size=kv_block_size, max_seq_length=max_seq_length, kv_cache_gb=kv_cache_gb,
                 kv_cache_fraction=kv_cache_fraction)
    engines, tokenizer = load_engines(checkpoint_dir, targets, precision, quantize, compile, max_batch_size,
                                      prefill_tokens, cache)
    chat_format = ChatFormat.from_checkpoint(checkpoint_dir, tokenizer, engines[0].model.config)
    service = Service(names, tokenizer, chat_format, engines, max_new_tokens, max_waiting, request_timeout)
    app = build_app(service, Limits(api_key, read_timeout))
    for engine in engines:
        if compile:
            engine.warm_up()
        engine.start()
    address = f"http://{host}:{sock.getsockname()[1]}"
    print(f"{engines[0].plan.describe()} on each of {', '.join(str(e.device) for e in engines)}", file=sys.stderr)
    if api_key is None and not is_loopback(host):
        print(f"Warning: {host} is reachable from the network and no API key is set: anyone who reaches it may use "
              "it (set --api_key or LITGPT_API_KEY).", file=sys.stderr)
    print(f"Serving {names[0]!r} (chat: {chat_format.description}) at {address}/v1, batches of up to "
          f"{max_batch_size}{', API key required' if api_key else ''}; Ctrl-C stops.", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, limit_concurrency=max_connections,
                            timeout_keep_alive=idle_timeout, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    print("litgpt serve: stopped", file=sys.stderr)


def check_limits(**limits: float) -> None:
    """Counts must be >= 1, timeouts (the *_timeout names) > 0 seconds."""
    for name, value in limits.items():
        if name.endswith("_timeout") and not value > 0:
            raise UserError(f"{name} must be > 0 seconds, got {value}.")
        if not name.endswith("_timeout") and value < 1:
            raise UserError(f"{name} must be >= 1, got {value}.")


def load_engines(checkpoint_dir: Path, targets: list[str], precision: Optional[str], quantize: Optional[str],
                 compile: bool, max_batch_size: int, prefill_tokens: int, cache: dict):
    """One model, its paged KV cache (sized by the memory left on its device after loading) and engine per device;
    and the tokenizer."""
    from litgpt.generate import load_model_and_tokenizer
    from litgpt.serving.engine import BatchingEngine
    from litgpt.serving.paged_cache import CacheShape, free_memory, plan_cache

    engines, tokenizer = [], None
    for target in targets:
        model, tokenizer = load_model_and_tokenizer(checkpoint_dir, precision, target, quantize=quantize)
        dtype, where = model.transformer.wte.weight.dtype, model.transformer.wte.weight.device
        fraction = cache["kv_cache_fraction"] or (0.9 if where.type == "cuda" else 0.5)
        plan = plan_cache(CacheShape.of(model, dtype), model.config.block_size, cache["page_size"], max_batch_size,
                          cache["max_seq_length"], cache["kv_cache_gb"], fraction, free_memory(where))
        if compile:
            model = compile_model(model)
        engines.append(BatchingEngine(model, max_batch_size, plan, prefill_tokens))
    return engines, tokenizer


def compile_model(model):
    """The model with a compiled decoding pass: `decode_forward` (dynamic shapes: the batch and the cached length
    vary from step to step, so a few graphs serve every step); prompts are prefilled eagerly, as their shapes vary
    too much to compile well. The rotary tables are built first: building them inside the graph would compile it
    again on the second step."""
    device = model.transformer.wte.weight.device
    for local in {False, model.config.rope_local_base is not None}:
        model.rope_tables(device, local)
    model.decode_forward = torch.compile(model.forward, dynamic=True)
    return model

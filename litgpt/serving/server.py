"""`litgpt serve`: the command. It binds the port, loads the model on each device (or its shares on the devices of a
tensor-parallel group), sizes each paged KV cache, starts the engines and runs the HTTP app (`app.py`) with uvicorn.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from litgpt.args import ParallelArgs
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
    host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
    served_model_name: Union[str, list[str], None] = None,
    max_new_tokens: int = 512, max_batch_size: int = 16, max_seq_length: Optional[int] = None,
    kv_cache_gb: Optional[float] = None, kv_cache_fraction: Optional[float] = None, kv_block_size: int = 16,
    prefill_tokens: int = 512, max_waiting: int = 256, max_connections: int = 1024,
    request_timeout: float = 600.0, read_timeout: float = 30.0, idle_timeout: float = 5.0,
    precision: Optional[str] = None, quantize: Optional[str] = None, compile: bool = False,
    device: str = "auto", devices: Optional[int] = None, parallel: ParallelArgs = ParallelArgs(),
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
        kv_cache_gb: The KV cache's size in GiB (per device). Default: `kv_cache_fraction` of the memory free after
            loading.
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
            With --parallel.tensor N, the N processes of the split model (the default).
        parallel: --parallel.tensor N splits the model over N devices of this machine, as `litgpt generate` does
            (a model too large for one): rank 0 serves HTTP and schedules, every rank runs each pass.
    """
    from litgpt.checkpoint.model_files import find_checkpoint_dir
    from litgpt.generate import check_quantize

    check_limits(max_new_tokens=max_new_tokens, max_batch_size=max_batch_size, prefill_tokens=prefill_tokens,
                 max_waiting=max_waiting, max_connections=max_connections, request_timeout=request_timeout,
                 read_timeout=read_timeout, idle_timeout=idle_timeout)
    checkpoint_dir = find_checkpoint_dir(Path(checkpoint_dir))
    settings = ServerSettings(host, api_key or os.environ.get("LITGPT_API_KEY") or None,
                              served_names(served_model_name, checkpoint_dir), max_new_tokens, max_batch_size,
                              prefill_tokens, max_waiting, max_connections, request_timeout, read_timeout,
                              idle_timeout, compile)
    load = Loading(precision, quantize, dict(page_size=kv_block_size, max_seq_length=max_seq_length,
                                             kv_cache_gb=kv_cache_gb, kv_cache_fraction=kv_cache_fraction))
    if parallel != ParallelArgs():
        serve_split(checkpoint_dir, settings, port, load, device, devices, parallel)
        return
    check_quantize(quantize)
    targets = engine_devices(device, devices or 1)
    sock = bind(host, port)
    engines, tokenizer = load_engines(checkpoint_dir, targets, load, settings)
    run_server(sock, engines, tokenizer, checkpoint_dir, settings, f"each of {', '.join(targets)}")


@dataclass(frozen=True)
class ServerSettings:
    """What `litgpt serve` was told for the HTTP side and the engines (see `main`)."""

    host: str
    api_key: Optional[str]
    names: list[str]
    max_new_tokens: int
    max_batch_size: int
    prefill_tokens: int
    max_waiting: int
    max_connections: int
    request_timeout: float
    read_timeout: float
    idle_timeout: float
    compile: bool


@dataclass(frozen=True)
class Loading:
    """How the model and its KV cache load: precision, quantization, and the cache's `plan_cache` settings."""

    precision: Optional[str]
    quantize: Optional[str]
    cache: dict


def served_names(served_model_name: Union[str, list[str], None], checkpoint_dir: Path) -> list[str]:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    return names or [default_model_name(checkpoint_dir)]


def run_server(sock: socket.socket, engines: list, tokenizer, checkpoint_dir: Path, settings: ServerSettings,
               where: str) -> None:
    """Start the engines and serve the app on `sock` until uvicorn stops (Ctrl-C, SIGTERM); then stop the engines.
    `where`: the devices the engines' caches are on, for the start message."""
    import uvicorn

    from litgpt.chat_template import ChatFormat
    from litgpt.serving.app import Limits, build_app
    from litgpt.serving.generation import Service

    chat_format = ChatFormat.from_checkpoint(checkpoint_dir, tokenizer, engines[0].model.config)
    service = Service(settings.names, tokenizer, chat_format, engines, settings.max_new_tokens, settings.max_waiting,
                      settings.request_timeout)
    app = build_app(service, Limits(settings.api_key, settings.read_timeout))
    for engine in engines:
        if settings.compile:
            engine.warm_up()
        engine.start()
    host = settings.host
    print(f"{engines[0].plan.describe()} on {where}", file=sys.stderr)
    if settings.api_key is None and not is_loopback(host):
        print(f"Warning: {host} is reachable from the network and no API key is set: anyone who reaches it may use "
              "it (set --api_key or LITGPT_API_KEY).", file=sys.stderr)
    print(f"Serving {settings.names[0]!r} (chat: {chat_format.description}) at http://{host}:{sock.getsockname()[1]}"
          f"/v1, batches of up to {settings.max_batch_size}{', API key required' if settings.api_key else ''}; "
          "Ctrl-C stops.", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, limit_concurrency=settings.max_connections,
                            timeout_keep_alive=settings.idle_timeout, timeout_graceful_shutdown=5)
    # uvicorn shuts down gracefully on Ctrl-C or SIGTERM, then raises the signal again to the handlers it found, whose
    # default would end the process at once: these ignore it, so the engines (and a split model's other ranks) stop.
    handlers = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for engine in engines:
            engine.stop()
    print("litgpt serve: stopped", file=sys.stderr)


def serve_split(checkpoint_dir: Path, settings: ServerSettings, port: int, load: Loading, device: str,
                devices: Optional[int], parallel: ParallelArgs) -> None:
    """Serve a model split over --parallel.tensor processes: checked, the port bound by rank 0 (before anything
    loads), then run by every rank (`serve_on_rank`)."""
    from litgpt.config import Config
    from litgpt.distributed.inference import check_split_generation, split_devices, split_fabric
    from litgpt.distributed.runtime import launcher_rank
    from litgpt.generate import resolve_device, resolve_precision

    split_devices("serve", parallel, devices)
    check_split_generation(Config.from_checkpoint(checkpoint_dir), parallel.tensor, device, load.quantize,
                           settings.compile)
    dtype = resolve_precision(load.precision, resolve_device(device))
    sock = bind(settings.host, port) if launcher_rank() == 0 else None
    fabric = split_fabric(parallel.tensor, device, dtype)
    fabric.launch(serve_on_rank, checkpoint_dir, settings, load, dtype, sock)


def serve_on_rank(fabric, checkpoint_dir: Path, settings: ServerSettings, load: Loading, dtype: torch.dtype,
                  sock: Optional[socket.socket]) -> None:
    """Each rank loads its share of the model and an engine over its share of the KV cache (every rank's the same
    size: the least free memory decides); rank 0 serves, the others run each of its engine's passes with it."""
    from litgpt.distributed.inference import load_split_model
    from litgpt.distributed.lockstep import lead_or_follow
    from litgpt.distributed.runtime import every_rank
    from litgpt.serving.engine import BatchingEngine
    from litgpt.serving.paged_cache import free_memory
    from litgpt.tokenizer import Tokenizer

    model = load_split_model(checkpoint_dir, dtype, fabric.strategy.tensor_mesh, fabric.device)
    free = min(every_rank(free_memory(fabric.device)))
    if fabric.device.type == "cpu":
        free //= fabric.world_size  # the ranks share the host's memory
    engine = BatchingEngine(model, settings.max_batch_size, cache_plan(model, load, settings, free),
                            settings.prefill_tokens)
    where = f"each of the {fabric.world_size} devices the model is split over (its own key-value heads)"
    lead = functools.partial(run_server, sock, [engine], Tokenizer(checkpoint_dir), checkpoint_dir, settings, where)
    lead_or_follow(fabric.global_rank, {"engine": engine}, {"engine": ("run_pass",)}, lead, fabric.device)


def check_limits(**limits: float) -> None:
    """Counts must be >= 1, timeouts (the *_timeout names) > 0 seconds."""
    for name, value in limits.items():
        if name.endswith("_timeout") and not value > 0:
            raise UserError(f"{name} must be > 0 seconds, got {value}.")
        if not name.endswith("_timeout") and value < 1:
            raise UserError(f"{name} must be >= 1, got {value}.")


def load_engines(checkpoint_dir: Path, targets: list[str], load: Loading, settings: ServerSettings):
    """One model, its paged KV cache (sized by the memory left on its device after loading) and engine per device;
    and the tokenizer."""
    from litgpt.generate import load_model_and_tokenizer
    from litgpt.serving.engine import BatchingEngine
    from litgpt.serving.paged_cache import free_memory

    engines, tokenizer = [], None
    for target in targets:
        model, tokenizer = load_model_and_tokenizer(checkpoint_dir, load.precision, target, quantize=load.quantize)
        plan = cache_plan(model, load, settings, free_memory(model.transformer.wte.weight.device))
        if settings.compile:
            model = compile_model(model)
        engines.append(BatchingEngine(model, settings.max_batch_size, plan, settings.prefill_tokens))
    return engines, tokenizer


def cache_plan(model, load: Loading, settings: ServerSettings, free_bytes: int):
    """The paged KV cache of `model` (its layers' own key-value heads), sized by `load.cache` or `free_bytes`."""
    from litgpt.serving.paged_cache import CacheShape, plan_cache

    dtype, where = model.transformer.wte.weight.dtype, model.transformer.wte.weight.device
    cache = load.cache
    fraction = cache["kv_cache_fraction"] or (0.9 if where.type == "cuda" else 0.5)
    return plan_cache(CacheShape.of(model, dtype), model.config.block_size, cache["page_size"],
                      settings.max_batch_size, cache["max_seq_length"], cache["kv_cache_gb"], fraction, free_bytes)


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

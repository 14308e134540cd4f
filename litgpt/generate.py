"""Text generation: sampling, a streaming token generator over the KV cache, model loading, and `litgpt generate`."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from litgpt.args import ParallelArgs
from litgpt.errors import UserError
from litgpt.precision import PRECISION_DTYPES, default_inference_dtype

if TYPE_CHECKING:
    from litgpt.model import GPT
    from litgpt.tokenizer import Tokenizer



# ---- sampling ---------------------------------------------------------------------------------------------------------
def check_sampling_args(temperature: float, top_k: Optional[int], top_p: float) -> None:
    """Raise UserError for sampling settings outside their ranges."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"temperature must be a finite number >= 0 (0 picks the most likely token), got {temperature}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise UserError(f"top_k must be a whole number >= 1, or None to keep every token, got {top_k}.")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise UserError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p}.")


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Pick one token id from each row of `logits` (..., vocab); returns a LongTensor of shape logits.shape[:-1].

    temperature 0 takes the most likely token. Otherwise the logits are divided by the temperature, only the
    `top_k` most likely tokens are kept, then only the smallest set of the remaining tokens whose probability
    reaches `top_p` (nucleus sampling), and a token is drawn from what is left with `generator`.
    """
    check_sampling_args(temperature, top_k, top_p)
    return pick(logits, temperature, top_k, top_p, exponential_noise(logits, temperature, top_k, generator))


def exponential_noise(logits: torch.Tensor, temperature: float, top_k: Optional[int],
                      generator: Optional[torch.Generator]) -> Optional[torch.Tensor]:
    """Exp(1) draws for `pick`, one per candidate token (the top_k, or the whole vocabulary); None for greedy
    decoding, which draws nothing."""
    if temperature == 0:
        return None
    shape = (*logits.shape[:-1], min(top_k or logits.size(-1), logits.size(-1)))
    noise = torch.empty(shape, device=logits.device, dtype=torch.float32).exponential_(generator=generator)
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)  # a 0 would divide a dropped token's 0 into NaN


def pick(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: float,
         noise: Optional[torch.Tensor]) -> torch.Tensor:
    """`sample` with its randomness given: argmax of probs / noise with Exp(1) noise takes token i with probability
    probs[i] (the exponential race), in a few elementwise ops that compile with the decoding step. With top_k only
    the k candidates are ranked, renormalized and drawn from."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    candidates = None
    if top_k is not None and top_k < logits.size(-1):
        logits, candidates = torch.topk(logits, top_k, dim=-1)
    if top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Drop a token when the more likely ones already reach top_p; the most likely token always stays.
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    choice = (torch.softmax(logits, dim=-1) / noise).argmax(dim=-1)
    return choice if candidates is None else candidates.gather(-1, choice.unsqueeze(-1)).squeeze(-1)


def decode_step(model: "GPT", token: torch.Tensor, position: torch.Tensor, temperature: float,
                top_k: Optional[int], top_p: float, noise: Optional[torch.Tensor]) -> torch.Tensor:
    """Feed one token (a 0-d tensor) at `position` (1,) and pick the next: the loop body `--compile` compiles."""
    logits = model(token.view(1, 1), input_pos=position)[0, -1]
    return pick(logits, temperature, top_k, top_p, noise)


def decode_step_with_math_attention(model: "GPT", *args) -> torch.Tensor:
    """`decode_step` with attention written as matmuls and a softmax, which inductor fuses with their neighbours.
    On the CPU the fused attention kernel costs more for one query than that (compiled: 33 % more tokens/s from a
    5M model in bf16, 8 % in fp32)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return decode_step(model, *args)


# ---- generation -------------------------------------------------------------------------------------------------------
def check_prompt_length(prompt_length: int, block_size: int) -> None:
    """A prompt must leave room in the model's context for at least one new token."""
    if prompt_length == 0:
        raise UserError("The prompt is empty: give at least one token of text.")
    if prompt_length >= block_size:
        raise UserError(
            f"The prompt is {prompt_length} tokens long, but the model's context (block_size) is {block_size} "
            f"tokens: shorten the prompt to at most {block_size - 1} tokens to leave room for a reply."
        )


def activation_dtype(model: "GPT") -> torch.dtype:
    """The dtype the model's keys and values come in, which its KV cache stores: autocast's where it is on (a -mixed
    run's rollouts or samples, where the float32 master weights' dtype would double the cache for the same values),
    the dtype FSDP2 gathers the weights in for a sharded model (`litgpt.distributed.fsdp.gathered_dtype`: between
    passes its weights are float32 shards), else the embedding's (a quantized head's weight is not the activations'
    dtype)."""
    from torch.distributed.fsdp import FSDPModule

    device = model.transformer.wte.weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if isinstance(model, FSDPModule):
        from litgpt.distributed.fsdp import gathered_dtype

        return gathered_dtype(model) or model.transformer.wte.weight.dtype
    return model.transformer.wte.weight.dtype


def prepare_kv_cache(model: "GPT", length: int) -> None:
    """Make sure the model has a batch-1 KV cache of at least `length` positions (reusing the one it has).

    With a compiled decoding step the cache grows in powers of two, so prompts of other lengths mostly reuse the
    compiled graph (its shapes are the cache's) instead of compiling another one.
    """
    if hasattr(model, "compiled_decode_step"):
        length = min(model.config.block_size, 1 << (length - 1).bit_length())
    device, dtype = model.lm_head.weight.device, activation_dtype(model)
    cache = model.transformer.h[0].attn.kv_cache
    if (
        cache is None
        or cache.k.size(0) != 1
        or cache.k.size(2) < length
        or cache.k.device != device
        or cache.k.dtype != dtype
    ):
        model.set_kv_cache(batch_size=1, max_seq_length=length, dtype=dtype)


def generate(
    model: "GPT",
    prompt_ids: Union[torch.Tensor, Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    stop_ids: Iterable[int] = (),
    *,
    stop_sequences: Iterable[Sequence[int]] = (),
    generator: Optional[torch.Generator] = None,
) -> Iterator[int]:
    """Yield new token ids one at a time, continuing `prompt_ids` (1-D) with the model's KV cache.

    The prompt is run once (positions 0..T-1), then each new token is fed at its position. Generation ends after
    `max_new_tokens`, when the context is full (prompt + new tokens never exceed `block_size`), or at a stop:
    any id in `stop_ids`, or any multi-token sequence in `stop_sequences`. Stop tokens are not yielded; tokens that
    might begin a stop sequence are held back until it is clear they do not.

    With LongRoPE (Phi-3.5, Phi-4-mini), a prompt within original_max_position_embeddings runs with the short
    factors; when the sequence first grows past that context, the whole sequence is run again with the long factors,
    rewriting the cache, as transformers' Phi-3 generation does (see `longrope_restart`).

    The arguments are checked when this is called (UserError), not on the first `next()`.
    """
    check_sampling_args(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    device = model.lm_head.weight.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if prompt.dim() != 1:
        raise ValueError(f"prompt_ids must be 1-D (one sequence), got shape {tuple(prompt.shape)}.")
    block_size = model.config.block_size
    check_prompt_length(prompt.numel(), block_size)
    stops = [[int(i)] for i in stop_ids] + [[int(i) for i in s] for s in stop_sequences if len(s) > 0]
    new_tokens = min(max_new_tokens, block_size - prompt.numel())
    return _generate(model, prompt, new_tokens, temperature, top_k, top_p, stops, generator)


@torch.inference_mode()
def _generate(
    model: "GPT",
    prompt: torch.Tensor,
    new_tokens: int,
    temperature: float,
    top_k: Optional[int],
    top_p: float,
    stops: list[list[int]],
    generator: Optional[torch.Generator],
) -> Iterator[int]:
    if new_tokens == 0:
        return
    T = prompt.numel()
    device = prompt.device
    # The last new token is never fed back, so T + new_tokens - 1 positions suffice.
    prepare_kv_cache(model, T + new_tokens - 1)
    logits = model(prompt[None], input_pos=torch.arange(T, device=device))[0, -1]
    token = sample(logits, temperature, top_k, top_p, generator)
    compiled_step = getattr(model, "compiled_decode_step", None)
    step_fn = compiled_step or functools.partial(decode_step, model)
    positions = torch.arange(T, T + new_tokens, device=device)
    sequence = torch.cat((prompt, torch.zeros(new_tokens, dtype=prompt.dtype, device=device)))
    restart = longrope_restart(model.config, T)
    pending: list[int] = []  # tokens held back: they could be the start of a stop sequence
    for step in range(new_tokens):
        pending.append(int(token))
        stopped = next((s for s in stops if pending[-len(s):] == s), None)
        if stopped is not None:
            yield from pending[: len(pending) - len(stopped)]
            return
        keep = held_back(pending, stops)
        yield from pending[: len(pending) - keep]
        pending = pending[len(pending) - keep :]
        if step + 1 < new_tokens:
            noise = exponential_noise(logits, temperature, top_k, generator)
            sequence[T + step] = token
            if T + step == restart:  # LongRoPE's switch to its long factors: the whole sequence again
                whole = torch.arange(T + step + 1, device=device)
                token = pick(model(sequence[None, whole], input_pos=whole)[0, -1], temperature, top_k, top_p, noise)
                continue
            # Measured on CPUs only so far; on CUDA the step is a CUDA graph and keeps every guard.
            with skip_guards(compiled_step is not None and step > 0 and device.type == "cpu"):
                token = step_fn(token, positions[step : step + 1], temperature, top_k, top_p, noise)
            # A CUDA graph's output lives in memory its next replay overwrites: keep a copy of the token.
            token = token.clone()
    yield from pending


def longrope_restart(config, prompt_length: int) -> Optional[int]:
    """The position at which generation runs the whole sequence again, or None.

    A LongRoPE model picks its short or long factors per forward pass (`GPT.rope_at`): a decoding step past
    original_max_position_embeddings would rotate its own query and key with the long factors while the cached keys
    of the earlier positions keep the short ones. transformers' Phi-3 generation instead drops the cache when the
    sequence first exceeds that context and runs all of it again, with the long factors; this does the same, once,
    at that position (a prompt already past it ran with the long factors from the start).
    """
    scaling = config.rope_scaling
    if scaling is None or scaling["type"] != "longrope":
        return None
    original = scaling["original_max_position_embeddings"]
    return original if prompt_length <= original else None


def skip_guards(skip: bool):
    """Within one generation every call of the compiled step has the shapes, dtypes and sampling settings of the
    first, which ran all of torch.compile's guards (and compiled or picked its graph): later calls need only the
    guards that tell the graphs apart (5-30 % more tokens/s from a 5M model on a 2-core CPU)."""
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip else contextlib.nullcontext()


def held_back(tokens: list[int], stops: list[list[int]]) -> int:
    """Length of the longest tail of `tokens` that is a proper prefix of a stop sequence."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(tokens)), longest, -1):
            if tokens[-n:] == stop[:n]:
                longest = n
                break
    return longest


# ---- loading ----------------------------------------------------------------------------------------------------------
def resolve_device(device: str) -> torch.device:
    """"auto" picks CUDA, then MPS, then the CPU; anything else must name an available device."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"Unknown device {device!r}; use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"Device {device!r} was asked for, but CUDA is not available here; use --device cpu.")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise UserError(f"Device {device!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s).")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"Device {device!r} was asked for, but MPS is not available here; use --device cpu.")
    elif resolved.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"Unsupported device {device!r}; use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.")
    return resolved


def resolve_precision(precision: Optional[str], device: torch.device) -> torch.dtype:
    """The weights' dtype: the named precision, or the device's default (`default_inference_dtype`: bf16 on GPUs
    and on CPUs with native bf16, else fp16 on GPUs and fp32 on CPUs; `announce_precision` says which)."""
    if precision is None:
        return default_inference_dtype(device)
    if precision not in PRECISION_DTYPES:
        raise UserError(f"Unknown precision {precision!r}; use one of {', '.join(PRECISION_DTYPES)}.")
    return PRECISION_DTYPES[precision]


def check_quantize(quantize: Optional[str]) -> None:
    if quantize is not None:
        from litgpt.quantize import check_quantize_mode

        check_quantize_mode(quantize)


def load_model_and_tokenizer(
    checkpoint_dir: Path,
    precision: Optional[str] = None,
    device: str = "auto",
    compile: bool = False,
    quantize: Optional[str] = None,
) -> tuple["GPT", "Tokenizer"]:
    """Build the model of a litgpt checkpoint folder with its weights, on `device` in `precision`, and its tokenizer.

    The model is created on the meta device and takes the memory-mapped tensors of lit_model.pth directly, so
    loading needs no second copy of the weights. Every bad input (missing folder or files, a model_config.yaml that
    does not fit the weights, unknown device or precision) raises UserError.
    """
    from litgpt.checkpoint.model_files import (
        find_checkpoint_dir, load_model_weights, meta_device, read_model_weights, WEIGHTS_FILE,
    )
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.tokenizer import Tokenizer, check_vocab_fits

    checkpoint_dir = find_checkpoint_dir(Path(checkpoint_dir))
    target = resolve_device(device)
    dtype = resolve_precision(precision, target)
    config = Config.from_checkpoint(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    check_vocab_fits(tokenizer, config, checkpoint_dir)

    with meta_device():
        model = GPT(config)
    weights_path = checkpoint_dir / WEIGHTS_FILE
    state_dict = read_model_weights(weights_path)
    load_model_weights(model, state_dict, source=str(weights_path))
    model = model.to(device=target, dtype=dtype)
    if quantize is not None:
        from litgpt.quantize import quantize_frozen_base

        quantize_frozen_base(model, quantize, target)
    model.eval()
    model.requires_grad_(False)
    if compile:
        # Only the one-token step: its shapes never change (the whole KV cache is attended, masked), so it compiles
        # once; prompts of every length run eagerly instead of compiling a graph per length.
        # On CUDA the step is also captured as a CUDA graph ("reduce-overhead"): one launch per token.
        mode = "reduce-overhead" if target.type == "cuda" else None
        step = decode_step_with_math_attention if target.type == "cpu" else decode_step
        model.compiled_decode_step = torch.compile(functools.partial(step, model), dynamic=False, mode=mode)
    announce_precision(precision, dtype, target)
    return model, tokenizer


def announce_precision(precision: Optional[str], dtype: torch.dtype, device: torch.device) -> None:
    """Say on stderr which dtype the device's default gave, once the inputs are known to be good (bad input stays
    one line); nothing when --precision chose it."""
    if precision is None:
        print(f"Precision: {dtype} (the default on this {device.type}; --precision to choose)", file=sys.stderr)


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# ---- the command ------------------------------------------------------------------------------------------------------
def main(
    checkpoint_dir: Path,
    prompt: str = "What food do llamas eat?",
    *,
    num_samples: int = 1,
    max_new_tokens: int = 50,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    temperature: float = 0.8,
    seed: int = 1234,
    precision: Optional[str] = None,
    device: str = "auto",
    compile: bool = False,
    quantize: Optional[str] = None,
    devices: Optional[int] = None,
    parallel: ParallelArgs = ParallelArgs(),
) -> None:
    """Continue a prompt with a litgpt model and print the text as it is generated.

    The prompt is used as it is (no chat template; `litgpt chat` applies one). Timing goes to stderr.

    Args:
        checkpoint_dir: Folder with lit_model.pth, model_config.yaml and the tokenizer files.
        prompt: The text to continue.
        num_samples: How many continuations to generate, one after another.
        max_new_tokens: The most tokens to generate per sample (fewer if the model's context fills up).
        top_k: Sample only among the k most likely tokens; None keeps all of them.
        top_p: Sample only among the most likely tokens whose probabilities add up to top_p (1.0 keeps all).
        temperature: Divides the logits before sampling: higher is more random, 0 always takes the most likely token.
        seed: Seed of the random sampling.
        precision: The weights' precision: 32-true, 16-true or bf16-true. Default: bf16-true on GPUs
            (16-true without bf16 support) and on CPUs with native bf16 (AVX512-BF16 or AMX),
            32-true on other CPUs.
        device: Where to run: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.
        compile: Compile the one-token decoding step with torch.compile: the first sample pays the compilation
            (seconds to a minute), later tokens run faster, on the CPU as on GPUs.
        quantize: Quantize the weights with bitsandbytes (bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.int8) or torchao
            (ao.nf4); needs `pip install 'litgpt[quantize]'`.
        devices: Processes to run, one per device: with --parallel.tensor N, N (the default). Started as the
            training commands start theirs (here, or by torchrun or srun).
        parallel: --parallel.tensor N splits the model over N devices of this machine (a model too large for one):
            each holds its share of every layer's heads and MLP columns and of the vocabulary, and all of them run
            every step together; rank 0 samples and prints. N must divide the heads, the key-value groups, the MLP
            width and the vocabulary; dense models only, not with --quantize or --compile.
    """
    check_sampling_args(temperature, top_k, top_p)
    if num_samples < 1:
        raise UserError(f"num_samples must be >= 1, got {num_samples}.")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    samples = functools.partial(print_samples, prompt=prompt, num_samples=num_samples, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if parallel != ParallelArgs() or (devices or 1) > 1:
        generate_split(Path(checkpoint_dir), precision, device, compile, quantize, devices, parallel, samples)
        return
    check_quantize(quantize)
    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(checkpoint_dir, precision, device, compile, quantize)
    print(f"Loaded the model from {str(checkpoint_dir)!r} in {time.perf_counter() - start:.02f} s.", file=sys.stderr)
    samples(model, tokenizer)


def print_samples(model: "GPT", tokenizer: "Tokenizer", prompt: str, num_samples: int, max_new_tokens: int,
                  temperature: float, top_k: Optional[int], top_p: float, seed: int) -> None:
    """Print `num_samples` continuations of `prompt` as they are generated, each after the prompt; timing on stderr."""
    from litgpt.tokenizer import IncrementalDecoder

    prompt_ids = tokenizer.encode(prompt)
    block_size = model.config.block_size
    check_prompt_length(len(prompt_ids), block_size)
    if len(prompt_ids) + max_new_tokens > block_size:
        print(
            f"Note: the prompt is {len(prompt_ids)} tokens and the context {block_size}, so at most "
            f"{block_size - len(prompt_ids)} new tokens fit.",
            file=sys.stderr,
        )
    device = model.lm_head.weight.device
    generator = make_generator(device, seed)
    for index in range(num_samples):
        start = time.perf_counter()
        decoder = IncrementalDecoder(tokenizer, prompt_ids=prompt_ids)
        print(prompt, end="", flush=True)
        count = 0
        tokens = generate(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop_ids=tokenizer.stop_ids,
                          generator=generator)
        for token in tokens:
            count += 1
            print(decoder.step(token), end="", flush=True)
        print(decoder.finish(), flush=True)
        elapsed = time.perf_counter() - start
        print(
            f"Sample {index + 1}: {count} tokens in {elapsed:.02f} s, {count / elapsed:.02f} tokens/s.",
            file=sys.stderr,
        )
    if device.type == "cuda":
        print(f"Memory used: {torch.cuda.max_memory_allocated(device) / 1e9:.02f} GB", file=sys.stderr)


def generate_split(checkpoint_dir: Path, precision: Optional[str], device: str, compile: bool,
                   quantize: Optional[str], devices: Optional[int], parallel: ParallelArgs,
                   samples: Callable[["GPT", "Tokenizer"], None]) -> None:
    """`samples` on a model split over --parallel.tensor processes: checked here, then run by every rank (`on_rank`)."""
    from litgpt.checkpoint.model_files import find_checkpoint_dir
    from litgpt.config import Config
    from litgpt.distributed.inference import check_split_generation, split_devices, split_fabric
    from litgpt.tokenizer import Tokenizer, check_vocab_fits

    split_devices("generate", parallel, devices)
    checkpoint_dir = find_checkpoint_dir(checkpoint_dir)
    config = Config.from_checkpoint(checkpoint_dir)
    check_vocab_fits(Tokenizer(checkpoint_dir), config, checkpoint_dir)
    check_split_generation(config, parallel.tensor, device, quantize, compile)
    target = resolve_device(device)
    dtype = resolve_precision(precision, target)
    fabric = split_fabric(parallel.tensor, device, dtype)
    fabric.launch(on_rank, checkpoint_dir, precision, dtype, samples)


def on_rank(fabric, checkpoint_dir: Path, precision: Optional[str], dtype: torch.dtype,
            samples: Callable[["GPT", "Tokenizer"], None]) -> None:
    """Each rank loads its share of the model; rank 0 runs `samples` while the others run its passes with it."""
    from litgpt.distributed.inference import load_split_model
    from litgpt.distributed.lockstep import lead_or_follow
    from litgpt.tokenizer import Tokenizer

    start = time.perf_counter()
    model = load_split_model(checkpoint_dir, dtype, fabric.strategy.tensor_mesh, fabric.device)
    if fabric.global_rank == 0:
        announce_precision(precision, dtype, fabric.device)
        print(f"Loaded the model from {str(checkpoint_dir)!r} over {fabric.world_size} devices in "
              f"{time.perf_counter() - start:.02f} s.", file=sys.stderr)
    lead = functools.partial(samples, model, Tokenizer(checkpoint_dir))
    lead_or_follow(fabric.global_rank, {"model": model}, {"model": ("forward", "set_kv_cache")}, lead, fabric.device)

"""`litgpt chat`: talk with a model in the terminal, the conversation laid out by the checkpoint's chat template (or,
in a folder without one, its prompt style)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from litgpt.errors import UserError
from litgpt.generate import (
    check_quantize,
    check_sampling_args,
    generate,
    load_model_and_tokenizer,
    make_generator,
)
from litgpt.chat_template import ChatFormat
from litgpt.tokenizer import IncrementalDecoder

EXIT, RESET, SUBMIT = "!exit", "!reset", "!submit"


def read_message(multiline: bool) -> Optional[str]:
    """The user's next message from stdin; None at the end of input."""
    print(">> Prompt: ", end="", flush=True)
    if not multiline:
        line = sys.stdin.readline()
        return None if line == "" else line.rstrip("\n")
    lines = []
    while True:
        line = sys.stdin.readline()
        if line == "":
            return "\n".join(lines) if lines else None
        line = line.rstrip("\n")
        if line.strip() == SUBMIT:
            return "\n".join(lines)
        if not lines and line.strip() in (EXIT, RESET):
            return line
        lines.append(line)


def encode_conversation(
    chat_format: ChatFormat, history: list[dict[str, str]], block_size: int, max_new_tokens: int
) -> Optional[torch.Tensor]:
    """Token ids of the conversation in `history` ({"role", "content"} messages ending with the user's), fitted into
    the context.

    While the prompt leaves fewer than `max_new_tokens` free positions, the oldest exchange (user + assistant) is
    dropped from `history`. Returns None when the last message alone leaves no room for a reply.
    """
    while True:
        ids = chat_format.prompt_ids(history)
        if len(ids) + max_new_tokens <= block_size or len(history) < 3:
            return torch.tensor(ids, dtype=torch.long) if len(ids) < block_size else None
        del history[:2]


def main(
    checkpoint_dir: Path,
    *,
    max_new_tokens: int = 256,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    temperature: float = 0.8,
    seed: int = 1234,
    precision: Optional[str] = None,
    device: str = "auto",
    compile: bool = False,
    multiline: bool = False,
    quantize: Optional[str] = None,
) -> None:
    """Chat with a litgpt model: type a message, read the streamed reply.

    The conversation is laid out by the checkpoint's chat template (chat_template.jinja or tokenizer_config.json's), or
    in a folder without one by its prompt style (model_config.yaml's prompt_style). The conversation so far is kept
    (with a prompt style that shows earlier turns), the oldest turns dropped when it would not fit the model's
    context.
    Type !reset to start a new conversation and !exit (or end the input) to quit.

    Args:
        checkpoint_dir: Folder with lit_model.pth, model_config.yaml and the tokenizer files.
        max_new_tokens: The most tokens of a reply.
        top_k: Sample only among the k most likely tokens; None keeps all of them.
        top_p: Sample only among the most likely tokens whose probabilities add up to top_p (1.0 keeps all).
        temperature: Divides the logits before sampling: higher is more random, 0 always takes the most likely token.
        seed: Seed of the random sampling.
        precision: The weights' precision: 32-true, 16-true or bf16-true. Default: bf16-true on GPUs
            (16-true without bf16 support) and on CPUs with native bf16 (AVX512-BF16 or AMX),
            32-true on other CPUs.
        device: Where to run: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.
        compile: Compile the one-token decoding step with torch.compile: the first reply pays the compilation
            (seconds to a minute), later tokens run faster, on the CPU as on GPUs.
        multiline: Read messages of several lines, each ended by a line holding only !submit.
        quantize: Quantize the weights with bitsandbytes (bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.int8) or torchao
            (ao.nf4); needs `pip install 'litgpt[quantize]'`.
    """
    check_quantize(quantize)
    check_sampling_args(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    model, tokenizer = load_model_and_tokenizer(checkpoint_dir, precision, device, compile, quantize)
    chat_format = ChatFormat.from_checkpoint(checkpoint_dir, tokenizer, model.config)
    stops = chat_format.stop_sequences()
    generator = make_generator(model.lm_head.weight.device, seed)
    block_size = model.config.block_size

    end = f"a line holding only {SUBMIT}" if multiline else "Enter"
    print(
        f"Chatting with {model.config.name or str(checkpoint_dir)!r} (laid out by {chat_format.description}). "
        f"End a message with {end}; {RESET} starts over, {EXIT} quits.",
        file=sys.stderr,
    )
    history: list[dict[str, str]] = []
    while True:
        message = read_message(multiline)
        if message is None:
            print(file=sys.stdout)
            break
        command = message.strip()
        if command == EXIT:
            break
        if command == RESET:
            history.clear()
            print("(The conversation is cleared.)", file=sys.stderr)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": message})
        prompt_ids = encode_conversation(chat_format, history, block_size, max_new_tokens)
        if prompt_ids is None:
            length = len(chat_format.prompt_ids(history[-1:]))
            history.pop()
            print(
                f"That message is {length} tokens once formatted, but the model's context is {block_size} tokens: "
                "send a shorter one.",
                file=sys.stderr,
            )
            continue

        reply_ids = stream_reply(model, tokenizer, prompt_ids, max_new_tokens, temperature, top_k, top_p, stops,
                                 generator)
        reply = tokenizer.decode(reply_ids)
        if chat_format.multi_turn:
            history.append({"role": "assistant", "content": reply.strip()})
        else:
            history.clear()


def stream_reply(model, tokenizer, prompt_ids, max_new_tokens: int, temperature: float, top_k: Optional[int],
                 top_p: float, stops, generator) -> list[int]:
    """Generate a reply, printing its text as the tokens come; returns the reply's token ids."""
    start = time.perf_counter()
    decoder = IncrementalDecoder(tokenizer, prompt_ids=prompt_ids)
    print(">> Reply: ", end="", flush=True)
    reply_ids = []
    tokens = generate(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop_sequences=stops,
                      generator=generator)
    for token in tokens:
        reply_ids.append(token)
        print(decoder.step(token), end="", flush=True)
    print(decoder.finish(), flush=True)
    elapsed = time.perf_counter() - start
    print(f"({len(reply_ids)} tokens in {elapsed:.02f} s, {len(reply_ids) / elapsed:.02f} tokens/s)", file=sys.stderr)
    return reply_ids

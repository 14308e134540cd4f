"""Rollouts of online training: completions sampled from the policy as it is now by `litgpt serve`'s continuous-batching
engine (a paged KV cache, batched prefill and decoding), each completion with a random stream of its own.

A completion's stream is seeded by (the run's seed, the split, the epoch, the prompt's row, its place in the group):
what a completion samples does not depend on which rank generates it, what it is batched with, or whether the run was
resumed in between.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from litgpt.model import GPT
from litgpt.serving.engine import BatchingEngine, Sequence
from litgpt.serving.paged_cache import CacheShape, plan_cache

PAGE_SIZE = 16


def completion_seed(seed: int, split: str, epoch: int, row: int, member: int) -> int:
    """The seed of one completion's random stream (63 bits of a digest of where it stands)."""
    digest = hashlib.sha256(f"{seed}/{split}/{epoch}/{row}/{member}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) inside the block, as it was after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def whole_policy(model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """The policy to sample from: the model itself on one device; sharded (FSDP), a copy with every weight gathered
    (`build` makes the empty model on the meta device), made once per generation and freed after it. Generation needs
    every weight at every decoding step, so gathering them once beats gathering each block at each step, and keeps
    the ranks free to decode completions of different lengths without waiting for each other."""
    from torch.distributed.tensor import DTensor

    from litgpt.checkpoint.manager import unwrap
    from litgpt.nf4 import is_nf4

    gpt = unwrap(model)
    if not any(isinstance(p, DTensor) for p in gpt.parameters()):
        return gpt
    state = {name: value.full_tensor() if isinstance(value, DTensor) else value
             for name, value in gpt.state_dict().items()}  # the same order on every rank: collective by collective
    # A QLoRA base gathered in NF4 decodes dense (torchao's NF4 does not run in inference mode).
    state = {name: value.get_original_weight() if is_nf4(value) else value for name, value in state.items()}
    copy = build()
    copy.load_state_dict(state, assign=True)
    return copy.requires_grad_(False)


def sample_completions(model: GPT, prompts: list[list[int]], seeds: list[int], max_new_tokens: int,
                       temperature: float, top_k: Optional[int], top_p: float, stop_ids: list[int],
                       max_seq_length: int, max_batch_size: int) -> list[list[int]]:
    """Each prompt's sampled completion, its stop token included where one ended it (cut at `max_new_tokens`, or
    where the context reaches `max_seq_length`), generated together in batches of up to `max_batch_size`."""
    dtype = model.transformer.wte.weight.dtype
    max_seq_length = min(max_seq_length, model.config.block_size)
    shape = CacheShape.of(model, dtype)
    longest = min(max_seq_length, max(len(p) for p in prompts) + max_new_tokens)
    rows = min(max_batch_size, len(prompts))
    budget_gb = rows * (-(-longest // PAGE_SIZE) + 1) * PAGE_SIZE * shape.bytes_per_token / 2**30
    plan = plan_cache(shape, model.config.block_size, PAGE_SIZE, rows, max(2, longest), budget_gb, 1.0, 0)
    events: "queue.Queue[tuple]" = queue.Queue()
    device = model.transformer.wte.weight.device
    sequences = [
        Sequence(list(prompt), max_new_tokens, temperature, top_k, top_p, [[i] for i in stop_ids],
                 torch.Generator(device).manual_seed(seed), events, index)
        for index, (prompt, seed) in enumerate(zip(prompts, seeds))
    ]
    for local in {False, model.config.rope_local_base is not None}:
        model.rope_tables(device, local)  # cached outside inference mode: training's forward reuses them
    with evaluating(model):
        try:
            engine = BatchingEngine(model, rows, plan, prefill_tokens=max(512, longest))
            for sequence in sequences:
                engine.submit(sequence)
            while engine.load():
                engine.step()
        finally:
            model.clear_kv_cache()
    while not events.empty():
        kind, index, value = events.get()
        if kind == "error":
            raise RuntimeError(f"generating rollout {index} failed: {value}")
    return [sequence.tokens for sequence in sequences]

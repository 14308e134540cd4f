"""Rollouts of online training: completions sampled from the policy as it is now by `litgpt serve`'s continuous-batching
engine (a paged KV cache, batched prefill and decoding), each completion with a random stream of its own.

A completion's stream is seeded by (the run's seed, the split, the epoch, the prompt's row, its place in the group):
what a completion samples does not depend on which rank generates it, what it is batched with, or whether the run was
resumed in between. Sharded (FSDP), the ranks sample in lockstep from the sharded policy itself (`LockstepEngine`).
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from litgpt.model import GPT
from litgpt.generate import activation_dtype
from litgpt.serving.engine import BatchingEngine, Sequence
from litgpt.serving.paged_cache import NULL_BLOCK, CachePlan, CacheShape, plan_cache

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


def any_rank(fabric) -> Callable[[bool], bool]:
    """Whether a flag is set on any rank (a collective: every rank asks together)."""

    def agree(flag: bool) -> bool:
        return bool(fabric.all_reduce(torch.tensor(float(flag), device=fabric.device), reduce_op="max").item())

    return agree


class LockstepEngine(BatchingEngine):
    """The engine on a sharded model, whose every forward pass gathers each block's weights from the other ranks as
    it reaches it (FSDP) and frees them after: the ranks run their passes together. Each step they agree whether any
    of them prefills, and whether any decodes; a rank with nothing of its own to run then feeds one token into the
    null block, so that its collectives meet the others'."""

    def __init__(self, model: GPT, max_batch_size: int, plan: CachePlan, prefill_tokens: int,
                 any_rank: Callable[[bool], bool]) -> None:
        super().__init__(model, max_batch_size, plan, prefill_tokens)
        self.any_rank = any_rank

    def step(self, block: bool = False) -> None:
        self.take_arrivals(block=False)
        self.admit()
        prefilling = [s for s in self.active if s.context_length - s.fed > 1]
        if self.any_rank(bool(prefilling)):
            self.prefill(prefilling) if prefilling else self.idle_pass()
        decoding = self.reserve_decoding_blocks([s for s in self.active if s.context_length - s.fed == 1])
        if self.any_rank(bool(decoding)):
            self.decode(decoding) if decoding else self.idle_pass()

    @torch.no_grad()
    def run_pass(self, *tensors: torch.Tensor) -> Optional[torch.Tensor]:
        # Not in inference mode: FSDP gathers the weights into buffers that training reuses, which must stay normal.
        return BatchingEngine.run_pass.__wrapped__(self, *tensors)

    @torch.no_grad()
    def idle_pass(self) -> None:
        null = torch.full((1, 1), NULL_BLOCK * self.page_size, dtype=torch.long, device=self.device)
        self.batch.slots, self.batch.reads = null, null
        zero = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        hidden = self.model(zero, input_pos=zero, return_hidden=True)
        self.model.head(hidden[:0, 0])  # the head's gathers too, as in `run_pass` (a sharded head is a unit of its own)


def sample_completions(model: GPT, prompts: list[list[int]], seeds: list[int], max_new_tokens: int,
                       temperature: float, top_k: Optional[int], top_p: float, stop_ids: list[int],
                       max_seq_length: int, max_batch_size: int,
                       any_rank: Optional[Callable[[bool], bool]] = None) -> list[list[int]]:
    """Each prompt's sampled completion, its stop token included where one ended it (cut at `max_new_tokens`, or
    where the context reaches `max_seq_length`), generated together in batches of up to `max_batch_size`. A sharded
    model samples in lockstep with the other ranks (`LockstepEngine`; `any_rank`: whether a flag is set on any)."""
    dtype = activation_dtype(model)
    max_seq_length = min(max_seq_length, model.config.block_size)
    shape = CacheShape.of(model, dtype)
    # (a rank with no prompts of its own still joins its sharded peers' passes)
    longest = min(max_seq_length, max((len(p) for p in prompts), default=1) + max_new_tokens)
    rows = max(1, min(max_batch_size, len(prompts)))
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
            prefill_tokens = max(512, longest)
            engine = (BatchingEngine(model, rows, plan, prefill_tokens) if any_rank is None
                      else LockstepEngine(model, rows, plan, prefill_tokens, any_rank))
            for sequence in sequences:
                engine.submit(sequence)
            while (engine.load() > 0) if any_rank is None else any_rank(engine.load() > 0):
                engine.step()
        finally:
            model.clear_kv_cache()
    while not events.empty():
        kind, index, value = events.get()
        if kind == "error":
            raise RuntimeError(f"generating rollout {index} failed: {value}")
    return [sequence.tokens for sequence in sequences]

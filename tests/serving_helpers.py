"""`litgpt serve`'s engine driven by hand, for the tests of the families whose attention it must serve."""

from __future__ import annotations

import torch

from litgpt.model import GPT


def run_engine(model: GPT, prompts, max_new_tokens: int, max_batch_size: int, pool_tokens=None, page: int = 4,
               prefill_tokens: int = 512, max_seq_length=None):
    """Every prompt through a paged engine stepped by hand to the end: the tokens each got, and the engine."""
    import queue

    from litgpt.serving.engine import BatchingEngine, Sequence
    from litgpt.serving.paged_cache import CacheShape, plan_cache

    shape = CacheShape.of(model, torch.float32)
    budget = None if pool_tokens is None else (pool_tokens * shape.bytes_per_token + 1) / 2**30
    plan = plan_cache(shape, model.config.block_size, page, max_batch_size, max_seq_length, budget, 0.5, 2**30)
    engine = BatchingEngine(model, max_batch_size, plan, prefill_tokens=prefill_tokens)
    events = queue.Queue()
    for i, prompt in enumerate(prompts):
        engine.submit(Sequence(prompt, max_new_tokens, 0.0, None, 1.0, [], None, events, i))
    while engine.load():
        engine.step()
    tokens = {i: [] for i in range(len(prompts))}
    while not events.empty():
        kind, index, value = events.get()
        assert kind != "error", value
        if kind == "tokens":
            tokens[index] += value
    return [tokens[i] for i in range(len(prompts))], engine

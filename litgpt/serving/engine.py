"""Continuous batching: one worker thread decodes every request in flight together, one token per request per step.

Each request in flight ("sequence") owns one row of a KV cache of `max_batch_size` rows, and the rows in use are
always 0..n-1: a finishing sequence's row takes the last row's contents, so a decoding step runs on the first n rows
with per-row positions (`GPT.forward` with `input_pos` of shape (n, 1)). Between steps, new sequences join: each
prompt is run alone (prefill) in a one-row cache exactly as `litgpt generate` runs it, and its keys and values are
copied into the sequence's row. So a request's greedy tokens are those it gets when it runs alone. A decoding step
attends to the cache only up to the longest sequence in flight (`CacheWindow`), not to the whole context: with 16
rows of a 5M model and a 512-token context on a shared 2-core CPU, 12.5 ms a step instead of 20.5 (one run).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from litgpt.generate import held_back, longrope_restart, sample
from litgpt.model import GPT, KVCache

WINDOW_STEP = 64  # decoding steps attend to the cache up to the longest sequence, rounded up to this


@dataclass
class Sequence:
    """One completion to generate (a request with n choices has n). The worker puts ("tokens", index, ids) for each
    run of tokens that can no longer be part of a stop sequence, then ("finish", index, "stop" | "length") or
    ("error", index, message) on `events`."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_k: Optional[int]
    top_p: float
    stops: list[list[int]]
    generator: Optional[torch.Generator]
    events: "queue.Queue[tuple]"
    index: int = 0
    cancelled: bool = False  # set by the reader (client gone, stop string found): the worker drops it at its next step
    # worker state
    next_token: int = 0  # sampled, not yet fed to the model
    position: int = 0  # where next_token goes
    generated: int = 0
    pending: list[int] = field(default_factory=list)  # held back: they may begin a stop sequence
    tokens: list[int] = field(default_factory=list)  # every token sampled so far (LongRoPE runs them all again)


class CacheWindow(nn.Module):
    """The first `length` positions of a KVCache, as views: writes go to the cache, reads stop at `length`."""

    update = KVCache.update

    def __init__(self, cache: KVCache, length: int) -> None:
        super().__init__()
        self.k, self.v = cache.k[:, :, :length], cache.v[:, :, :length]
        self.latent = cache.latent


class BatchingEngine:
    """Owns the model and its batched KV cache; `submit` sequences from any thread."""

    def __init__(self, model: GPT, max_batch_size: int) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.device = model.lm_head.weight.device
        self.block_size = model.config.block_size
        model.set_kv_cache(batch_size=max_batch_size, max_seq_length=self.block_size)
        self.caches = [block.attn.kv_cache for block in model.transformer.h]
        self.prefill_caches = [
            block.attn.new_kv_cache(1, self.block_size, device=self.device, dtype=self.caches[0].k.dtype)
            for block in model.transformer.h
        ]
        self._windows: dict[int, list[CacheWindow]] = {}
        self.waiting: "queue.Queue[Sequence]" = queue.Queue()
        self.active: list[Sequence] = []  # active[i] owns cache row i
        self.largest_batch = 0  # the most sequences decoded in one step so far (reported by /health)
        self.in_flight = 0  # submitted and not yet done: waiting, being prefilled or decoding
        self.count_lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, name="litgpt-serve-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, sequence: Sequence) -> None:
        self.count(+1)
        self.waiting.put(sequence)

    def count(self, change: int) -> None:
        with self.count_lock:
            self.in_flight += change

    def load(self) -> int:
        """Sequences waiting or in flight: the measure by which requests are spread over several engines."""
        return self.in_flight

    # ---- the worker -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            self.admit(block=not self.active)
            if not self.active:
                continue
            try:
                self.decode_step()
            except Exception as error:  # e.g. out of memory: fail the requests in flight, keep serving
                for sequence in self.active:
                    fail(sequence, error)
                self.count(-len(self.active))
                self.active.clear()

    def admit(self, block: bool) -> None:
        """Prefill waiting sequences into free rows (waiting for one when nothing is in flight)."""
        while len(self.active) < self.max_batch_size:
            try:
                sequence = self.waiting.get(block=block)
            except queue.Empty:
                return
            block = False
            if sequence.cancelled:
                self.count(-1)
                continue
            try:
                self.prefill(sequence, row=len(self.active))
            except Exception as error:  # a failed prefill ends its own request, with the error; the others go on
                fail(sequence, error)
                self.count(-1)
                continue
            self.active.append(sequence)
            self.accept_token(len(self.active) - 1)

    @torch.inference_mode()
    def prefill(self, sequence: Sequence, row: int, ids: Optional[list[int]] = None) -> None:
        """Run `ids` (default: the prompt) alone and copy their keys and values into `row`."""
        prompt = torch.tensor(ids or sequence.prompt_ids, dtype=torch.long, device=self.device)
        T = prompt.numel()
        blocks = self.model.transformer.h
        for block, cache in zip(blocks, self.prefill_caches):
            block.attn.kv_cache = cache
        try:
            logits = self.model(prompt[None], input_pos=torch.arange(T, device=self.device))[0, -1]
        finally:
            for block, cache in zip(blocks, self.caches):
                block.attn.kv_cache = cache
        for cache, prefilled in zip(self.caches, self.prefill_caches):
            cache.k[row, :, :T] = prefilled.k[0, :, :T]
            cache.v[row, :, :T] = prefilled.v[0, :, :T]
        s = sequence
        sequence.next_token = int(sample(logits, s.temperature, s.top_k, s.top_p, s.generator))
        sequence.position = T

    @torch.inference_mode()
    def decode_step(self) -> None:
        n = len(self.active)
        self.largest_batch = max(self.largest_batch, n)
        tokens = torch.tensor([[s.next_token] for s in self.active], device=self.device)
        positions = torch.tensor([[s.position] for s in self.active], device=self.device)
        length = max(s.position for s in self.active) + 1
        for block, window in zip(self.model.transformer.h, self.windows(length)):
            block.attn.kv_cache = window
        try:
            logits = self.model(tokens, input_pos=positions)[:, -1]
        finally:
            for block, cache in zip(self.model.transformer.h, self.caches):
                block.attn.kv_cache = cache
        greedy = logits.argmax(dim=-1).tolist()
        for row, s in enumerate(self.active):
            s.position += 1
            s.next_token = greedy[row] if s.temperature == 0 else int(
                sample(logits[row], s.temperature, s.top_k, s.top_p, s.generator)
            )
        # Back to front: a finished row takes the last row's contents, which have been handled already.
        for row in reversed(range(n)):
            self.accept_token(row)

    def windows(self, length: int) -> list["CacheWindow"]:
        """Views of every layer's cache up to `length` rounded up to a multiple of WINDOW_STEP: a step attends to
        the positions in use, not to the whole context (a few shapes, made once each)."""
        length = min(self.block_size, -(-length // WINDOW_STEP) * WINDOW_STEP)
        if length not in self._windows:
            self._windows[length] = [CacheWindow(cache, length) for cache in self.caches]
        return self._windows[length]

    def accept_token(self, row: int) -> None:
        """Count the sampled token of the sequence in `row`; emit what is sure, and retire it when done."""
        s = self.active[row]
        finish = None
        if s.cancelled:
            self.retire(row)
            return
        s.generated += 1
        s.pending.append(s.next_token)
        s.tokens.append(s.next_token)
        stopped = next((stop for stop in s.stops if s.pending[-len(stop):] == stop), None)
        if stopped is not None:
            s.pending = s.pending[: len(s.pending) - len(stopped)]
            finish = "stop"
        elif s.generated >= s.max_new_tokens or s.position >= self.block_size - 1:  # its successor would not fit
            finish = "length"
        keep = 0 if finish else held_back(s.pending, s.stops)
        if len(s.pending) > keep:
            s.events.put(("tokens", s.index, s.pending[: len(s.pending) - keep]))
            s.pending = s.pending[len(s.pending) - keep :]
        if finish:
            s.events.put(("finish", s.index, finish))
            self.retire(row)
        elif s.position == longrope_restart(self.model.config, len(s.prompt_ids)):
            # LongRoPE's switch to its long factors: the whole sequence again, as `litgpt generate` does
            self.prefill(s, row, s.prompt_ids + s.tokens)
            self.accept_token(row)

    def retire(self, row: int) -> None:
        """Free `row`, moving the last row's sequence and cache contents into it."""
        last = len(self.active) - 1
        if row != last:
            for cache in self.caches:
                cache.k[row] = cache.k[last]
                cache.v[row] = cache.v[last]
            self.active[row] = self.active[last]
        self.active.pop()
        self.count(-1)


def fail(sequence: Sequence, error: Exception) -> None:
    sequence.events.put(("error", sequence.index, f"generation failed: {type(error).__name__}: {error}"))

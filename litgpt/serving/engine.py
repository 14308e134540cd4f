"""Continuous batching over a paged KV cache: one worker thread runs every sequence in flight together.

A sequence's context is its prompt and the tokens sampled so far; `fed` counts those whose keys and values are in
the cache. Each iteration of the worker (`step`):

1. takes new sequences in (first come, first served) while a batch row is free and the pool has the blocks their
   context needs;
2. prefills: up to `prefill_tokens` tokens of the contexts not fed yet, several sequences in one padded batch, a long
   prompt in chunks over several iterations (chunked prefill), so that prefilling never stalls decoding for long;
3. decodes: one token for every sequence whose context is fed but for its newest token, each row at its own
   positions, its blocks read through its block table.

A sequence that has fed its whole context samples its next token from the last position's logits. When decoding
needs a block and none is free, the sequence admitted last gives its blocks back and waits at the front of the queue;
taken in again, its whole context is prefilled anew (recomputation, as vLLM preempts). A cancelled sequence (its
client left, a stop string came, its time ran out) leaves before the next pass and its blocks are free at once.

Greedy tokens are those of `litgpt generate` alone up to rounding: the same positions, keys and values, attended with
a mask instead of alone.
"""

from __future__ import annotations

import collections
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Optional

import torch

from litgpt.failpoints import failpoint
from litgpt.generate import activation_dtype, held_back, longrope_restart, sample
from litgpt.model import GPT
from litgpt.serving.paged_cache import NULL_BLOCK, BlockPool, CachePlan, attach_paged_cache


@dataclass
class Sequence:
    """One completion to generate (a request with n choices has n). The worker calls `events.put` with ("tokens",
    index, ids) for each run of tokens that can no longer be part of a stop sequence, then ("finish", index, "stop" |
    "length") or ("error", index, message)."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_k: Optional[int]
    top_p: float
    stops: list[list[int]]
    generator: Optional[torch.Generator]
    events: "queue.Queue[tuple]"
    index: int = 0
    cancelled: bool = False  # set by the reader: the worker drops the sequence before its next pass
    # worker state
    tokens: list[int] = field(default_factory=list)  # sampled so far; the newest is not fed yet
    fed: int = 0  # tokens of the context whose keys and values are cached
    blocks: list[int] = field(default_factory=list)  # the block table
    pending: list[int] = field(default_factory=list)  # held back: they may begin a stop sequence

    @property
    def context_length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    def context(self, start: int, stop: int) -> list[int]:
        prompt = len(self.prompt_ids)
        return self.prompt_ids[start:stop] + self.tokens[max(0, start - prompt): max(0, stop - prompt)]


class BatchingEngine:
    """Owns the model and its paged KV cache; `submit` sequences from any thread, `start` the worker."""

    def __init__(self, model: GPT, max_batch_size: int, plan: CachePlan, prefill_tokens: int = 512) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.plan = plan
        self.page_size = plan.page_size
        self.max_seq_length = plan.max_seq_length
        self.prefill_tokens = prefill_tokens
        self.device = model.transformer.wte.weight.device
        self.batch = attach_paged_cache(model, plan, self.device, activation_dtype(model))
        self.pool = BlockPool(plan.num_blocks)
        self.arrivals: "queue.Queue[Sequence]" = queue.Queue()
        self.waiting: collections.deque[Sequence] = collections.deque()  # arrived, not admitted (preempted first)
        self.active: list[Sequence] = []  # admitted, in admission order
        self.failure: Optional[str] = None  # why the worker stopped; it serves nothing after
        self.lock = threading.Lock()
        self.in_flight = 0  # submitted and not yet done
        self.queued = 0  # submitted and not yet admitted
        self.decoding = 0  # rows of the latest decoding pass
        self.largest_batch = 0
        self.preemptions = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="litgpt-serve-engine", daemon=True)

    # ---- the readers' side ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the worker after its current step (a model split over ranks makes no pass after this)."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()

    def submit(self, sequence: Sequence) -> None:
        with self.lock:
            if self.failure is not None:
                sequence.events.put(("error", sequence.index, self.failure))
                return
            self.in_flight += 1
            self.queued += 1
        self.arrivals.put(sequence)

    def load(self) -> int:
        """Sequences waiting or in flight: the measure by which requests are spread over several engines."""
        return self.in_flight

    def free_rows(self) -> int:
        """Batch rows that sequences arriving now would take without waiting."""
        return max(0, self.max_batch_size - len(self.active))

    @property
    def alive(self) -> bool:
        return self.failure is None and self.thread.is_alive()

    def stats(self) -> dict:
        return {"sequences_in_flight": self.in_flight, "sequences_waiting": self.queued,
                "sequences_decoding": self.decoding, "largest_batch": self.largest_batch,
                "free_kv_tokens": len(self.pool.free) * self.page_size, "kv_tokens": self.plan.tokens,
                "preemptions": self.preemptions}

    def warm_up(self) -> None:
        """Run a few throwaway sequences alone and in pairs, before serving: a compiled decoding pass compiles its
        graphs for one row and for several here, not on the first requests."""
        events = queue.Queue()
        for count in (1, 2, 3):
            for index in range(count):
                self.submit(Sequence([1 + index] * (2 + index), 3, 0.0, None, 1.0, [], None, events, index))
            while self.load():
                self.step()
        self.largest_batch = self.preemptions = 0

    # ---- the worker -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.step(block=True)
        except BaseException as error:  # a bug of ours: every request ends, /health reports it, nothing is served
            traceback.print_exc()
            with self.lock:
                self.failure = f"the generation engine stopped ({type(error).__name__})"
            for sequence in self.active + list(self.waiting):
                sequence.events.put(("error", sequence.index, self.failure))
            while not self.arrivals.empty():
                sequence = self.arrivals.get()
                sequence.events.put(("error", sequence.index, self.failure))

    def step(self, block: bool = False) -> None:
        """One iteration: take arrivals in, then one prefill pass and one decoding pass where there is work."""
        self.take_arrivals(block=block and not self.active and not self.waiting)
        self.drop_cancelled()
        self.admit()
        prefilling = [s for s in self.active if s.context_length - s.fed > 1]
        if prefilling:
            self.guarded(self.prefill, prefilling)
        decoding = [s for s in self.active if s.context_length - s.fed == 1]
        decoding = self.reserve_decoding_blocks(decoding)
        if decoding:
            failpoint("serve.decode")
            self.guarded(self.decode, decoding)

    def take_arrivals(self, block: bool) -> None:
        try:
            self.waiting.append(self.arrivals.get(block=block, timeout=1.0 if block else None))
            while True:
                self.waiting.append(self.arrivals.get_nowait())
        except queue.Empty:
            pass

    def drop_cancelled(self) -> None:
        for sequence in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(sequence)
            self.done(sequence, admitted=False)
        for sequence in [s for s in self.active if s.cancelled]:
            self.retire(sequence)

    def admit(self) -> None:
        """Waiting sequences in order, while a row is free and the pool holds their context."""
        while self.waiting and len(self.active) < self.max_batch_size:
            sequence = self.waiting[0]
            needed = self.blocks_for(sequence.context_length)
            if needed > len(self.pool.free):
                return
            self.waiting.popleft()
            with self.lock:
                self.queued -= 1
            sequence.blocks, sequence.fed = self.pool.take(needed), 0
            self.active.append(sequence)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.page_size)

    def reserve_decoding_blocks(self, decoding: list[Sequence]) -> list[Sequence]:
        """A block for each decoding sequence whose next position starts one; the sequence admitted last gives its
        blocks back (and waits again) while the pool runs dry."""
        for sequence in decoding:
            while sequence in self.active and len(sequence.blocks) < self.blocks_for(sequence.fed + 1):
                if self.pool.free:
                    sequence.blocks += self.pool.take(1)
                else:
                    self.preempt(self.active[-1])
        return [s for s in decoding if s in self.active]

    def preempt(self, sequence: Sequence) -> None:
        self.active.remove(sequence)
        self.pool.give_back(sequence.blocks)
        sequence.blocks, sequence.fed = [], 0
        self.waiting.appendleft(sequence)
        self.preemptions += 1
        with self.lock:
            self.queued += 1

    def guarded(self, run_pass, sequences: list[Sequence]) -> None:
        """A failed pass (out of memory, say) ends the requests it ran, with the error; the others go on."""
        try:
            run_pass(sequences)
        except Exception as error:  # out of memory or a bug on one batch: its requests fail, the server goes on
            traceback.print_exc()
            for sequence in sequences:
                if sequence in self.active:
                    sequence.events.put(("error", sequence.index, f"generation failed ({type(error).__name__})"))
                    self.retire(sequence)

    # ---- forward passes -------------------------------------------------------------------------------------------
    def prefill(self, sequences: list[Sequence]) -> None:
        """Feed the next chunk of each sequence's context, as many sequences as the token budget holds (rows padded
        to the longest chunk; the first always runs). A LongRoPE context is fed whole: the model picks its rotary
        factors by the longest position of the pass."""
        whole = self.model.config.rope_scaling is not None and self.model.config.rope_scaling["type"] == "longrope"
        rows, chunks, width = [], [], 0
        for sequence in sequences:
            left = sequence.context_length - sequence.fed
            chunk = left if whole else min(left, self.prefill_tokens)
            if rows and (len(rows) + 1) * max(width, chunk) > self.prefill_tokens:
                break
            missing = self.blocks_for(sequence.fed + chunk) - len(sequence.blocks)
            if missing > len(self.pool.free):  # (a LongRoPE restart's newest token) wait for blocks to come back
                continue
            sequence.blocks += self.pool.take(max(0, missing))
            rows.append(sequence)
            chunks.append(chunk)
            width = max(width, chunk)
        if rows:
            self.forward(rows, chunks, width)

    def decode(self, sequences: list[Sequence]) -> None:
        self.decoding = len(sequences)
        self.largest_batch = max(self.largest_batch, len(sequences))
        self.forward(sequences, [1] * len(sequences), 1)

    def forward(self, rows: list[Sequence], chunks: list[int], width: int) -> None:
        """Run each row's next `chunks[i]` context tokens (padded to `width`) and sample the rows that have then fed
        their whole context."""
        page = self.page_size
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        slots = torch.full((len(rows), width), NULL_BLOCK * page, dtype=torch.long)
        length = max(s.fed + c for s, c in zip(rows, chunks))
        table = torch.full((len(rows), self.blocks_for(length)), NULL_BLOCK, dtype=torch.long)
        for i, (sequence, chunk) in enumerate(zip(rows, chunks)):
            start = sequence.fed
            tokens[i, :chunk] = torch.tensor(sequence.context(start, start + chunk))
            positions[i, :chunk] = torch.arange(start, start + chunk)
            blocks = torch.tensor(sequence.blocks, dtype=torch.long)
            slots[i, :chunk] = blocks[positions[i, :chunk] // page] * page + positions[i, :chunk] % page
            table[i, : len(sequence.blocks)] = blocks[: table.size(1)]
        every = torch.arange(length)
        reads = table[:, every // page] * page + every % page
        finished = [i for i, (s, c) in enumerate(zip(rows, chunks)) if s.fed + c == s.context_length]
        last = torch.tensor([chunks[i] - 1 for i in finished], dtype=torch.long)
        logits = self.run_pass(tokens, positions, slots, reads, torch.tensor(finished, dtype=torch.long), last)
        for sequence, chunk in zip(rows, chunks):
            sequence.fed += chunk
        if finished:
            self.sample_and_accept([rows[i] for i in finished], logits)

    @torch.inference_mode()
    def run_pass(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, reads: torch.Tensor,
                 finished: torch.Tensor, last: torch.Tensor) -> Optional[torch.Tensor]:
        """The model's pass over a batch (tokens and positions (B, T), each token's cache slot, each row's slots to
        read) and the logits at position `last[i]` of each row `finished[i]` (None without one): all a pass needs
        comes in tensors, so that the ranks of a model split by tensor parallelism can make it together
        (`litgpt.distributed.lockstep`)."""
        device = self.device
        self.batch.slots, self.batch.reads = slots.to(device), reads.to(device)
        forward = getattr(self.model, "decode_forward", self.model) if tokens.size(1) == 1 else self.model  # --compile
        hidden = forward(tokens.to(device), input_pos=positions.to(device), return_hidden=True)
        # The head runs on every pass, with no rows too: sharded as an FSDP unit of its own, it gathers its weights
        # with the other ranks, whose passes may have finished rows (`litgpt.distributed.fsdp.head_unit`).
        logits = self.model.head(hidden[finished.to(device), last.to(device)])
        return logits if finished.numel() else None

    def sample_and_accept(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        greedy = logits.argmax(dim=-1).tolist()
        for row, s in enumerate(sequences):
            token = greedy[row] if s.temperature == 0 else int(
                sample(logits[row], s.temperature, s.top_k, s.top_p, s.generator))
            self.accept(s, token)

    def accept(self, s: Sequence, token: int) -> None:
        """Count a sampled token; emit what is sure, and retire the sequence when it is done."""
        s.tokens.append(token)
        s.pending.append(token)
        finish = None
        stopped = next((stop for stop in s.stops if s.pending[-len(stop):] == stop), None)
        if stopped is not None:
            s.pending = s.pending[: len(s.pending) - len(stopped)]
            finish = "stop"
        elif len(s.tokens) >= s.max_new_tokens or s.context_length >= self.max_seq_length:
            finish = "length"  # or its successor would not fit
        keep = 0 if finish else held_back(s.pending, s.stops)
        if len(s.pending) > keep:
            s.events.put(("tokens", s.index, s.pending[: len(s.pending) - keep]))
            s.pending = s.pending[len(s.pending) - keep:]
        if finish:
            s.events.put(("finish", s.index, finish))
            self.retire(s)
        elif s.fed == longrope_restart(self.model.config, len(s.prompt_ids)):
            s.fed = 0  # LongRoPE's switch to its long factors: the whole context again, as `litgpt generate` does

    def retire(self, sequence: Sequence) -> None:
        self.active.remove(sequence)
        self.pool.give_back(sequence.blocks)
        sequence.blocks = []
        self.done(sequence, admitted=True)

    def done(self, sequence: Sequence, admitted: bool) -> None:
        with self.lock:
            self.in_flight -= 1
            if not admitted:
                self.queued -= 1
        if not self.active:
            self.decoding = 0

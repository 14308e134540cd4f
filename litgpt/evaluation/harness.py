"""lm-evaluation-harness's model interface over a litgpt `GPT` and `Tokenizer`.

Loglikelihoods are computed in batches of `batch_size` sequences, longest first (least padding), right-padded: the
model is causal, so what follows a sequence changes none of its logits. A sequence longer than the context is cut
from the left, keeping the continuation whole. `generate_until` decodes greedily with a KV cache, `batch_size` prompts
at a time among prompts of the same length in tokens (the model has no padding mask, so prompts of different lengths
cannot share a batch).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from litgpt.errors import UserError
from litgpt.generate import longrope_restart
from litgpt.progress import Progress


class HarnessModel(TemplateLM):
    """lm-eval's model interface over a litgpt `GPT` and `Tokenizer` (loglikelihood, rolling loglikelihood,
    greedy generation with stop strings)."""

    def __init__(self, model, tokenizer, batch_size: int = 1, max_length: Optional[int] = None) -> None:
        super().__init__()
        self.model = model
        self.lit_tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or model.config.block_size

    @property
    def eot_token_id(self) -> int:
        tokenizer = self.lit_tokenizer
        return tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.bos_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (and a rolling window's first prediction) conditions on: BOS, else EOS."""
        tokenizer = self.lit_tokenizer
        return tokenizer.bos_id if tokenizer.bos_id is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        # None/True: what the tokenizer adds by itself (as `AutoTokenizer.encode`); False: the text's tokens only.
        edges = {} if add_special_tokens is None or add_special_tokens else {"bos": False, "eos": False}
        return self.lit_tokenizer.encode(string, **edges).tolist()

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        with Progress(len(pairs), "Loglikelihoods", unit="request", enabled=not disable_tqdm) as shown:
            return continuation_loglikelihoods(self.model, pairs, self.batch_size, self.max_length, shown)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        strings = [string for (string,) in (request.args for request in requests)]
        with Progress(len(strings), "Rolling loglikelihoods", unit="request", enabled=not disable_tqdm) as shown:
            totals = []
            for string in strings:
                tokens = self.tok_encode(string, add_special_tokens=False)
                totals.append(sum(score for score, _ in self.rolling_scores(tokens, show_progress=False)))
                shown.update(1)
        return totals

    def rolling_scores(self, tokens: list[int], stride: Optional[int] = None,
                       show_progress: bool = True) -> list[tuple[float, bool]]:
        """Scores of windows covering every token of `tokens`, the first conditioned on the prefix token; each
        window predicts `stride` new tokens (default: the whole context) after the tokens before them. The progress
        is shown in windows (a long text's perplexity takes a while)."""
        stride = stride or self.max_length
        windows = get_rolling_token_windows(
            tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
            context_len=self.max_length - stride + 1,
        )
        pairs = [make_disjoint_window(window) for window in windows]
        with Progress(len(pairs), "Scoring windows", unit="window", enabled=show_progress) as shown:
            return continuation_loglikelihoods(self.model, pairs, self.batch_size, self.max_length, shown)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations cut before the first stop string ("until") or the end token. Prompts of the same
        length (in tokens) and the same `max_gen_toks` are decoded together, up to `batch_size` at a time."""
        prepared = [self.prepare_generation(context, dict(gen_kwargs)) for context, gen_kwargs in
                    (request.args for request in requests)]
        groups: dict[tuple[int, int], list[int]] = {}
        for index, (ids, _, max_gen_toks) in enumerate(prepared):
            groups.setdefault((len(ids), max_gen_toks), []).append(index)
        answers = [""] * len(prepared)
        with Progress(len(prepared), "Generating", unit="request", enabled=not disable_tqdm) as shown:
            for (_, max_gen_toks), indices in groups.items():
                for first in range(0, len(indices), self.batch_size):
                    batch = indices[first : first + self.batch_size]
                    texts = greedy_until(self.model, self.lit_tokenizer, [prepared[i][0] for i in batch],
                                         [prepared[i][1] for i in batch], max_gen_toks, self.eot_token_id)
                    for index, text in zip(batch, texts):
                        answers[index] = text
                    shown.update(len(batch))
        return answers

    def prepare_generation(self, context: str, gen_kwargs: dict) -> tuple[list[int], list[str], int]:
        """The prompt's ids, the stop strings and the most tokens to generate of a generate_until request."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen_toks = int(gen_kwargs.pop("max_gen_toks", 256))
        # Room for the answer: the context keeps its last max_length - max_gen_toks tokens (at least one, and one
        # position short of the context, which generation needs).
        keep = max(1, min(self.max_length, self.model.config.block_size - 1) - max_gen_toks)
        return self.tok_encode(context)[-keep:], until, max_gen_toks

    def get_model_info(self) -> dict:
        return {"checkpoint_dir": str(self.lit_tokenizer.checkpoint_dir)}


@torch.inference_mode()
def greedy_until(model, tokenizer, prompts: list[list[int]], stops: list[list[str]], max_new_tokens: int,
                 stop_id: Optional[int]) -> list[str]:
    """Greedy continuations of prompts of one length, decoded together with a KV cache of one row per prompt; each
    is cut before the first of its stop strings, or its `stop_id` token. Ends when every row has stopped."""
    device = model.lm_head.weight.device
    rows, length = len(prompts), len(prompts[0])
    new_tokens = min(max_new_tokens, model.config.block_size - length)
    if new_tokens <= 0:
        return [""] * rows
    model.set_kv_cache(batch_size=rows, max_seq_length=length + new_tokens - 1)
    fed = torch.tensor(prompts, device=device)
    logits = model(fed, input_pos=torch.arange(length, device=device))
    restart = longrope_restart(model.config, length)
    generated: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for step in range(new_tokens):
        tokens = logits[:, -1].argmax(dim=-1)
        for row, token in enumerate(tokens.tolist()):
            if done[row]:
                continue
            if token == stop_id:
                done[row] = True
                continue
            generated[row].append(token)
            done[row] = any(stop in tokenizer.decode(generated[row]) for stop in stops[row] if stop)
        if all(done) or step + 1 == new_tokens:
            break
        fed = torch.cat((fed, tokens[:, None]), dim=1)
        if length + step == restart:  # LongRoPE's switch to its long factors: every row again, as `generate` does
            logits = model(fed, input_pos=torch.arange(fed.size(1), device=device))
        else:
            logits = model(tokens[:, None], input_pos=torch.tensor([length + step], device=device))
    model.clear_kv_cache()
    return [cut_at_stops(tokenizer.decode(ids), row_stops) for ids, row_stops in zip(generated, stops)]


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string."""
    end = min((text.find(stop) for stop in stops if stop and stop in text), default=len(text))
    return text[:end]


@torch.inference_mode()
def continuation_loglikelihoods(
    model, pairs: Sequence[tuple[list[int], list[int]]], batch_size: int, max_length: int,
    shown: Optional[Progress] = None,
) -> list[tuple[float, bool]]:
    """(sum of log-probabilities of the continuation given the context, whether greedy decoding gives it) for each
    (context ids, continuation ids) pair. The model sees at most the last `max_length` tokens of context +
    continuation (minus the last token, which is only predicted); pairs go through in batches of `batch_size`,
    longest first (less padding), right-padded. Logits are computed only where a continuation is predicted.
    `shown` is advanced by each pair done."""
    for _, continuation in pairs:
        if len(continuation) > max_length:
            raise UserError(
                f"A continuation of {len(continuation)} tokens does not fit in a context of {max_length} tokens: "
                "raise --max_length (up to the model's block_size) or use a model with a longer context."
            )
    device = model.lm_head.weight.device
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)  # an empty continuation has probability 1
    order = [index for index in order if pairs[index][1]]
    if shown is not None:
        shown.update(len(pairs) - len(order))  # the empty continuations, done already
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        inputs = [(list(pairs[i][0]) + list(pairs[i][1]))[-(max_length + 1) :][:-1] for i in batch]
        padded = torch.zeros(len(batch), max(len(ids) for ids in inputs), dtype=torch.long)
        for row, ids in enumerate(inputs):
            padded[row, : len(ids)] = torch.tensor(ids)
        hidden = model(padded.to(device), return_hidden=True)
        lengths = [len(pairs[index][1]) for index in batch]
        # The hidden states that predict each continuation's tokens: the last n positions of its row.
        predicting = torch.cat([hidden[row, len(ids) - n : len(ids)]
                                for row, (ids, n) in enumerate(zip(inputs, lengths))])
        logprobs = output_logits(model, predicting).float().log_softmax(dim=-1)
        targets = torch.tensor([token for index in batch for token in pairs[index][1]], device=device)
        token_scores = logprobs.gather(-1, targets[:, None])[:, 0].split(lengths)
        greedy = (logprobs.argmax(dim=-1) == targets).split(lengths)
        for index, scores, hits in zip(batch, token_scores, greedy):
            results[index] = (scores.sum().item(), bool(hits.all()))
        if shown is not None:
            shown.update(len(batch))
    return results


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits `GPT.forward` computes from the final norm's output `hidden`, for the rows given only."""
    logits = model.lm_head(hidden)
    softcap = model.config.final_logit_softcapping
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap

"""lm-evaluation-harness's model interface over a litgpt `GPT` and `Tokenizer`.

Loglikelihoods are computed in batches of `batch_size` sequences, longest first (least padding), right-padded: the
model is causal, so what follows a sequence changes none of its logits. A sequence longer than the context is cut
from the left, keeping the continuation whole. `generate_until` decodes greedily with a KV cache, `batch_size` prompts
at a time among prompts of the same length in tokens (the model has no padding mask, so prompts of different lengths
cannot share a batch). A request whose `gen_kwargs` ask for sampling draws its tokens with a generator of its own, seeded
from the run's seed and the request, so a sampled answer is the same at any batch size and on any rank.

Data-parallel runs (`litgpt evaluate --devices N`): lm-eval gives each rank its share of the documents and gathers the
metrics through `all_gather`/`gather_object`/`barrier` here. With `--apply_chat_template` lm-eval lays prompts out with
`apply_chat_template`, i.e. the checkpoint's own chat template (else its prompt style).
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from litgpt.errors import UserError
from litgpt.generate import check_sampling_args, exponential_noise, longrope_restart, pick
from litgpt.progress import Progress


class HarnessModel(TemplateLM):
    """lm-eval's model interface over a litgpt `GPT` and `Tokenizer` (loglikelihood, rolling loglikelihood,
    generation with stop strings, greedy or sampled as each request asks).

    `seed` seeds sampled generations; `chat_format` (a `ChatFormat`) lays out lm-eval's chat histories when the run
    applies a chat template (then prompts are tokenized as rendered, nothing added); `rank` and `world_size` place
    this process in a data-parallel run whose process group is up."""

    def __init__(self, model, tokenizer, batch_size: int = 1, max_length: Optional[int] = None, seed: int = 1234,
                 chat_format=None, rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        self.model = model
        self.lit_tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or model.config.block_size
        self.seed = seed
        self.chat_format = chat_format
        self._rank, self._world_size = rank, world_size
        self._device = model.lm_head.weight.device

    @property
    def device(self) -> torch.device:
        return self._device

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated in rank order (0-d tensors stacked), as accelerate's `gather`."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list]:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    @property
    def tokenizer_name(self) -> str:
        """Names the tokenizer in lm-eval's request-cache keys of chat-templated runs."""
        return str(self.lit_tokenizer.checkpoint_dir).replace("/", "__")

    def chat_template(self, chat_template=False) -> str:
        """The template lm-eval records in its results: the checkpoint's Jinja text, or its prompt style's name."""
        if self.chat_format is None:
            return ""
        template = self.chat_format.template
        return template.source if template is not None else self.chat_format.description

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat history as the checkpoint's template writes it. Without a generation prompt the last (assistant)
        message is continued, as transformers' `continue_final_message`: the text ends where its content ends."""
        if self.chat_format is None:
            raise UserError("This model was set up without a chat format: pass --apply_chat_template.")
        text = self.chat_format.prompt_text(chat_history, add_generation_prompt=add_generation_prompt)
        final = str(chat_history[-1].get("content") or "").strip() if not add_generation_prompt else ""
        return text[: text.rindex(final) + len(final)] if final and final in text else text

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
        # A chat-templated prompt already holds its special tokens (as text): nothing is added, their text is their id.
        if self.chat_format is not None and add_special_tokens is None:
            from litgpt.chat_template import encode_rendered

            return encode_rendered(self.lit_tokenizer, string)
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
        """Continuations cut before the first stop string ("until") or the end token, greedy unless the request's
        `gen_kwargs` ask for sampling. Prompts of the same length (in tokens), `max_gen_toks` and sampling settings
        are decoded together, up to `batch_size` at a time."""
        prepared = [self.prepare_generation(context, dict(gen_kwargs)) for context, gen_kwargs in
                    (request.args for request in requests)]
        seeds = request_seeds(self.seed, [request.args for request in requests])
        groups: dict[tuple, list[int]] = {}
        for index, (ids, _, max_gen_toks, settings) in enumerate(prepared):
            groups.setdefault((len(ids), max_gen_toks, settings), []).append(index)
        answers = [""] * len(prepared)
        with Progress(len(prepared), "Generating", unit="request", enabled=not disable_tqdm) as shown:
            for (_, max_gen_toks, settings), indices in groups.items():
                for first in range(0, len(indices), self.batch_size):
                    batch = indices[first : first + self.batch_size]
                    texts = decode_until(self.model, self.lit_tokenizer, [prepared[i][0] for i in batch],
                                         [prepared[i][1] for i in batch], max_gen_toks, self.eot_token_id,
                                         settings, [seeds[i] for i in batch])
                    for index, text in zip(batch, texts):
                        answers[index] = text
                    shown.update(len(batch))
        return answers

    def prepare_generation(self, context: str, gen_kwargs: dict) -> tuple[list[int], list[str], int, tuple]:
        """The prompt's ids, the stop strings, the most tokens to generate and the sampling settings
        (`sampling_settings`) of a generate_until request."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen_toks = int(gen_kwargs.pop("max_gen_toks", 256))
        # Room for the answer: the context keeps its last max_length - max_gen_toks tokens (at least one, and one
        # position short of the context, which generation needs).
        keep = max(1, min(self.max_length, self.model.config.block_size - 1) - max_gen_toks)
        return self.tok_encode(context)[-keep:], until, max_gen_toks, sampling_settings(gen_kwargs)

    def get_model_info(self) -> dict:
        return {"checkpoint_dir": str(self.lit_tokenizer.checkpoint_dir)}


GREEDY = (0.0, None, 1.0)
# Generation options of lm-eval tasks that decoding honours besides until/max_gen_toks; `num_beams: 1` is plain decoding.
SAMPLING_OPTIONS = ("do_sample", "temperature", "top_k", "top_p")


def sampling_settings(gen_kwargs: dict) -> tuple[float, Optional[int], float]:
    """(temperature, top_k, top_p) of a request's remaining `gen_kwargs`; GREEDY unless they ask for sampling.
    As lm-eval's transformers backend: no options, `do_sample: false` or temperature 0 decode greedily. Sampling
    is `do_sample: true` (temperature 1 unless given) or, as its vLLM backend reads them, a temperature above 0
    without do_sample. top_k 0 or None keeps every token (transformers' meaning)."""
    unknown = sorted(key for key in gen_kwargs if key not in SAMPLING_OPTIONS and
                     not (key == "num_beams" and gen_kwargs[key] == 1))
    if unknown:
        raise UserError(f"A task asks for generation option(s) {', '.join(unknown)}, which litgpt's decoding does "
                        f"not have (it knows until, max_gen_toks, {', '.join(SAMPLING_OPTIONS)}): run it with "
                        "--backend hf, or drop the option from the task's generation_kwargs.")
    do_sample, temperature = gen_kwargs.get("do_sample"), gen_kwargs.get("temperature")
    if do_sample is False or temperature == 0 or (do_sample is None and not temperature):
        return GREEDY
    temperature = 1.0 if temperature is None else float(temperature)
    top_k = gen_kwargs.get("top_k") or None
    top_p = 1.0 if gen_kwargs.get("top_p") is None else float(gen_kwargs["top_p"])
    check_sampling_args(temperature, top_k, top_p)
    return temperature, top_k, top_p


def request_seeds(seed: int, arguments: Sequence[tuple]) -> list[int]:
    """A seed for each generate_until request from the run's seed, its prompt and options, and how many identical
    requests came before it (the repeats of a majority-vote task draw differently): the same at any batch size
    and on whichever rank a document lands."""
    seen: dict[str, int] = {}
    seeds = []
    for context, gen_kwargs in arguments:
        key = repr((seed, context, sorted(dict(gen_kwargs).items(), key=lambda item: item[0])))
        seen[key] = seen.get(key, -1) + 1
        digest = hashlib.sha256(f"{key}#{seen[key]}".encode()).digest()
        seeds.append(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return seeds


@torch.inference_mode()
def decode_until(model, tokenizer, prompts: list[list[int]], stops: list[list[str]], max_new_tokens: int,
                 stop_id: Optional[int], settings: tuple = GREEDY, seeds: Optional[list[int]] = None) -> list[str]:
    """Continuations of prompts of one length, decoded together with a KV cache of one row per prompt; each is cut
    before the first of its stop strings, or its `stop_id` token. Ends when every row has stopped. `settings` is
    (temperature, top_k, top_p) as `sample` takes them; a sampling row draws with a generator seeded by its seed."""
    device = model.lm_head.weight.device
    rows, length = len(prompts), len(prompts[0])
    new_tokens = min(max_new_tokens, model.config.block_size - length)
    if new_tokens <= 0:
        return [""] * rows
    temperature, top_k, top_p = settings
    generators = None
    if temperature > 0:
        generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    model.set_kv_cache(batch_size=rows, max_seq_length=length + new_tokens - 1)
    fed = torch.tensor(prompts, device=device)
    logits = model(fed, input_pos=torch.arange(length, device=device))
    restart = longrope_restart(model.config, length)
    generated: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for step in range(new_tokens):
        last = logits[:, -1]
        noise = None if generators is None else torch.cat(
            [exponential_noise(last[row : row + 1], temperature, top_k, generator)
             for row, generator in enumerate(generators)])
        tokens = pick(last, temperature, top_k, top_p, noise)
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


def greedy_until(model, tokenizer, prompts: list[list[int]], stops: list[list[str]], max_new_tokens: int,
                 stop_id: Optional[int]) -> list[str]:
    """`decode_until` picking the most likely token at every step."""
    return decode_until(model, tokenizer, prompts, stops, max_new_tokens, stop_id, GREEDY)


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

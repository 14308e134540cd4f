"""Preference optimization's losses: DPO and its kin, on pairs of a chosen and a rejected answer to one prompt.

A micro-batch of B pairs is one (2B, T) batch, the B chosen sequences first and the B rejected ones after, so the
policy runs one forward over both. Each sequence's log-probability is the sum of its answer tokens' log-probabilities
(the prompt and the padding have no label); the output head builds the logits chunk by chunk as training's other
losses do (`chunked_head_loss` with one value per position), so no (2B x T x vocab) tensor exists.

With a reference (sigmoid, ipo, hinge, robust), each answer's reward is beta x (policy - reference) log-probability;
the reference-free losses (simpo, orpo) reward beta x the policy's mean log-probability per answer token. The logged
parts carry TRL's names (rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
logps/rejected), means over the pairs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from litgpt.args import DPOArgs
from litgpt.data.base import IGNORE_INDEX
from litgpt.train.loss import Losses, head_loss, nll_chunk, with_router_aux_loss

Pair = tuple[torch.Tensor, torch.Tensor]  # (chosen, rejected), one value per pair each


def token_nll(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, chunk_size: Optional[int] = None,
              chunked: bool = True) -> torch.Tensor:
    """Each position's negative log-likelihood of its label (0 where it has none), (rows, T): the logits built chunk
    by chunk from the model's final hidden states, or whole (`chunked=False`, a module whose head the loss cannot
    apply itself)."""
    from litgpt.checkpoint.manager import unwrap

    if not chunked:
        logits = model(input_ids).float()
        nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
        return nll.view(labels.shape)
    gpt = unwrap(model)
    hidden = model(input_ids, return_hidden=True)
    return head_loss(gpt, hidden, labels, nll_chunk, chunk_size, per_position=True)


def sequence_logps(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, chunk_size: Optional[int] = None,
                   chunked: bool = True) -> torch.Tensor:
    """Each sequence's summed log-probability of its labelled tokens, (rows,)."""
    return -token_nll(model, input_ids, labels, chunk_size, chunked).sum(1)


def with_prompt_labels(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`labels` with the prompt's positions (those before the first labelled one) labelled too, by the next input
    token: the whole sequence but its padding."""
    labelled = labels != IGNORE_INDEX
    before_answer = labelled.cumsum(1) == 0
    before_answer &= labelled.any(1, keepdim=True)
    next_tokens = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    return torch.where(before_answer, next_tokens, labels)


def halves(values: torch.Tensor) -> Pair:
    """(chosen, rejected) of a (2B,) tensor whose first half holds the chosen sequences."""
    chosen, rejected = values.chunk(2)
    return chosen, rejected


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def smoothed_sigmoid_loss(margin: torch.Tensor, smoothing: float) -> torch.Tensor:
    """-log sigmoid(margin), a share `smoothing` of the pairs counted as flipped (conservative DPO)."""
    return -(1 - smoothing) * F.logsigmoid(margin) - smoothing * F.logsigmoid(-margin)


def pair_losses(args: DPOArgs, logps: Pair, counts: Pair, reference: Optional[Pair]) -> tuple[torch.Tensor, Pair]:
    """Each pair's loss (without ORPO's cross-entropy term) and the (chosen, rejected) rewards, from the policy's
    summed log-probabilities `logps`, the answers' token `counts` and the reference's summed log-probabilities."""
    beta, (chosen, rejected), (chosen_n, rejected_n) = args.beta, logps, counts
    if args.loss in ("simpo", "orpo"):
        chosen_mean, rejected_mean = chosen / chosen_n, rejected / rejected_n
        rewards = (beta * chosen_mean.detach(), beta * rejected_mean.detach())
        if args.loss == "simpo":
            margin = chosen_mean - rejected_mean - args.simpo_gamma / beta
            return smoothed_sigmoid_loss(beta * margin, args.label_smoothing), rewards
        log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
        return -beta * F.logsigmoid(log_odds), rewards
    chosen_ratio, rejected_ratio = chosen - reference[0], rejected - reference[1]
    rewards = (beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
    margin = chosen_ratio - rejected_ratio
    if args.loss == "sigmoid":
        return smoothed_sigmoid_loss(beta * margin, args.label_smoothing), rewards
    if args.loss == "hinge":
        return torch.relu(1 - beta * margin), rewards
    if args.loss == "ipo":  # on the mean log-ratio per answer token, as TRL and IPO's authors compute it
        mean_margin = chosen_ratio / chosen_n - rejected_ratio / rejected_n
        return (mean_margin - 1 / (2 * beta)) ** 2, rewards
    smoothing = args.label_smoothing  # robust: unbiased under a share `smoothing` of flipped labels
    robust = (1 - smoothing) * -F.logsigmoid(beta * margin) + smoothing * F.logsigmoid(-beta * margin)
    return robust / (1 - 2 * smoothing), rewards


def preference_loss(model: nn.Module, batch: dict[str, torch.Tensor], args: DPOArgs,
                    reference_logps: Optional[torch.Tensor], chunk_size: Optional[int] = None,
                    chunked: bool = True) -> Losses:
    """The mean loss over the micro-batch's pairs and its logged parts. `reference_logps`: the reference's summed
    log-probabilities of the 2B sequences (None for a reference-free loss)."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    answer = labels != IGNORE_INDEX
    counts = halves(answer.sum(1).clamp(min=1).float())
    if args.loss == "orpo":  # its cross-entropy term covers the chosen prompts too, as TRL's ORPOTrainer computes it
        chosen_rows = torch.arange(labels.size(0), device=labels.device).unsqueeze(1) < labels.size(0) // 2
        labels = torch.where(chosen_rows, with_prompt_labels(input_ids, labels), labels)
    nll = token_nll(model, input_ids, labels, chunk_size, chunked)
    policy = halves(-(nll * answer).sum(1))
    reference = None if reference_logps is None else halves(reference_logps.to(nll.dtype))
    losses, (chosen_rewards, rejected_rewards) = pair_losses(args, policy, counts, reference)
    loss = losses.mean()
    parts = {}
    if args.loss == "orpo":  # the chosen sequences' cross-entropy, a mean over their labelled tokens
        chosen_nll, chosen_labels = halves(nll)[0], halves(labels != IGNORE_INDEX)[0]
        sft = chosen_nll.sum() / chosen_labels.sum().clamp(min=1)
        loss, parts["nll_loss"] = loss + sft, sft.detach()
    parts.update({
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": policy[0].detach().mean(),
        "logps/rejected": policy[1].detach().mean(),
    })
    return with_router_aux_loss(model, {"loss": loss, **parts})

"""Group-relative policy optimization's pieces on tensors: the advantages of a batch of groups and the clipped
policy loss of its completions' tokens (GRPO of DeepSeekMath, Dr. GRPO, DAPO), with the logged parts TRL logs.

A completion's advantage is its reward less its group's mean (divided by the group's standard deviation for grpo
and dapo); every token of the completion carries it. The loss of a token is PPO's clipped surrogate
-min(r A, clip(r, 1 - eps, 1 + eps_high) A), r = pi / pi_old, plus beta times the k3 estimate of KL(pi || ref).
With one optimizer step per generation pi_old is pi itself (detached): r = 1 and the gradient is REINFORCE's with
the group mean as baseline.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from litgpt.args import GRPOArgs
from litgpt.train.objective import Batch, Losses

STD_EPSILON = 1e-4  # TRL's: a group whose rewards barely differ does not blow its advantages up


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, whether each group's rewards all agree) of `rewards` laid out group after group, (N,) and
    (N // group,): reward minus the group mean, over (unbiased std + 1e-4) with `scale`."""
    grouped = rewards.view(-1, group)
    centered = grouped - grouped.mean(1, keepdim=True)
    std = grouped.std(1, keepdim=True)
    advantages = centered / (std + STD_EPSILON) if scale else centered
    return advantages.reshape(-1), torch.isclose(std.squeeze(1), torch.zeros_like(std.squeeze(1)))


def scales_advantages(loss: str) -> bool:
    """Dr. GRPO drops the division by the group's std (its bias toward groups of agreeing rewards)."""
    return loss != "dr_grpo"


def policy_loss(logps: torch.Tensor, old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
                advantages: torch.Tensor, mask: torch.Tensor, args: GRPOArgs,
                token_normalizer: Optional[torch.Tensor] = None) -> Losses:
    """The loss of one micro-batch of completions and its logged parts.

    logps, old_logps, ref_logps: (B, T) log-probabilities of each completion token under the policy, the policy that
    sampled it (None: the policy itself, detached) and the reference (needed when beta > 0); mask (B, T) marks the
    completion tokens; advantages (B,). `token_normalizer`: dapo's count of tokens each micro-batch stands for (the
    step's completion tokens over its micro-batches), so that every token of the step weighs the same.
    """
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    advantage = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.upper_clip)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    parts = {}
    if args.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + args.beta * kl
        parts["kl"] = (kl * mask).sum().detach() / mask.sum().clamp(min=1)
    if args.loss == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    elif args.loss == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * args.max_new_tokens)
    else:
        normalizer = mask.sum() if token_normalizer is None else token_normalizer
        loss = (per_token * mask).sum() / normalizer.clamp(min=1)
    outside = ((ratio < 1 - args.epsilon) & (advantage < 0)) | ((ratio > 1 + args.upper_clip) & (advantage > 0))
    parts["clip_fraction"] = (outside.to(mask.dtype) * mask).sum().detach() / mask.sum().clamp(min=1)
    return {"loss": loss, **parts}


def completion_logps(model: nn.Module, batch: Batch, chunk_size: Optional[int], chunked: bool) -> torch.Tensor:
    """(B, T) log-probability of each labelled (completion) token of the batch under `model` (0 elsewhere)."""
    from litgpt.train.preference_loss import token_nll

    return -token_nll(model, batch["input_ids"], batch["labels"], chunk_size, chunked)

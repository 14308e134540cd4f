"""Group-relative policy optimization as a recipe (`litgpt grpo`): the policy trains as finetune_lora's or
finetune_full's model does, on completions it samples itself.

A sample is a prompt. Each optimizer step's prompts (`steps_per_generation` steps' at once) get `num_generations`
completions each, sampled from the policy as it is now (`litgpt.train.rollout`), scored by the reward functions
(`litgpt.train.rewards`); the advantages compare each completion's reward with its group's (`litgpt.train.grpo_loss`).
This happens in the objective's `make_batches`, between the data and the loss: the trainer sees micro-batches of
prompt + completion sequences like any other. With beta > 0 the reference is the base with the adapters switched off
(LoRA) or a frozen copy of the initial weights (full), as for DPO; its log-probabilities are computed once per
generation, as are the sampling policy's when a generation serves several steps.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from litgpt.args import GRPOArgs
from litgpt.config import Config
from litgpt.data.base import IGNORE_INDEX, collate
from litgpt.precision import Precision
from litgpt.train.grpo_loss import completion_logps, group_advantages, policy_loss, scales_advantages
from litgpt.train.objective import Batch, Objective
from litgpt.train.recipe import Recipe
from litgpt.train.rewards import Rewards
from litgpt.checkpoint.manager import unwrap
from litgpt.train.rollout import any_rank, completion_seed, evaluating, sample_completions


@dataclass(frozen=True)
class GRPOSettings:
    """What `litgpt grpo` adds to a finetuning recipe: the options (--grpo.*), the rewards, and the seed of the
    sampling streams."""

    args: GRPOArgs
    rewards: Optional[Rewards]  # None where nothing is scored (`litgpt plan`)
    seed: int = 0


@dataclass(frozen=True)
class GRPORecipe(Recipe):
    grpo: Optional[GRPOSettings] = None

    frozen_outputs_reach_the_loss = False

    def __post_init__(self) -> None:
        if self.grpo is None:
            raise ValueError("GRPORecipe needs its GRPOSettings")

    @property
    def sequences_per_sample(self) -> int:
        return self.grpo.args.num_generations

    @property
    def reference(self) -> str:
        """"none" (beta 0), "adapters off" (LoRA) or "frozen copy" (full finetuning)."""
        if self.grpo.args.beta == 0:
            return "none"
        return "adapters off" if self.lora is not None else "frozen copy"

    def frozen_configs(self) -> dict[str, Config]:
        return {"reference": self.config} if self.reference == "frozen copy" else {}

    def plan_summary(self, frozen_params: str) -> str:
        reference = {"none": "no reference (beta 0)", "adapters off": "the reference: the base with the adapters off",
                     "frozen copy": f"a frozen {frozen_params}-parameter reference"}[self.reference]
        args = self.grpo.args
        return f"GRPO ({args.loss}, groups of {args.num_generations}), {reference}"

    def materialize_frozen(self, fabric, precision: Precision, compile_blocks: bool) -> dict[str, nn.Module]:
        if self.reference != "frozen copy":
            return {}
        return {"reference": self.frozen_model(fabric, self.config, Path(self.initial_weights), precision,
                                               compile_blocks, subject="The reference model's weights")}

    def objective(self, frozen: dict[str, nn.Module], chunk_size: Optional[int] = None,
                  chunked: bool = True) -> Objective:
        """The clipped policy loss of the rollouts (validation: the same on rollouts of the validation prompts), the
        rollouts made by `Rollouts` from the data's prompts."""
        args = self.grpo.args

        def loss(model: nn.Module, batch: Batch):
            logps = completion_logps(model, batch, chunk_size, chunked)
            mask = (batch["labels"] != IGNORE_INDEX) & batch["kept"].unsqueeze(1)
            losses = policy_loss(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"], mask,
                                 args, batch.get("token_normalizer"))
            logged = {name[len("log/"):]: value for name, value in batch.items() if name.startswith("log/")}
            return {**losses, **logged}

        rollouts = Rollouts(self.grpo, frozen.get("reference"), self.reference, chunk_size, chunked)
        return Objective(train_loss=loss, validation_loss=loss, make_batches=rollouts)


class Rollouts:
    """`Objective.make_batches` of GRPO: each generation's prompts become micro-batches of scored completions."""

    def __init__(self, settings: GRPOSettings, reference: Optional[nn.Module], kind: str,
                 chunk_size: Optional[int], chunked: bool) -> None:
        self.args, self.rewards, self.seed = settings.args, settings.rewards, settings.seed
        self.reference, self.kind, self.chunk_size, self.chunked = reference, kind, chunk_size, chunked
        self.training_time = (0.0, 0)  # (seconds, tokens) the latest generation's micro-batches trained in

    def __call__(self, fabric, model: nn.Module, batches: Iterator, dataset, per_step: int) -> Iterator:
        training = model.training
        steps = self.args.steps_per_generation if training else 1
        while True:
            window = list(itertools.islice(batches, per_step * steps))
            if not window:
                return
            made = self.generation(fabric, model, window, dataset, per_step, "train" if training else "val")
            seconds, tokens = 0.0, 0
            for item in made:
                resumed = time.perf_counter()
                yield item
                seconds += time.perf_counter() - resumed
                tokens += item[2]["input_ids"].numel()
            self.training_time = (seconds, tokens)

    def generation(self, fabric, model: nn.Module, window: list, dataset, per_step: int, split: str) -> list:
        """The window's micro-batches of prompts as (epoch, index, batch) of completions, scored and with their
        advantages (and the sampling policy's and the reference's log-probabilities where the loss needs them)."""
        args, group = self.args, self.args.num_generations
        rows = [int(i) for _, _, batch in window for i in batch["index"]]
        epochs = [epoch for epoch, _, batch in window for _ in batch["index"]]
        seeds = [completion_seed(self.seed, split, epoch, row, member)
                 for epoch, row in zip(epochs, rows) for member in range(group)]
        start = time.perf_counter()
        completions = self.sample(fabric, model, dataset, rows, seeds)
        scored = self.score(dataset, rows, completions)
        if args.loss == "dapo":
            scored = self.refill(fabric, model, dataset, split, epochs, rows, completions, scored)
        generation_seconds = time.perf_counter() - start
        scores, rewards, advantages, agree = scored
        prompts = [dataset.ids[row].tolist() for row in rows for _ in range(group)]
        sequences = [shifted(prompt, completion) for prompt, completion in zip(prompts, completions)]
        made, per_micro = [], len(window[0][2]["index"]) * group
        per_step_sequences = per_micro * per_step
        for m, (epoch, index, _) in enumerate(window):
            members = range(m * per_micro, (m + 1) * per_micro)
            if m % per_step == 0:  # each step logs its own share of the generation
                step = slice(m * per_micro, m * per_micro + per_step_sequences)
                logged = self.logged(scores[step], rewards[step], agree[step.start // group:step.stop // group],
                                     completions[step], generation_seconds * per_step / len(window), fabric.device)
            batch = collate([sequences[i] for i in members])
            # dapo: groups whose rewards still all agree (after `refill`) teach nothing; the loss leaves them out.
            dropped = agree.repeat_interleave(group)[members.start:members.stop] & (args.loss == "dapo")
            batch["kept"] = ~dropped
            batch["advantages"] = advantages[members.start:members.stop].float()
            made.append((epoch, index, {**batch, **logged}))
        self.add_log_probabilities(fabric, model, [batch for _, _, batch in made], per_step)
        return made

    def sample(self, fabric, model: nn.Module, dataset, rows: list[int], seeds: list[int]) -> list[list[int]]:
        """A group of completions of each row's prompt, each completion from its seed."""
        args, group = self.args, self.args.num_generations
        prompts = [dataset.ids[row].tolist() for row in rows for _ in range(group)]
        with torch.no_grad(), fabric.autocast():
            return sample_completions(
                unwrap(model), prompts, seeds, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                list(dataset.tokenizer.stop_ids), dataset.max_seq_length + 1, args.max_batch_size,
                any_rank=any_rank(fabric) if fabric.world_size > 1 else None)

    def refill(self, fabric, model: nn.Module, dataset, split: str, epochs: list[int], rows: list[int],
               completions: list[list[int]], scored: tuple) -> tuple:
        """DAPO's dynamic sampling: for up to `refill_rounds` rounds, each group whose rewards all agree gives its
        place (in `rows` and `completions`, changed in place) to the group of a prompt drawn at random from the data.
        A draw depends on the group's seed, epoch, row and round alone, not on the rank. Returns the new scores."""
        group = self.args.num_generations
        for round in range(1, self.args.refill_rounds + 1):
            agreeing = scored[3].nonzero().flatten().tolist()
            if not (any_rank(fabric)(bool(agreeing)) if fabric.world_size > 1 else agreeing):
                break
            salt = f"{split}/refill{round}"
            draws = [completion_seed(self.seed, salt, epochs[g], rows[g], -1) % len(dataset) for g in agreeing]
            seeds = [completion_seed(self.seed, f"{salt}/{rows[g]}", epochs[g], row, member)
                     for g, row in zip(agreeing, draws) for member in range(group)]
            fresh = self.sample(fabric, model, dataset, draws, seeds)
            for k, (g, row) in enumerate(zip(agreeing, draws)):
                rows[g] = row
                completions[g * group:(g + 1) * group] = fresh[k * group:(k + 1) * group]
            scored = self.score(dataset, rows, completions)
        return scored

    def score(self, dataset, rows: list[int], completions: list[list[int]]):
        """(each reward's scores, the weighted totals, the advantages, whether each group's totals all agree)."""
        group = self.args.num_generations
        texts = [dataset.tokenizer.decode(torch.tensor(c), skip_special_tokens=True) for c in completions]
        prompts = [dataset.rows[row]["prompt"] for row in rows for _ in range(group)]
        chat = [not isinstance(p, str) for p in prompts]
        shown = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        fields = {name: [v for v in column for _ in range(group)]
                  for name, column in dataset.fields(rows).items()}
        scores = self.rewards.score(prompts, shown, fields)
        rewards = self.rewards.total(scores)
        advantages, agree = group_advantages(rewards, group, scales_advantages(self.args.loss))
        return scores, rewards, advantages, agree

    def logged(self, scores: torch.Tensor, rewards: torch.Tensor, agree: torch.Tensor, completions: list[list[int]],
               generation_seconds: float, device) -> dict[str, torch.Tensor]:
        """What the log shows of the generation, as batch entries "log/<name>" the loss hands on."""
        generated = sum(len(c) for c in completions)
        seconds, tokens = self.training_time
        values = {
            "reward": rewards.mean(), "reward_std": rewards.view(-1, self.args.num_generations).std(1).mean(),
            **{f"rewards/{name}": scores[:, i].mean() for i, name in enumerate(self.rewards.names)},
            **{f"rewards/{name}_std": scores[:, i].std() for i, name in enumerate(self.rewards.names)},
            "zero_std_fraction": agree.double().mean(), "completion_length": torch.tensor(generated / len(completions)),
            "generation_tokens_per_sec": torch.tensor(generated / max(generation_seconds, 1e-9)),
            "training_tokens_per_sec": torch.tensor(tokens / seconds if seconds else 0.0),
        }
        return {f"log/{name}": value.float().to(device) for name, value in values.items()}

    def add_log_probabilities(self, fabric, model: nn.Module, batches: list[Batch], per_step: int) -> None:
        """The sampling policy's log-probabilities (a generation serving several steps), the reference's (beta > 0),
        and dapo's token count per micro-batch (each step's completion tokens over all ranks, shared evenly)."""
        from litgpt.lora import adapters_disabled

        args = self.args
        several = model.training and args.steps_per_generation > 1
        with torch.no_grad(), evaluating(model), fabric.autocast():
            for batch in batches:
                device_batch = {name: fabric.to_device(batch[name]) for name in ("input_ids", "labels")}
                if several:
                    batch["old_logps"] = self.logps(model, device_batch).cpu()
                if self.kind == "adapters off":
                    with adapters_disabled(model):
                        batch["ref_logps"] = self.logps(model, device_batch).cpu()
                elif self.kind == "frozen copy":
                    batch["ref_logps"] = self.logps(self.reference, device_batch).cpu()
        if args.loss == "dapo":
            for start in range(0, len(batches), per_step):
                step = batches[start:start + per_step]
                tokens = sum(((b["labels"] != IGNORE_INDEX) & b["kept"].unsqueeze(1)).sum() for b in step)
                tokens = tokens.double().to(fabric.device)
                total = fabric.all_reduce(tokens, reduce_op="sum") if fabric.world_size > 1 else tokens
                for batch in step:
                    batch["token_normalizer"] = (total / (len(step) * fabric.world_size)).float()

    def logps(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return completion_logps(model, batch, self.chunk_size, self.chunked).float()


def shifted(prompt: list[int], completion: list[int]) -> dict[str, torch.Tensor]:
    """A prompt + completion sequence as inputs and next-token labels, only the completion's tokens labelled."""
    tokens = torch.tensor(prompt + completion, dtype=torch.long)
    labels = tokens[1:].clone()
    labels[: len(prompt) - 1] = IGNORE_INDEX
    return {"input_ids": tokens[:-1], "labels": labels}

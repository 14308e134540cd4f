"""What the trainer optimizes and measures, as a recipe defines it: the loss of a batch and its logged parts.

The trainer knows batches only as dicts of tensors and losses only as `Losses` ("loss", what the backward pass runs
on, and the parts it is made of for the logs); a recipe builds its `Objective` from whatever models and settings its
kind of training needs (a teacher, a reference model, a reward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from litgpt.data.base import IGNORE_INDEX

Batch = dict[str, torch.Tensor]
Losses = dict[str, torch.Tensor]
BatchLoss = Callable[[nn.Module, Batch], Losses]
# (fabric, model, the data's micro-batches as (epoch, index, batch), their dataset, micro-batches per optimizer step)
# -> the micro-batches the loss runs on, as (epoch, index, batch) with the data's epoch and index.
MakeBatches = Callable[[Any, nn.Module, Iterator, Any, int], Iterator]


@dataclass(frozen=True)
class Objective:
    """A recipe's objective.

    Args:
        train_loss: the loss of one training micro-batch: "loss" is backpropagated, the other entries are logged
            beside it (means over the steps of a log window).
        validation_loss: the loss of one validation micro-batch: "loss" is the validation loss (logged as val_loss),
            the other entries are logged as val_<name>.
        compiles_train_loss: whether `train_loss` is compiled (the trainer says what the first step paid for it).
        make_batches: what turns the data's micro-batches into those the losses run on, for training and validation
            alike (None: the data's own); online training makes them from the model as it is, e.g. GRPO's sampled
            and scored completions of the data's prompts. It is called with the model in the mode of the loss that
            follows (train or eval).
    """

    train_loss: BatchLoss
    validation_loss: BatchLoss
    compiles_train_loss: bool = False
    make_batches: Optional[MakeBatches] = None

    def batches(self, fabric, model: nn.Module, batches: Iterator, dataset, per_step: int) -> Iterator:
        """The micro-batches the losses run on, made from the data's `batches` (see `make_batches`)."""
        if self.make_batches is None:
            return batches
        return self.make_batches(fabric, model, batches, dataset, per_step)

    def over_positions(self, context) -> "Objective":
        """This objective under context parallelism (`litgpt.distributed.context_parallel.ContextParallel`): each
        loss runs on this rank's slice of the batch's positions and reports its group's loss."""
        return replace(self, train_loss=on_local_positions(self.train_loss, context),
                       validation_loss=on_local_positions(self.validation_loss, context))

    def with_compiled_chunk_losses(self) -> "Objective":
        """This objective with the output head's loss compiled chunk by chunk (`compiled_chunk_losses`), for runs that
        compile the blocks and leave the head and loss to run eager around them."""
        from litgpt.train.loss import compiled_chunk_losses

        def within(loss: BatchLoss) -> BatchLoss:
            def loss_with_compiled_chunks(model: nn.Module, batch: Batch) -> Losses:
                with compiled_chunk_losses():
                    return loss(model, batch)

            return loss_with_compiled_chunks

        return replace(self, train_loss=within(self.train_loss), validation_loss=within(self.validation_loss))

    def compiled(self) -> "Objective":
        """This objective with `torch.compile` of its training loss (forward, head and loss in one graph)."""
        return replace(self, train_loss=torch.compile(self.train_loss), compiles_train_loss=True)

    @staticmethod
    def tokens(batch: Batch) -> int:
        """The tokens a micro-batch trains on (per rank)."""
        return batch["input_ids"].numel()

    @staticmethod
    def labelled_tokens(batch: Batch) -> torch.Tensor:
        """The positions of a micro-batch that have a label (a tensor: counted on the device, without a sync)."""
        return (batch["labels"] != IGNORE_INDEX).sum()


def on_local_positions(loss: BatchLoss, context) -> BatchLoss:
    """`loss` of this rank's slice of a batch's input_ids, labels and positions (`context.local_batch`), its means
    taken over the group's labelled positions (`context.group_losses`)."""

    def of_local_positions(model: nn.Module, batch: Batch) -> Losses:
        input_ids, labels, positions = context.local_batch(batch["input_ids"], batch["labels"], batch.get("positions"))
        local = {**batch, "input_ids": input_ids, "labels": labels, "positions": positions}
        return context.group_losses(loss(model, local), labels)

    return of_local_positions

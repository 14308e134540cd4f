"""Knowledge distillation as a recipe: the student trains as pretraining's or finetuning's model does, against a
frozen teacher that the recipe holds beside it (never trained nor saved) and a loss that compares the two."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from torch import nn

from litgpt.args import KDArgs
from litgpt.config import Config
from litgpt.precision import Precision
from litgpt.train.loss import distillation_loss_function
from litgpt.train.objective import Objective
from litgpt.train.recipe import Recipe, batch_loss, validation_parts


@dataclass(frozen=True)
class TeacherSettings:
    """The frozen teacher a student is distilled from (`litgpt distill`).

    Args:
        config: the teacher's config.
        weights: its lit_model.pth, read again by every run and every resume: nothing of the teacher is saved.
        kd: the distillation loss (`litgpt.train.loss.distillation_loss`).
    """

    config: Config
    weights: Path
    kd: KDArgs


@dataclass(frozen=True)
class DistillRecipe(Recipe):
    """A student distilled from `teacher`: the loss is the KD loss against it (kd.alpha x KD + (1 - kd.alpha) x
    cross-entropy); validation reports the student's cross-entropy as the validation loss and the KD term as
    val_kd_loss."""

    teacher: Optional[TeacherSettings] = None

    def __post_init__(self) -> None:
        if self.teacher is None:
            raise ValueError("DistillRecipe needs a teacher")

    def frozen_configs(self) -> dict[str, Config]:
        return {"teacher": self.teacher.config}

    def plan_summary(self, frozen_params: str) -> str:
        return f"distilled from a frozen {frozen_params}-parameter teacher"

    def materialize_frozen(self, fabric, precision: Precision, compile_blocks: bool) -> dict[str, nn.Module]:
        """The teacher on the devices, sharded like the student (`Recipe.frozen_model`)."""
        teacher = self.frozen_model(fabric, self.teacher.config, Path(self.teacher.weights), precision,
                                    compile_blocks, subject="The teacher's weights")
        return {"teacher": teacher}

    def objective(self, frozen: dict[str, nn.Module], chunk_size: Optional[int] = None,
                  chunked: bool = True) -> Objective:
        """The KD loss against `frozen["teacher"]`, for training and validation alike (its logged parts: kd_loss,
        ce_loss, and a router's aux_loss)."""
        loss = batch_loss(distillation_loss_function(frozen["teacher"], self.teacher.kd, chunk_size, chunked))
        return Objective(train_loss=loss, validation_loss=validation_parts(loss, logged=("kd_loss",)))

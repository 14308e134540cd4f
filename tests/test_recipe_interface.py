"""A new kind of training is a new recipe, not a change to the trainer: a recipe defined only here (another loss with
parts of its own, and a frozen reference model beside the trained one, as preference optimization has) trains, logs
its parts and resumes bit-exact through the real job, trainer and checkpoint manager."""

from __future__ import annotations

import csv
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import write_random_checkpoint
from data_helpers import write_story_files
from torch import nn

from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import TextFiles
from litgpt.data.base import IGNORE_INDEX
from litgpt.data.tiny import TOKENIZER_DIR
from litgpt.io import load_state_dict
from litgpt.precision import Precision
from litgpt.train.objective import Objective
from litgpt.train.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(name="anchored", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=2, n_embd=32,
             n_head=4, n_query_groups=2, intermediate_size=64)
ANCHOR_WEIGHT = 0.5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class AnchoredRecipe(Recipe):
    """Finetuning held near a frozen copy of the starting model: cross-entropy + ANCHOR_WEIGHT x the mean squared
    difference of the two models' logits. Nothing of it is known to litgpt."""

    reference_weights: Optional[Path] = None

    def frozen_configs(self) -> dict[str, Config]:
        return {"reference": self.config}

    def materialize_frozen(self, fabric, precision: Precision, compile_blocks: bool) -> dict[str, nn.Module]:
        reference = self.frozen_model(fabric, self.config, self.reference_weights, precision, compile_blocks,
                                      subject="The reference's weights")
        return {"reference": reference}

    def objective(self, frozen: dict[str, nn.Module], chunk_size=None, chunked=True) -> Objective:
        reference = frozen["reference"]

        def train_loss(model, batch):
            logits = model(batch["input_ids"])
            with torch.no_grad():
                reference_logits = reference(batch["input_ids"])
            labels = batch["labels"]
            ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
            anchor = (logits.float() - reference_logits.float()).pow(2).mean()
            return {"loss": ce + ANCHOR_WEIGHT * anchor, "ce_loss": ce.detach(), "anchor_loss": anchor.detach()}

        def validation_loss(model, batch):
            parts = train_loss(model, batch)
            return {"loss": parts["ce_loss"], "anchor_loss": parts["anchor_loss"]}

        return Objective(train_loss=train_loss, validation_loss=validation_loss)


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    return write_story_files(tmp_path_factory.mktemp("stories"), 60)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("base"), Config(**SMALL), seed=5)


def run(out_dir: Path, text_folder: Path, base: Path, resume=False) -> None:
    from litgpt.distributed.fabric import build_fabric
    from litgpt.loggers import build_logger
    from litgpt.train.job import Job, launch

    weights = base / "lit_model.pth"
    recipe = AnchoredRecipe(name="anchored", config=Config(**SMALL), initialization="checkpoint",
                            initial_weights=weights, reference_weights=weights)
    train = TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=6, save_interval=3, log_interval=1,
                      lr_warmup_steps=1, max_seq_length=32, min_lr=1e-4)
    job = Job(recipe=recipe, out_dir=out_dir, data=TextFiles(text_folder, cache_dir=out_dir.parent / "cache"),
              tokenizer_dir=TOKENIZER_DIR, train=train, eval=EvalArgs(interval=3, max_iters=2),
              hyperparameters={"recipe": "anchored"}, precision=Precision("32-true"), resume=resume, seed=3,
              optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-2}})
    precision = job.precision
    launch(build_fabric(1, 1, precision, loggers=[build_logger("csv", out_dir, "anchored")]), job)


def logged_rows(out_dir: Path) -> list[dict]:
    (path,) = (out_dir / "logs").rglob("metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def test_a_recipe_defined_outside_litgpt_trains_logs_its_parts_and_resumes_bit_exact(tmp_path, text_folder, base):
    run(tmp_path / "whole", text_folder, base)
    rows = [row for row in logged_rows(tmp_path / "whole") if row.get("anchor_loss")]
    assert len(rows) == 6
    # Step 1 starts from the reference's own weights: the anchor term is exactly 0 and the loss its cross-entropy.
    assert float(rows[0]["anchor_loss"]) == 0.0
    assert float(rows[0]["loss"]) == pytest.approx(float(rows[0]["ce_loss"]), rel=1e-6)
    # Later steps have moved away from the reference, and the loss is the recipe's sum of its parts.
    for row in rows[1:]:
        assert float(row["anchor_loss"]) > 0
        expected = float(row["ce_loss"]) + ANCHOR_WEIGHT * float(row["anchor_loss"])
        assert float(row["loss"]) == pytest.approx(expected, rel=1e-5)
    metrics = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert metrics["anchor_loss"] > 0 and metrics["val_anchor_loss"] > 0
    validation = [row for row in logged_rows(tmp_path / "whole") if row.get("val_anchor_loss")]
    assert len(validation) == 2  # steps 3 and 6

    # The reference is the objective's alone: never trained, never saved.
    saved = load_state_dict(tmp_path / "whole" / "step-000003" / "lit_model.pth")
    assert saved.keys() == load_state_dict(base / "lit_model.pth").keys()

    run(tmp_path / "stopped", text_folder, base)
    for folder in (tmp_path / "stopped").iterdir():
        if folder.name in ("final", "step-000006"):
            shutil.rmtree(folder)
    (tmp_path / "stopped" / "metrics.json").unlink()
    run(tmp_path / "stopped", text_folder, base, resume="auto")
    whole = load_state_dict(tmp_path / "whole" / "final" / "lit_model.pth")
    resumed = load_state_dict(tmp_path / "stopped" / "final" / "lit_model.pth")
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key
    states = [torch.load(out / "step-000006" / "training_state.pth", weights_only=True)["train_state"]
              for out in (tmp_path / "whole", tmp_path / "stopped")]
    assert {k: v for k, v in states[0].items() if k != "train_seconds"} == \
        {k: v for k, v in states[1].items() if k != "train_seconds"}


def test_the_trainer_names_no_kind_of_training():
    """The loop is blind to kinds of training: no teacher, KD, distillation, LoRA or quantization in trainer.py, and
    it reads neither the recipe nor the job."""
    source = (ROOT / "litgpt" / "train" / "trainer.py").read_text()
    named = re.findall(r"teacher|\bkd|distill|lora|quantiz|nf4", source, flags=re.IGNORECASE)
    assert named == []
    assert "litgpt.train.recipe" not in source and "litgpt.train.job" not in source

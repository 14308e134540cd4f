"""Preference optimization as a recipe: the policy trains as finetune_lora's or finetune_full's model does, on
pairs of answers, with the loss of `litgpt.train.preference_loss` and a reference that costs as little as it can.

The reference (for the losses that have one) is, in this order of preference:
- precomputed: with `--dpo.precompute_reference`, its log-probabilities of every pair, computed once before training
  (`prepare_samples`), kept in out_dir and read again on resume; the samples carry them and no model runs for them;
- the policy itself with its LoRA adapters switched off (`litgpt.lora.adapters_disabled`): no second copy;
- a frozen copy of the initial weights, sharded like the policy (`Recipe.frozen_model`), for full finetuning.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from litgpt.args import DPOArgs
from litgpt.config import Config
from litgpt.distributed.runtime import print_once
from litgpt.errors import UserError
from litgpt.precision import Precision
from litgpt.train.objective import Batch, Objective
from litgpt.train.recipe import Recipe

REFERENCE_FILE = "reference_logps.pt"


@dataclass(frozen=True)
class PairObjective(Objective):
    """An objective over preference pairs: a sample holds two sequences (chosen and rejected), both trained on."""

    @staticmethod
    def tokens(batch: Batch) -> int:
        rejected = batch.get("rejected_input_ids")
        return batch["input_ids"].numel() + (0 if rejected is None else rejected.numel())


@dataclass(frozen=True)
class PreferenceSettings:
    """What `litgpt dpo` adds to a finetuning recipe.

    Args:
        args: the loss and its options (--dpo.*).
        reference_store: where precomputed reference log-probabilities are kept (out_dir/reference_logps.pt).
    """

    args: DPOArgs
    reference_store: Optional[Path] = None


@dataclass(frozen=True)
class DPORecipe(Recipe):
    preference: Optional[PreferenceSettings] = None

    def __post_init__(self) -> None:
        if self.preference is None:
            raise ValueError("DPORecipe needs its PreferenceSettings")

    @property
    def reference(self) -> str:
        """How the reference is had: "none" (a reference-free loss), "precomputed", "adapters off" or "frozen copy"."""
        args = self.preference.args
        if not args.uses_reference:
            return "none"
        if args.precompute_reference:
            return "precomputed"
        return "adapters off" if self.lora is not None else "frozen copy"

    sequences_per_sample = 2
    frozen_outputs_reach_the_loss = False

    def frozen_configs(self) -> dict[str, Config]:
        return {"reference": self.config} if self.reference == "frozen copy" else {}

    def plan_summary(self, frozen_params: str) -> str:
        reference = {"none": "no reference", "precomputed": "the reference's log-probabilities precomputed",
                     "adapters off": "the reference: the base with the adapters off",
                     "frozen copy": f"a frozen {frozen_params}-parameter reference"}[self.reference]
        return f"preference optimization ({self.preference.args.loss}), {reference}"

    def materialize_frozen(self, fabric, precision: Precision, compile_blocks: bool) -> dict[str, nn.Module]:
        """Full finetuning's frozen reference, sharded like the policy; also while precomputing, when the run has no
        stored log-probabilities yet (freed once they are computed)."""
        needs_copy = self.lora is None and (self.reference == "frozen copy" or (
            self.reference == "precomputed" and not Path(self.preference.reference_store).is_file()))
        if not needs_copy:
            return {}
        reference = self.frozen_model(fabric, self.config, Path(self.initial_weights), precision, compile_blocks,
                                      subject="The reference model's weights")
        return {"reference": reference}

    def objective(self, frozen: dict[str, nn.Module], chunk_size: Optional[int] = None,
                  chunked: bool = True) -> Objective:
        """The preference loss, for training and validation alike (validation logs its parts as val_<name>)."""
        from litgpt.train.preference_loss import preference_loss

        args = self.preference.args

        def loss(model: nn.Module, batch: Batch):
            reference = self.reference_logps(model, frozen, batch, chunk_size, chunked)
            return preference_loss(model, batch, args, reference, chunk_size, chunked)

        return PairObjective(train_loss=loss, validation_loss=loss)

    def reference_logps(self, model: nn.Module, frozen: dict[str, nn.Module], batch: Batch,
                        chunk_size: Optional[int], chunked: bool) -> Optional[torch.Tensor]:
        """The reference's summed log-probabilities of the batch's sequences: carried by the batch, or computed by
        the frozen copy or the policy without its adapters; None for a reference-free loss."""
        from litgpt.lora import adapters_disabled
        from litgpt.train.preference_loss import sequence_logps

        if self.reference == "none":
            return None
        if "reference_logps" in batch:
            return batch["reference_logps"]
        with torch.no_grad():
            if "reference" in frozen:
                return sequence_logps(frozen["reference"], batch["input_ids"], batch["labels"], chunk_size, chunked)
            with adapters_disabled(model):
                return sequence_logps(model, batch["input_ids"], batch["labels"], chunk_size, chunked)

    def prepare_samples(self, fabric, model: nn.Module, frozen: dict[str, nn.Module], train_data, val_data,
                        micro_batch_size: int):
        """With --dpo.precompute_reference: the samples with the reference's log-probabilities (read from the run's
        store, or computed now and stored), and no frozen model left to hold."""
        if self.reference != "precomputed":
            return frozen, train_data, val_data
        from litgpt.data.preference import WithReferenceLogps

        store = Path(self.preference.reference_store)
        fingerprint = data_fingerprint(train_data, val_data)
        stored = read_reference_store(store, fingerprint)
        if stored is None and self.lora is None and "reference" not in frozen:
            # Full finetuning holds no reference once a store exists, and a resumed policy is not the reference.
            raise UserError(f"{store} holds the reference of other pairs (the data or --train.max_seq_length "
                            "changed since it was computed): delete it to compute it again from the checkpoint's "
                            "weights, or continue with the data it was computed for.")
        if stored is None:
            if store.is_file():
                print_once(f"{store} holds the reference of other pairs (the data changed): computing it again.")
            print_once(f"Computing the reference's log-probabilities of {len(train_data) + len(val_data):,} pairs "
                       "once, before training (--dpo.precompute_reference)")
            stored = {
                split: self.compute_reference(fabric, model, frozen, dataset, micro_batch_size)
                for split, dataset in (("train", train_data), ("val", val_data))
            }
            if fabric.global_rank == 0:
                write_reference_store(store, {**stored, "fingerprint": fingerprint})
            fabric.barrier()
        else:
            print_once(f"Read the reference's log-probabilities from {store}")
        return {}, WithReferenceLogps(train_data, stored["train"]), WithReferenceLogps(val_data, stored["val"])

    @torch.no_grad()
    def compute_reference(self, fabric, model: nn.Module, frozen: dict[str, nn.Module], dataset,
                          micro_batch_size: int) -> torch.Tensor:
        """(len(dataset), 2) reference log-probabilities (chosen, rejected), each rank computing every world-size-th
        pair (the last one repeated so that all ranks run as many forwards, which a sharded model needs)."""
        world, rank = fabric.world_size, fabric.global_rank
        per_rank = -(-len(dataset) // world)
        mine = [min(rank + step * world, len(dataset) - 1) for step in range(per_rank)]
        values = []
        was_training = model.training
        model.eval()
        for start in range(0, per_rank, micro_batch_size):
            samples = [dataset[i] for i in mine[start:start + micro_batch_size]]
            batch = {name: fabric.to_device(value) for name, value in dataset.collate(samples).items()}
            with fabric.autocast():
                logps = self.reference_logps(model, frozen, batch, None, True).float()
            values.append(torch.stack(logps.chunk(2), dim=1))
        model.train(was_training)
        gathered = fabric.all_gather(torch.cat(values))  # (world, per_rank, 2), or (per_rank, 2) in one process
        gathered = gathered.view(world, per_rank, 2).transpose(0, 1).reshape(world * per_rank, 2)
        return gathered[: len(dataset)].cpu()


def data_fingerprint(*datasets) -> str:
    """A digest of every sample's tokens: stored log-probabilities are reused only for the very same pairs."""
    digest = hashlib.sha256()
    for dataset in datasets:
        digest.update(len(dataset).to_bytes(8, "little"))
        for index in range(len(dataset)):
            sample = dataset[index]
            for name in ("input_ids", "labels", "rejected_input_ids", "rejected_labels"):
                digest.update(sample[name].numpy().tobytes())
    return digest.hexdigest()


def read_reference_store(path: Path, fingerprint: str) -> Optional[dict[str, torch.Tensor]]:
    """The stored log-probabilities where they belong to these pairs, else None."""
    if not path.is_file():
        return None
    from litgpt.io import load_state_dict

    stored = load_state_dict(path)
    if not isinstance(stored, dict) or stored.get("fingerprint") != fingerprint:
        return None
    return stored


def write_reference_store(path: Path, values: dict) -> None:
    """Written whole under a temporary name, then renamed: a kill never leaves half a store."""
    from litgpt.io import save_state_dict

    save_state_dict(values, path)

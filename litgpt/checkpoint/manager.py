"""The one component that owns a run's checkpoints: find the one to resume, restore it, save, publish, prune.

A save writes out_dir/step-XXXXXX/ under a temporary name and renames it into place when complete, with
manifest.json (every file's size and SHA-256) written last; `--resume auto` takes the newest folder whose manifest
verifies. The strategy's `CheckpointIO` moves the tensors (full: gathered on rank 0; sharded: every rank its shards);
everything else is the same for every strategy.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from litgpt.args import TrainArgs
from litgpt.checkpoint.interface import CheckpointIO, KeySelector
from litgpt.checkpoint.model_files import copy_tokenizer_files
from litgpt.checkpoint.store import (
    FINAL_DIR,
    MANIFEST_FILE,
    SHARDED_DIR,
    TRAINING_STATE_FILE,
    check_free_space,
    consolidated_weights,
    format_bytes,
    free_bytes,
    prune_checkpoints,
    publish_dir,
    read_manifest,
    resolve_resume,
    staging_dir,
    step_checkpoints,
    step_dir,
    write_manifest,
)
from litgpt.config import Config
from litgpt.distributed.runtime import every_rank, print_once, rank_zero_alone
from litgpt.errors import UserError
from litgpt.failpoints import failpoint
from litgpt.io import file_sha256, load_state_dict, save_state_dict, write_yaml
from litgpt.precision import Precision

# torch.save reports a failed write as a RuntimeError from its zip writer, not as an OSError with an errno.
# The errors of a write that more room would fix: no space, no quota left, a file past `ulimit -f`.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside Fabric's wrapper."""
    return getattr(model, "module", model)


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Fabric's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def failed_write(error: BaseException) -> "OSError | None":
    """The OSError behind a failed save: `error` itself, its cause, or one rank's failure gathered by
    torch.distributed.checkpoint; None when the save failed for another reason."""
    failures = getattr(error, "failures", None) or {}  # DCP's: rank -> (exception, traceback)
    causes = [error, error.__cause__, error.__context__,
              *(failure[0] if isinstance(failure, tuple) else failure for failure in failures.values())]
    # A lost connection is an OSError too, but another rank's failure, not a write's.
    return next((cause for cause in causes
                 if isinstance(cause, OSError) and not isinstance(cause, (ConnectionError, TimeoutError))), None)


class CheckpointManager:
    """Save, publish, verify, prune, find and restore the checkpoints of one run (every rank holds one).

    Args:
        fabric: the run's Fabric (ranks, barriers).
        out_dir: the run's folder (step-XXXXXX/, final/).
        io: how the strategy's model and optimizer go to and from files.
        keys: which weights a checkpoint holds (every key, or the adapters').
        weights_file: the name of the weights file (lit_model.pth, or the adapters' file).
        config, hyperparameters, tokenizer_dir: written beside the weights of every checkpoint.
        keep_last: keep only this many newest complete checkpoints (None: all).
        precision: recorded in the manifest.
        base_checkpoint: a LoRA run's base folder, recorded in each checkpoint (`litgpt.merge_lora.write_base_record`).

    It is the one place that names a run's folders (`step_dir`, `final_dir`) and finds the one to resume
    (`find_resume`, before the run's model exists).
    """

    def __init__(self, fabric, out_dir: Path, io: CheckpointIO, *, keys: KeySelector, weights_file: str,
                 config: Config, hyperparameters: dict, tokenizer_dir: Optional[Path], keep_last: Optional[int],
                 precision: Precision, base_checkpoint: Optional[Path] = None) -> None:
        self.fabric = fabric
        self.out_dir = Path(out_dir)
        self.io = io
        self.keys = keys
        self.weights_file = weights_file
        self.config = config
        self.hyperparameters = hyperparameters
        self.tokenizer_dir = tokenizer_dir
        self.keep_last = keep_last
        self.precision = precision
        self.base_checkpoint = base_checkpoint
        self.last_saved_step = -1

    # ---- the run's folders -----------------------------------------------------------------------------------------
    @staticmethod
    def find_resume(out_dir: Path, resume: Any) -> Optional[Path]:
        """The folder `--resume` names in `out_dir` (auto: the newest that verifies), or None to start fresh;
        refuses to train over an existing run (collective). Called before the run's model is built."""
        return resolve_resume(Path(out_dir), resume)

    def step_dir(self, step: int) -> Path:
        """The checkpoint folder of optimizer step `step`."""
        return step_dir(self.out_dir, step)

    @property
    def final_dir(self) -> Path:
        return self.out_dir / FINAL_DIR

    def saved(self) -> list[Path]:
        """The run's step folders on disk, oldest first (complete or not)."""
        return step_checkpoints(self.out_dir)

    def restore(self, folder: Path, model, optimizer, state) -> None:
        """Load a checkpoint folder's weights, optimizer state, loop position and RNG into the run.

        A sharded checkpoint reshards to this run's world size; a full one is read memory-mapped, each rank taking
        its part.
        """
        model, optimizer, folder = unwrap(model), unwrap_optimizer(optimizer), Path(folder)
        saved = load_state_dict(folder / TRAINING_STATE_FILE)
        if (folder / SHARDED_DIR).is_dir():
            self.io.load_sharded(folder, model, optimizer, self.keys)
        else:
            path = folder / self.weights_file
            self.io.copy_weights(model, load_state_dict(path), str(path), self.keys)
            try:
                self.io.load_optimizer_state(model, optimizer, saved["optimizer"])
            except Exception as error:  # a foreign file or another model's optimizer
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise UserError(
                    f"Cannot resume the optimizer from {str(folder / TRAINING_STATE_FILE)!r}: {reason}") from None
        for key, value in saved["train_state"].items():
            setattr(state, key, value)
        torch.set_rng_state(saved["rng"])
        if folder.resolve().parent == self.out_dir.resolve():
            self.last_saved_step = state.step  # a checkpoint of this run needs no second save at the same step

    # ---- save ------------------------------------------------------------------------------------------------------
    def info(self, state) -> dict:
        """What a checkpoint's manifest records besides its files."""
        return {
            "step": state.step,
            "epoch": state.epoch,
            "tokens": state.tokens,
            "world_size": self.fabric.world_size,
            "num_nodes": getattr(self.fabric.strategy, "num_nodes", 1),
            "sharding_strategy": self.io.sharding_strategy,
            "state_dict_type": self.io.state_dict_type,
            "precision": self.precision.name,
            "weights_file": self.weights_file,
        }

    def save(self, model, optimizer, state) -> Path:
        """Write out_dir/step-XXXXXX/ for the state's step (every rank calls this); returns the folder.

        Full: rank 0 gathers the weights and optimizer state and writes them. Sharded: every rank writes its shards
        into <folder>/sharded/ in parallel; nobody holds the whole model. The manifest is written last; then
        --train.keep_last prunes older checkpoints.
        """
        fabric, rank_zero = self.fabric, self.fabric.global_rank == 0
        model, optimizer = unwrap(model), unwrap_optimizer(optimizer)
        path = self.step_dir(state.step)
        staging = staging_dir(path)
        failpoint("save:begin")
        if rank_zero:
            needed = checkpoint_bytes(model, self.keys, optimizer)
            check_free_space(self.out_dir, needed, f"checkpoint {path.name}")
            shutil.rmtree(staging, ignore_errors=True)  # left by a run that died while saving
            staging.mkdir(parents=True)
        weights = optimizer_state = digests = None
        with self.disk_errors_named(path.name, model, optimizer):
            if self.io.state_dict_type == "sharded":
                fabric.barrier()
                self.io.save_sharded(staging, model, optimizer, self.keys)
                failpoint("save:sharded")
                digests = own_shard_digests(staging, fabric.global_rank)
            else:
                weights = self.io.gather_weights(model, self.keys)
                optimizer_state = self.io.gather_optimizer_state(model, optimizer)
        # Writing and hashing a large model's full checkpoint takes what it takes: not bounded by --fsdp.timeout.
        with rank_zero_alone(f"writing checkpoint {path.name}") as worker:
            if worker:
                with self.disk_errors_named(path.name, model, optimizer):
                    with publish_dir(path, staging) as folder:
                        self._write_folder(folder, weights, optimizer_state, state, digests)
                    failpoint("save:published")
                    if self.keep_last is not None:
                        prune_checkpoints(self.out_dir, self.keep_last)
                        failpoint("save:pruned")
        self.last_saved_step = state.step
        return path

    def _write_folder(self, folder: Path, weights: Optional[dict], optimizer_state: Optional[dict], state,
                      digests: Optional[dict]) -> None:
        if weights is not None:
            save_state_dict(weights, folder / self.weights_file)
            failpoint("save:weights")
        self.config.save(folder / "model_config.yaml")
        write_yaml(folder / "hyperparameters.yaml", self.hyperparameters)
        if self.base_checkpoint is not None:
            from litgpt.merge_lora import write_base_record

            write_base_record(folder, self.hyperparameters.get("checkpoint_dir", ""), self.base_checkpoint)
        if self.tokenizer_dir is not None:
            copy_tokenizer_files(self.tokenizer_dir, folder)
        training_state = {
            "optimizer": optimizer_state,  # in sharded/ for a sharded checkpoint
            "train_state": asdict(state),
            "rng": torch.get_rng_state(),
            "weights_file": self.weights_file,
            "state_dict_type": self.io.state_dict_type,
        }
        save_state_dict(training_state, folder / TRAINING_STATE_FILE)
        failpoint("save:state")
        write_manifest(folder, self.info(state), digests)
        failpoint("save:manifest")

    @contextmanager
    def disk_errors_named(self, name: str, model, optimizer) -> Iterator[None]:
        """Turn a failed write during a save (disk full, quota, file-size limit, read-only) into one message; the
        staging folder is gone by then and the previous checkpoints are untouched."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            yield
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException; what is no write goes on
            written = failed_write(error)
            if written is None:
                raise
            where = f"Could not write checkpoint {name} in {str(self.out_dir)!r}: {written.strerror or written}"
            if written.errno not in DISK_FULL:
                raise UserError(f"{where}. The earlier checkpoints are as they were: fix this and continue with "
                                "--resume auto.") from None
            raise UserError(
                f"{where}. It needs about {format_bytes(checkpoint_bytes(model, self.keys, optimizer))}; "
                f"{format_bytes(free_bytes(self.out_dir))} are free now (check also quotas and `ulimit -f`). The "
                "earlier checkpoints are as they were: make room and continue with --resume auto."
            ) from None

    # ---- publish ---------------------------------------------------------------------------------------------------
    def publish_final(self, state) -> Path:
        """out_dir/final: the last step's weights and files without the training state, ready for `litgpt generate`.

        Files are hard-linked rather than written twice; a sharded checkpoint's weights are consolidated into one
        file. Every rank calls this.
        """
        last_step, final = self.step_dir(state.step), self.final_dir
        with rank_zero_alone("publishing final/") as worker:  # consolidating a sharded checkpoint takes its time
            if worker:
                self._write_final(last_step, final, state)
        return final

    def _write_final(self, last_step: Path, final: Path, state) -> None:
        with publish_dir(final) as folder:
            for file in last_step.iterdir():
                if file.name not in (TRAINING_STATE_FILE, SHARDED_DIR, MANIFEST_FILE):
                    try:
                        os.link(file, folder / file.name)
                    except OSError:  # a filesystem without hard links
                        shutil.copy2(file, folder / file.name)
            if (last_step / SHARDED_DIR).is_dir():
                save_state_dict(consolidated_weights(last_step), folder / self.weights_file)
            # The linked files were hashed for the step's manifest already: only a consolidated file is new.
            step_digests = {name: entry["sha256"] for name, entry in read_manifest(last_step)["files"].items()}
            write_manifest(folder, {**self.info(state), "state_dict_type": "full"}, step_digests)
            failpoint("final:written")


def checkpoint_bytes(model: torch.nn.Module, keys: KeySelector, optimizer=None) -> int:
    """About how many bytes one checkpoint takes: the selected weights at their dtype, plus the optimizer state
    (before the first step, when it does not exist yet, AdamW's two float32 moments per trainable weight)."""
    weights = sum(v.numel() * v.element_size() for k, v in model.state_dict().items() if keys(k))
    states = [t for state in (optimizer.state.values() if optimizer is not None else ()) for t in state.values()]
    if states:
        optimizer_bytes = sum(t.numel() * t.element_size() for t in states if isinstance(t, torch.Tensor))
    else:
        optimizer_bytes = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    return weights + optimizer_bytes


def check_disk_space(out_dir: Path, model: torch.nn.Module, keys: KeySelector, train: TrainArgs) -> None:
    """Before any weight is allocated: is there room for one checkpoint? Warn when all of them would not fit."""
    size = checkpoint_bytes(model, keys)
    check_free_space(out_dir, size, "one checkpoint of this model")
    if train.keep_last is None and train.save_interval is not None and train.max_steps is not None:
        count = train.max_steps // train.save_interval + 1
        if size * count > free_bytes(out_dir):
            print_once(
                f"Warning: {count} checkpoints of {format_bytes(size)} will not fit in the "
                f"{format_bytes(free_bytes(out_dir))} free: pass --train.keep_last N to keep only the newest."
            )


def own_shard_digests(staging: Path, rank: int) -> dict:
    """The SHA-256 of the shard files, each rank hashing those it wrote, in parallel (collective)."""
    mine = {f"{SHARDED_DIR}/{f.name}": file_sha256(f) for f in (staging / SHARDED_DIR).glob(f"__{rank}_*")}
    return {name: digest for digests in every_rank(mine) for name, digest in digests.items()}

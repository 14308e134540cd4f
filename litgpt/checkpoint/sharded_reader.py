"""The one way litgpt reads a torch.distributed.checkpoint folder: nothing in it is unpickled beyond tensors and plain
containers.

torch's own reader unpickles `.metadata` with plain pickle and its default planner fully unpickles every non-tensor item
(the optimizer's `param_groups`, say): a folder whose files someone rewrote would run their code on every rank. Here `.metadata` is read once, by `litgpt.io.read_sharded_metadata`'s restricted
unpickler, and handed to the reader; bytes items are loaded weights-only; tensor items torch already loads weights-only.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from litgpt.errors import UserError
from litgpt.io import out_of_memory_error, unsafe_file_error


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that a bytes item is unpickled weights-only (torch's default runs any code)."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, map_location="cpu", weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class RestrictedFileSystemReader(FileSystemReader):
    """A `FileSystemReader` that takes the metadata already read safely instead of unpickling `.metadata` again, and
    names the file whose contents it refuses."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id  # as torch's reader does, for its logging
        return self.metadata

    def read_data(self, plan, planner) -> Future:
        # torch's read_data goes file by file anyway; one call per file lets a refusal name its file.
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except pickle.UnpicklingError as error:  # what weights-only loading raises for a forbidden object
                raise unsafe_file_error(Path(self.path) / relative_path, error) from None
        done: Future = Future()
        done.set_result(None)
        return done


def load_sharded_state(state: dict, path: Path, metadata: Metadata, hint: str, no_dist: bool = False) -> None:
    """Fill `state` in place from the sharded checkpoint in `path` whose `metadata` was read with
    `litgpt.io.read_sharded_metadata`; a failure to read it becomes one UserError (`hint` says what to check).

    What DCP does not gather into a CheckpointException (a collective that failed because another rank did) goes on
    as it is, to be reported as what it is.
    """
    reader = RestrictedFileSystemReader(path, metadata)
    try:
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), no_dist=no_dist)
    except CheckpointException as error:  # every rank's failure, gathered (a BaseException)
        cause = next(iter(error.failures.values()), (error, None))[0]  # (exception, traceback) per rank
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, MemoryError):
            raise out_of_memory_error(path) from None
        reason = " ".join(str(cause).split())[:300]
        raise UserError(f"Cannot load the sharded checkpoint {str(path)!r} into this model: {reason}. {hint}") from None

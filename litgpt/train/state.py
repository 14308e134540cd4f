"""Where a run is: the loop's position, saved with every checkpoint so that a resumed run continues exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainState:
    """Where the run is; saved with every checkpoint so a resumed run continues exactly."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    epoch_samples: int = 0  # samples of the current epoch consumed, all ranks together (any world size resumes)
    tokens: int = 0  # tokens trained on, all ranks together
    train_seconds: float = 0.0  # time spent in steps, over every session of the run
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient (--train.on_nonfinite skip)
    # Streamed data: every rank's loader position (litdata's state_dict), in rank order; None for map-style data,
    # whose order (seed, epoch, epoch_samples) already says where it is.
    data_positions: Optional[list] = None

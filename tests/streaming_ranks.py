"""One rank of a torchrun launch that streams a litdata folder the way a training run does (LitData's prepare on the
first process of each node first, then its train dataset and loader) and saves the blocks it consumed.

Usage: python -m torch.distributed.run ... tests/streaming_ranks.py FOLDER OUT MICRO_BATCHES [POSITIONS]
MICRO_BATCHES: how many to read ("epoch": one epoch); POSITIONS: a file of every rank's loader position to resume.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from litgpt.data import LitData
from litgpt.data.tiny import TOKENIZER_DIR
from litgpt.distributed.runtime import every_rank, node_local_first
from litgpt.tokenizer import Tokenizer


def main(folder: str, out: Path, micro_batches: str, positions: str = "") -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = LitData(folder, num_workers=0)
    data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=32)
    with node_local_first():
        data.prepare()
    batches = data.batches(data.train_dataset(), micro_batch_size=2, seed=0, rank=rank, world_size=world)
    if positions:
        batches.load_state_dict(torch.load(positions, weights_only=True))
    count = batches.per_epoch if micro_batches == "epoch" else int(micro_batches)
    stream, blocks = batches.iterate(), []
    for _ in range(count):
        _, _, batch = next(stream)
        blocks.append(torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1))
    torch.save(torch.cat(blocks), out / f"blocks-{rank}.pt")
    every = every_rank(batches.state_dict())
    if rank == 0:
        torch.save(every, out / "positions.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])

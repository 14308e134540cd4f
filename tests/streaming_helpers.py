"""Corpora in litdata's optimized format, written by litdata's own `optimize` from the bundled stories."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR


def stories() -> list[str]:
    return [story for story in (TINY_DIR / "train.txt").read_text().split("\n\n") if story.strip()]


@functools.lru_cache(maxsize=1)
def tokenizer():
    from litgpt.tokenizer import Tokenizer

    return Tokenizer(TOKENIZER_DIR)


def story_ids(story: str):
    """litdata.optimize's function: one story's token ids with EOS, as LitGPT's prepare scripts wrote them."""
    yield tokenizer().encode(story, eos=True).to(torch.int32)


def fixed_blocks(piece: torch.Tensor):
    """litdata.optimize's function for corpora cut into pieces of exactly one block."""
    yield piece


def optimize_folder(output_dir: Path, inputs: list, fn=story_ids, **options) -> Path:
    from litdata import TokensLoader, optimize

    options.setdefault("chunk_bytes", "16KB")
    # fork: a spawned worker would import torch again (seconds per folder)
    optimize(fn=fn, inputs=inputs, output_dir=str(output_dir), item_loader=TokensLoader(), num_workers=1,
             mode="overwrite", start_method="fork", **options)
    return output_dir


def tinyllama_layout(root: Path) -> Path:
    """SlimPajama and Starcoder stand-ins under `root`, in the folders TinyLlama and MicroLlama read."""
    texts = stories()
    optimize_folder(root / "slimpajama" / "train", texts[:300])
    optimize_folder(root / "slimpajama" / "val", texts[300:340])
    optimize_folder(root / "starcoder", texts[340:500])
    return root


def block_corpus(output_dir: Path, blocks: int, block_size: int, blocks_per_chunk: int) -> torch.Tensor:
    """A folder of `blocks` items of exactly `block_size` ids of the stories (one block each), `blocks_per_chunk` to
    a chunk, so that a stream of blocks of that size drops nothing; returns the blocks in order."""
    ids = torch.cat([tokenizer().encode(story, eos=True) for story in stories()[:200]]).to(torch.int32)
    pieces = ids[: blocks * block_size].view(blocks, block_size)
    optimize_folder(output_dir, list(pieces), fn=fixed_blocks, chunk_size=blocks_per_chunk, chunk_bytes=None)
    return pieces

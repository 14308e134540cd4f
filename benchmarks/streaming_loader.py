"""The streaming loader alone (`--data LitData`): tokens/s per process with 0 and N loader workers, beside what a
training step of a 1B-shaped model consumes, and the loader's peak resident memory on a corpus and on one ten times
larger.

    python benchmarks/streaming_loader.py [--tokens 5000000] [--workers 2] [--seq_length 2048] [--micro_batch 4]

Each measurement reads one epoch in a fresh child process, sampling the anonymous resident memory of the process and
its loader workers (the corpus's file pages that the memory map brings in are the kernel's page cache, not the
loader's); the corpora are random token ids written by litdata's `optimize` (what `litgpt prepare` writes) into a
temporary folder.
The step figures: a 1B-shaped model (TinyLlama 1.1B) needs 6 x 1.1e9 FLOPs a token; at this CPU's measured matmul
peak, a training step could at best consume peak / 6.6e9 tokens/s, and TinyLlama's authors report 24,000 tokens/s
per A100-40GB GPU (Zhang et al. 2024, "TinyLlama: An Open-Source Small Language Model", section 2.3).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PARAMETERS_1B = 1.1e9
A100_TINYLLAMA_TOKENS_PER_S = 24_000
CHUNK_TOKENS = 1 << 20


def random_chunk(index: int):
    """litdata.optimize's function: a million random ids below 32,000 (a Llama 2 vocabulary), seeded by `index`."""
    import torch

    generator = torch.Generator().manual_seed(index)
    return torch.randint(0, 32_000, (CHUNK_TOKENS,), generator=generator, dtype=torch.int32)


def write_corpus(folder: Path, tokens: int) -> None:
    from litdata import TokensLoader, optimize

    optimize(fn=random_chunk, inputs=list(range(max(1, tokens // CHUNK_TOKENS))), output_dir=str(folder),
             chunk_bytes="64MB", item_loader=TokensLoader(), num_workers=2, start_method="fork", verbose=False)


class AnonymousPeak:
    """The largest anonymous resident memory (RssAnon: the heap, not the corpus's file pages that a memory map brings
    in and the kernel can drop) of this process plus its loader workers, sampled every 10 ms."""

    def __init__(self) -> None:
        import psutil

        self.process, self.peak, self.running = psutil.Process(), 0, True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while self.running:
            total = 0
            for process in [self.process, *self.process.children(recursive=True)]:
                try:
                    info = process.memory_info()
                    total += info.rss - info.shared
                except Exception:  # a worker that just ended
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.01)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return self.peak


def measure(folder: str, workers: int, seq_length: int, micro_batch: int) -> dict:
    """In this process: read one epoch of micro-batches through LitData's loader."""
    from litgpt.data import LitData
    from litgpt.data.tiny import TOKENIZER_DIR
    from litgpt.tokenizer import Tokenizer

    memory = AnonymousPeak()
    data = LitData(folder, num_workers=workers)
    data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=seq_length)
    batches = data.batches(data.train_dataset(), micro_batch, seed=0, rank=0, world_size=1)
    stream = batches.iterate()
    next(stream)  # workers started, first chunk opened
    start, tokens = time.perf_counter(), 0
    for _ in range(batches.per_epoch - 1):
        _, _, batch = next(stream)
        tokens += batch["input_ids"].numel()
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": tokens / elapsed, "peak_anon_mib": memory.stop() / 2**20, "tokens_read": tokens}


def in_child(folder: Path, workers: int, args) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import streaming_loader as s; "
            f"print(json.dumps(s.measure({str(folder)!r}, {workers}, {args.seq_length}, {args.micro_batch})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=5_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seq_length", type=int, default=2048)
    parser.add_argument("--micro_batch", type=int, default=4)
    args = parser.parse_args()
    from litgpt.train.metrics import measured_matmul_flops

    import torch

    peak, _ = measured_matmul_flops(torch.device("cpu"), torch.float32)
    step_tokens_per_s = peak / (6 * PARAMETERS_1B)
    with tempfile.TemporaryDirectory() as root:
        rows = []
        for scale in (1, 10):
            folder = Path(root) / f"corpus-x{scale}"
            write_corpus(folder, args.tokens * scale)
            for workers in (0, args.workers):
                rows.append((scale, workers, in_child(folder, workers, args)))
    print(f"micro batch {args.micro_batch} x {args.seq_length} tokens; corpus {args.tokens:,} tokens and 10x")
    print("| corpus | workers | loader tokens/s | peak anonymous RSS MiB | 1B step on this CPU (peak matmul) tokens/s "
          "| 1B step on an A100 (TinyLlama) tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for scale, workers, row in rows:
        print(f"| {args.tokens * scale:,} | {workers} | {row['tokens_per_s']:,.0f} | {row['peak_anon_mib']:,.0f} | "
              f"{step_tokens_per_s:,.0f} | {A100_TINYLLAMA_TOKENS_PER_S:,} |")


if __name__ == "__main__":
    main()

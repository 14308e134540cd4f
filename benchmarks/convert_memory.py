"""Peak memory of `litgpt convert_to_litgpt` against the size of the checkpoint it converts.

Builds a random Llama-shaped Hugging Face checkpoint (safetensors), converts it in a child process and prints the
checkpoint size and the child's peak anonymous memory (sampled from /proc; file-backed pages of the memory-mapped
input are reclaimable and not counted).

    python benchmarks/convert_memory.py --layers 12 --width 1024
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def read_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(tempfile.mkdtemp()) / "model"
    config = LlamaConfig(
        hidden_size=args.width, intermediate_size=args.width * 4, num_hidden_layers=args.layers,
        num_attention_heads=args.width // 64, num_key_value_heads=args.width // 256, vocab_size=32000,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))

    child = subprocess.Popen([sys.executable, "-m", "litgpt", "convert_to_litgpt", str(folder)], stdout=subprocess.DEVNULL)
    peak_anon = 0

    def sample() -> None:
        nonlocal peak_anon
        while child.poll() is None:
            try:
                peak_anon = max(peak_anon, read_status(child.pid, "RssAnon"))
            except (FileNotFoundError, ProcessLookupError):
                break
            time.sleep(0.005)

    start = time.perf_counter()
    sampler = threading.Thread(target=sample)
    sampler.start()
    child.wait()
    sampler.join()
    seconds = time.perf_counter() - start
    if child.returncode != 0:
        sys.exit(child.returncode)
    print(f"checkpoint size: {size / 2**20:.0f} MiB (fp32, {args.layers} layers x {args.width} wide)")
    print(f"conversion time: {seconds:.1f} s")
    print(f"peak anonymous memory of the converter: {peak_anon / 2**20:.0f} MiB "
          f"({peak_anon / size:.2f}x the checkpoint; includes ~python+torch start-up)")


if __name__ == "__main__":
    main()

"""`litgpt serve` under load: requests/s and generated tokens/s at 1, 4 and 16 concurrent clients.

Writes a small random Llama-shaped checkpoint (the bundled 4096-token tokenizer), starts `litgpt serve` on it twice,
with continuous batching (--max_batch_size 16) and without (--max_batch_size 1: one request at a time), and has N
client threads send completions requests back to back over HTTP (greedy, a distinct prompt each, a fixed number of
new tokens; 32 requests per level, split among the clients). Prints a table and writes the figures as JSON.

    python benchmarks/serve.py [--new_tokens 32] [--requests 32] [--out benchmarks/results/serve-cpu-DATE.json]
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_TOKENIZER = ROOT / "litgpt" / "data" / "tiny" / "tokenizer"
CLIENTS = (1, 4, 16)


def write_checkpoint(folder: Path) -> Path:
    from litgpt.config import Config
    from litgpt.io import save_state_dict
    from litgpt.model import GPT

    folder.mkdir(parents=True, exist_ok=True)
    config = Config(name="bench-llama", n_layer=4, n_embd=256, n_head=4, n_query_groups=2, intermediate_size=688,
                    vocab_size=4096, padded_vocab_size=4096, block_size=512)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    save_state_dict(model.state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    for file in BUNDLED_TOKENIZER.iterdir():
        shutil.copy2(file, folder / file.name)
    return folder


def start_server(checkpoint: Path, log: Path, max_batch_size: int) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "litgpt", "serve", str(checkpoint), "--port", "0", "--device", "cpu",
               "--max_batch_size", str(max_batch_size)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)
    while process.poll() is None:
        match = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        if match:
            return process, int(match.group(1))
        time.sleep(0.1)
    raise SystemExit(f"the server did not start: {log.read_text()}")


def complete(port: int, prompt: str, new_tokens: int) -> int:
    """One non-streaming request; returns the number of tokens generated."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    answer = json.loads(connection.getresponse().read())
    connection.close()
    return answer["usage"]["completion_tokens"]


def load(port: int, clients: int, requests_per_client: int, new_tokens: int) -> dict:
    """`clients` threads, each sending its requests one after another; figures over the whole run."""
    tokens, latencies = [], []

    def client(c: int) -> None:
        for r in range(requests_per_client):
            start = time.perf_counter()
            tokens.append(complete(port, f"Client {c} asks question {r}: what is the weather like in", new_tokens))
            latencies.append(time.perf_counter() - start)

    complete(port, "warm-up", 4)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    return {"clients": clients, "requests": len(tokens), "generated_tokens": sum(tokens), "seconds": elapsed,
            "requests_per_s": len(tokens) / elapsed, "tokens_per_s": sum(tokens) / elapsed,
            "mean_latency_s": sum(latencies) / len(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32, help="requests per level, split among the clients")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / f"serve-cpu-{datetime.date.today()}.json")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="litgpt-serve-bench-"))
    checkpoint = write_checkpoint(root / "bench-llama")
    rows = []
    for max_batch_size in (16, 1):
        process, port = start_server(checkpoint, root / f"server-{max_batch_size}.log", max_batch_size)
        try:
            for clients in CLIENTS:
                figures = load(port, clients, args.requests // clients, args.new_tokens)
                row = {"max_batch_size": max_batch_size, **figures}
                rows.append(row)
                print(f"batch<= {max_batch_size:>2}  clients {clients:>2}  {row['requests']:>3} requests  "
                      f"{row['requests_per_s']:6.2f} req/s  {row['tokens_per_s']:7.1f} tokens/s  "
                      f"latency {row['mean_latency_s']:.2f} s", flush=True)
        finally:
            process.terminate()
            process.wait()
    shutil.rmtree(root)
    result = {
        "benchmark": "serve", "model": "random Llama, 4 layers, 256 wide, 4 heads / 2 KV groups, vocab 4096",
        "new_tokens": args.new_tokens, "requests": args.requests,
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_average_1min_at_end": os.getloadavg()[0],
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

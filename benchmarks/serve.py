"""`litgpt serve` beside LitGPT 0.5.13's `litgpt serve`: requests/s, generated tokens/s and p50/p99 latency at 1, 4,
16 and 64 concurrent clients, on the same CPU, model, precision and thread count.

One checkpoint folder in LitGPT's format that both toolkits load (a random Llama of 5M parameters, 4 layers, 256
wide, the bundled 4096-token tokenizer). Each server is started in turn, alone on the machine, and N client threads
each send requests back to back (the next when the previous is answered): a distinct prompt per request, greedy,
`--new_tokens` new tokens each, non-streaming, a new connection per request. Runs alternate ours and LitGPT (A B A B
with `--repeats 2`); the table shows the medians over the repeats and the ratios ours / LitGPT.

    python benchmarks/serve.py --litgpt-venv /tmp/litgpt-ref --repeats 2 --out benchmarks/results/serve-cpu-DATE.json

Ours: `python -m litgpt serve CKPT --port 0` + OURS_FLAGS + `--ours-args`, POST /v1/completions. LitGPT 0.5.13:
`litgpt serve CKPT` + LITGPT_FLAGS (LitServe, one request at a time), POST /predict {"prompt"} -> {"output"}.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_TOKENIZER = ROOT / "litgpt" / "data" / "tiny" / "tokenizer"
# Our server's flags besides the checkpoint, --port and --precision; `--ours-args` appends more (a later copy of a
# flag wins), so new flags of `litgpt serve` need no change here.
OURS_FLAGS = ["--device", "cpu", "--max_batch_size", "16"]
# LitGPT 0.5.13 sets sampling and the answer's length for the whole server (a request carries only its prompt):
# greedy, and a queue timeout long enough for 64 clients served one at a time (its default, 30 s, answers 504).
LITGPT_FLAGS = ["--accelerator", "cpu", "--devices", "1", "--temperature", "0", "--timeout", "600"]
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 900


# ---- the machine ---------------------------------------------------------------------------------------------------
def cpu_info() -> tuple[str, set[str]]:
    model, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def default_precision() -> str:
    """The precision both servers get: bf16 where the CPU has native bf16 (ours' default there), else float32
    (LitGPT 0.5.13 would pick bf16-true on every CPU, emulated and slow where it is not native)."""
    _, flags = cpu_info()
    return "bf16-true" if flags & {"avx512_bf16", "amx_bf16"} else "32-true"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def reference_env() -> dict:
    """The environment of LitGPT's processes: without PYTHONPATH; they also run outside this checkout, where a
    `python -c` child (LitServe spawns its workers so) would find our `litgpt` first on sys.path."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def versions(litgpt_venv: Optional[Path]) -> dict:
    import torch

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "litgpt"], capture_output=True,
                           text=True).stdout
    found = {"torch": torch.__version__, "ours_commit": commit.strip(), "ours_litgpt_dirty": bool(dirty.strip())}
    if litgpt_venv is not None:
        script = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
                  "('litgpt', 'litserve', 'torch')}))")
        out = subprocess.run([str(litgpt_venv / "bin" / "python"), "-c", script], capture_output=True, text=True,
                             cwd=tempfile.gettempdir(), env=reference_env())
        found["reference"] = json.loads(out.stdout) if out.returncode == 0 else out.stderr[-500:]
    return found


# ---- the checkpoint ------------------------------------------------------------------------------------------------
def write_checkpoint(folder: Path) -> Path:
    """lit_model.pth, model_config.yaml (+ prompt_style.yaml) and the tokenizer files, which LitGPT 0.5.13 loads too."""
    import torch

    from litgpt.config import Config
    from litgpt.io import save_state_dict
    from litgpt.model import GPT

    folder.mkdir(parents=True, exist_ok=True)
    config = Config(name="bench-llama", n_layer=4, n_embd=256, n_head=4, n_query_groups=2, intermediate_size=688,
                    vocab_size=4096, padded_vocab_size=4096, block_size=512)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    # Both servers stop an answer at the end-of-text token, and LitGPT's answer is text only (its length in tokens
    # cannot be read back from it: byte-level pieces do not round-trip). With the special tokens' rows of the output
    # head zeroed, their logits are exactly 0 while the largest of the other 4,094 random logits is positive, so
    # greedy decoding never picks them: every answer on both sides is exactly --new_tokens long.
    special = [t["id"] for t in json.loads((BUNDLED_TOKENIZER / "tokenizer.json").read_text())["added_tokens"]]
    with torch.no_grad():
        model.lm_head.weight[special] = 0.0
    save_state_dict(model.state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    for file in BUNDLED_TOKENIZER.iterdir():
        shutil.copy2(file, folder / file.name)
    return folder


# ---- the servers ---------------------------------------------------------------------------------------------------
def post_json(port: int, path: str, body: dict) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {payload[:300]!r}")
    return json.loads(payload)


def health_ok(port: int) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def free_port() -> int:
    """LitServe takes only ports 1024-65535, not 0: ask the kernel for a free one (a tiny race, on a quiet machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ours:
    name = "ours"

    def __init__(self, checkpoint: Path, precision: str, extra: list[str]) -> None:
        self.command = [sys.executable, "-m", "litgpt", "serve", str(checkpoint), "--port", "0",
                        "--precision", precision, *OURS_FLAGS, *extra]
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def port(self, log: Path) -> Optional[int]:
        match = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        return int(match.group(1)) if match else None

    def complete(self, port: int, prompt: str, new_tokens: int) -> tuple[int, str]:
        answer = post_json(port, "/v1/completions", {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0})
        return answer["usage"]["completion_tokens"], answer["choices"][0]["text"]


class LitGPT:
    name = "litgpt"

    def __init__(self, checkpoint: Path, precision: str, new_tokens: int, venv: Path, extra: list[str]) -> None:
        self.listen = free_port()
        self.command = [str(venv / "bin" / "litgpt"), "serve", str(checkpoint), "--port", str(self.listen),
                        "--precision", precision, "--max_new_tokens", str(new_tokens), *LITGPT_FLAGS, *extra]
        self.env = reference_env()
        self.new_tokens = new_tokens

    def port(self, log: Path) -> Optional[int]:
        return self.listen if health_ok(self.listen) else None  # /health answers once the model is loaded

    def complete(self, port: int, prompt: str, new_tokens: int) -> tuple[int, str]:
        # Text only, no count: the count is the server's --max_new_tokens, as end-of-text cannot be generated (see
        # write_checkpoint); the summary compares the texts with ours, which counts its tokens.
        return self.new_tokens, post_json(port, "/predict", {"prompt": prompt})["output"]


def start(server, log: Path, threads: int) -> tuple[subprocess.Popen, int]:
    """Start a server in a session of its own (LitServe runs several processes) and wait until it answers."""
    env = {**server.env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    process = subprocess.Popen(server.command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                               cwd=log.parent, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while process.poll() is None and time.monotonic() < deadline:
        port = server.port(log)
        if port is not None:
            return process, port
        time.sleep(0.2)
    stop(process)
    raise SystemExit(f"{server.name}'s server did not start ({' '.join(server.command)}):\n"
                     f"{log.read_text(errors='replace')[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    """Ctrl-C to the server's process group (both servers shut down on it), then SIGKILL to whatever is left."""
    for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
            process.wait(wait_s)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            pass


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes of a process group (a server and its workers)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


# ---- the load ------------------------------------------------------------------------------------------------------
def prompt_for(clients: int, client: int, request: int) -> str:
    return f"Story {request} for reader {client} of {clients}: once upon a time, in a small village,"


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def drive(server, port: int, pgid: int, clients: int, per_client: int, new_tokens: int) -> tuple[dict, dict]:
    """`clients` threads, each sending `per_client` requests back to back; figures over the whole level."""
    latencies, tokens, texts, errors = [], [], {}, []

    def client(c: int) -> None:
        for r in range(per_client):
            prompt = prompt_for(clients, c, r)
            begin = time.perf_counter()
            try:
                count, text = server.complete(port, prompt, new_tokens)
            except (OSError, RuntimeError, KeyError, ValueError) as error:
                errors.append(str(error)[:200])
                continue
            latencies.append(time.perf_counter() - begin)
            tokens.append(count)
            texts[prompt] = text

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    cpu_before, begin = group_cpu_seconds(pgid), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - begin
    server_cpu = group_cpu_seconds(pgid) - cpu_before  # every process of the server (LitServe's API process too)
    done = len(latencies)
    row = {"clients": clients, "requests": done, "errors": len(errors), "first_errors": errors[:3],
           "generated_tokens": sum(tokens), "short_answers": sum(t < new_tokens for t in tokens),
           "seconds": round(seconds, 3), "requests_per_s": done / seconds, "tokens_per_s": sum(tokens) / seconds,
           "p50_s": percentile(latencies, 0.5) if done else None,
           "p99_s": percentile(latencies, 0.99) if done else None,
           "mean_s": statistics.fmean(latencies) if done else None, "server_cpu_s": round(server_cpu, 2),
           "server_cpu_ms_per_token": 1000 * server_cpu / sum(tokens) if tokens else None}
    return row, texts


def run_side(server, levels: list[int], args: argparse.Namespace, log: Path) -> tuple[dict, dict]:
    """One server's run: start it, warm it up, every level of clients in turn, stop it."""
    run = {"side": server.name, "load_average_before": load_average(), "command": shlex.join(server.command)}
    begin = time.perf_counter()
    process, port = start(server, log, args.threads)
    run["start_s"] = round(time.perf_counter() - begin, 1)
    texts = {}
    try:
        for w in range(2):  # the first requests pay one-off costs (allocations, caches' first growth)
            server.complete(port, f"Warm-up {w}: once upon a time, in a small village,", args.new_tokens)
        run["rows"] = []
        for clients in levels:
            per_client = max(1, round(args.requests / clients))
            row, level_texts = drive(server, port, process.pid, clients, per_client, args.new_tokens)
            run["rows"].append(row)
            texts.update(level_texts)
            print(f"  {server.name:>6}  {clients:>2} clients  {row['requests']:>4} requests  "
                  f"{row['requests_per_s']:7.2f} req/s  {row['tokens_per_s']:8.1f} tokens/s  "
                  f"p50 {fmt_s(row['p50_s'])}  p99 {fmt_s(row['p99_s'])}  server CPU {row['server_cpu_s']:.1f} s"
                  + (f"  {row['errors']} ERRORS: {row['first_errors'][:1]}" if row["errors"] else "")
                  + (f"  {row['short_answers']} SHORT ANSWERS" if row["short_answers"] else ""), flush=True)
    finally:
        stop(process)
    return run, texts


# ---- the summary ---------------------------------------------------------------------------------------------------
def fmt_s(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f} s"


def summarize(runs: list[dict], levels: list[int], texts: dict) -> list[dict]:
    """Medians over the repeats per side and level, the ratios ours / LitGPT, and how many of LitGPT's answers are
    ours word for word (greedy on the same weights: they differ only by rounding, e.g. of batched bf16 matmuls)."""
    def median(side: str, clients: int, key: str) -> Optional[float]:
        values = [row[key] for run in runs if run["side"] == side for row in run["rows"]
                  if row["clients"] == clients and row[key] is not None]
        return statistics.median(values) if values else None

    summary = []
    for clients in levels:
        entry = {"clients": clients}
        for side in ("ours", "litgpt"):
            for key in ("requests_per_s", "tokens_per_s", "p50_s", "p99_s", "server_cpu_ms_per_token"):
                entry[f"{side}_{key}"] = median(side, clients, key)
        if entry["ours_tokens_per_s"] and entry["litgpt_tokens_per_s"]:
            entry["throughput_ratio"] = entry["ours_tokens_per_s"] / entry["litgpt_tokens_per_s"]
            entry["p99_ratio"] = entry["ours_p99_s"] / entry["litgpt_p99_s"]
        prompts = [p for p in texts.get("litgpt", {}) if p.startswith("Story ") and f"of {clients}:" in p]
        if prompts and texts.get("ours"):
            same = sum(texts["ours"].get(p) == texts["litgpt"][p] for p in prompts)
            entry["litgpt_answers_equal_to_ours"] = f"{same}/{len(prompts)}"
        summary.append(entry)
    return summary


def print_table(summary: list[dict]) -> None:
    columns = [("req/s ours", "ours_requests_per_s", 2), ("LitGPT", "litgpt_requests_per_s", 2),
               ("tokens/s ours", "ours_tokens_per_s", 1), ("LitGPT", "litgpt_tokens_per_s", 1),
               ("ratio", "throughput_ratio", 2), ("p50 ours", "ours_p50_s", 3), ("LitGPT", "litgpt_p50_s", 3),
               ("p99 ours", "ours_p99_s", 3), ("LitGPT", "litgpt_p99_s", 3), ("ratio", "p99_ratio", 2)]
    print("\n" + " ".join(f"{title:>{max(len(title), 8)}}" for title in ("clients", *(c[0] for c in columns),
                                                                         "same text")))
    for e in summary:
        cells = [f"{e['clients']:>8}"]
        for title, key, digits in columns:
            value = e.get(key)
            cells.append(f"{'-' if value is None else f'{value:,.{digits}f}':>{max(len(title), 8)}}")
        cells.append(f"{e.get('litgpt_answers_equal_to_ours', '-'):>9}")
        print(" ".join(cells))
    goal = next((e for e in summary if e["clients"] == 16 and "throughput_ratio" in e), None)
    if goal:
        met = goal["throughput_ratio"] >= 2.0 and goal["p99_ratio"] <= 1.0
        print(f"\nGoal at 16 clients (>= 2x LitGPT's tokens/s, p99 no worse): {'met' if met else 'NOT met'} "
              f"({goal['throughput_ratio']:.2f}x tokens/s, p99 ratio {goal['p99_ratio']:.2f})")


# ---- the command ---------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="`litgpt serve` beside LitGPT 0.5.13's under 1-64 concurrent "
                                                 "clients: requests/s, tokens/s, p50/p99 latency")
    parser.add_argument("--litgpt-venv", type=Path, default=Path("/tmp/litgpt-ref"),
                        help="virtual environment with LitGPT 0.5.13 and LitServe; without it only ours runs")
    parser.add_argument("--clients", default="1,4,16,64", help="levels of concurrent clients, comma-separated")
    parser.add_argument("--requests", type=int, default=256,
                        help="requests per level, split evenly among the clients (at least one each)")
    parser.add_argument("--new_tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, alternating ours and LitGPT")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS of both servers")
    parser.add_argument("--precision", default=None, help="both servers' precision; default: bf16-true on CPUs "
                        "with native bf16, else 32-true")
    parser.add_argument("--ours-args", default="", help="more flags for our server, e.g. '--max_batch_size 32'")
    parser.add_argument("--litgpt-args", default="", help="more flags for LitGPT's server")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / f"serve-cpu-{datetime.date.today()}.json")
    parser.add_argument("--note", default="", help="a remark stored in the JSON (e.g. what else ran)")
    return parser.parse_args()


def check_quiet() -> None:
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if os.getloadavg()[0] > 0.5:
        print("WARNING: the 1-minute load average is above 0.5: other jobs share the CPU and the figures will move "
              "with them; rerun on a quiet machine before quoting them.", flush=True)


def main() -> None:
    args = parse_args()
    levels = [int(n) for n in args.clients.split(",")]
    precision = args.precision or default_precision()
    venv = args.litgpt_venv if (args.litgpt_venv / "bin" / "litgpt").exists() else None
    if venv is None:
        print(f"No LitGPT at {args.litgpt_venv}/bin/litgpt: only ours runs (README: how to make the venv).")
    check_quiet()
    root = Path(tempfile.mkdtemp(prefix="litgpt-serve-bench-"))
    checkpoint = write_checkpoint(root / "bench-llama")
    model, _ = cpu_info()
    result = {
        "benchmark": "serve", "date": str(datetime.date.today()), "note": args.note,
        "model": "random Llama, 4 layers, 256 wide, 4 heads / 2 KV groups, MLP 688, vocab 4096 (bundled tokenizer), "
                 "special tokens' output rows zeroed",
        "machine": {"cpu": model, "cores": os.cpu_count(), **versions(venv)},
        "settings": {"precision": precision, "threads": args.threads, "new_tokens": args.new_tokens,
                     "requests_per_level": args.requests, "clients": levels, "repeats": args.repeats,
                     "ours_flags": OURS_FLAGS + shlex.split(args.ours_args),
                     "litgpt_flags": LITGPT_FLAGS + shlex.split(args.litgpt_args)},
        "runs": [],
    }
    texts: dict[str, dict] = {}
    try:
        for repeat in range(args.repeats):
            sides = [Ours(checkpoint, precision, shlex.split(args.ours_args))]
            if venv is not None:
                sides.append(LitGPT(checkpoint, precision, args.new_tokens, venv, shlex.split(args.litgpt_args)))
            for server in sides:
                print(f"repeat {repeat + 1}/{args.repeats}, {server.name} (load average {load_average()})", flush=True)
                run, run_texts = run_side(server, levels, args, root / f"{server.name}-{repeat}.log")
                result["runs"].append({"repeat": repeat, **run})
                texts.setdefault(server.name, run_texts)  # the first repeat's answers, to compare the two sides
                result["summary"] = summarize(result["runs"], levels, texts)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=2) + "\n")  # after every run: a stopped run keeps some
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(result["summary"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

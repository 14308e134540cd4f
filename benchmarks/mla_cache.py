"""KV cache of multi-head latent attention: the compressed latent litgpt caches by default against every head's full
key and value, in bytes per token and in total, at DeepSeek-V3's shape and at a tiny one, and decode tokens/s of
both caches on the tiny shape.

    OMP_NUM_THREADS=1 python benchmarks/mla_cache.py
    python benchmarks/mla_cache.py --device cuda --dtype bfloat16

The bytes are those of the cache buffers `MultiheadLatentAttention.new_kv_cache` allocates (the registered
DeepSeek-V3's on the meta device, at its full 163840-token context: shapes without memory; the tiny model's for
real). Decoding runs `litgpt.generate.generate` greedily after a prompt, `--repeats` times per cache in turn; the
median gives tokens/s (on the CPU the process' CPU time, with OMP_NUM_THREADS=1 the work done whatever a shared
host's neighbours do; wall time on CUDA). Both caches must produce the same tokens. The JSON result goes to
benchmarks/results/mla_cache-<device>-<date>.json unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from litgpt.config import Config
from litgpt.generate import generate
from litgpt.model import GPT, MultiheadLatentAttention

# Its proportions at a size that decodes quickly on a CPU: 8 heads, latent 64 + rotary 16 vs. 8 * (48 + 32) full.
TINY = dict(name="tiny MLA", n_layer=4, n_embd=256, n_head=8, head_size=48, block_size=1024, q_lora_rank=96,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_interleaved=True,
            vocab_size=512, padded_vocab_size=512, intermediate_size=512)


def cache_bytes(config: Config, tokens: int, latent: bool, device: str, dtype: torch.dtype) -> int:
    """Bytes of the KV cache buffers of every layer for `tokens` positions of one sequence."""
    with torch.device("meta"):
        attn = MultiheadLatentAttention(config, 0)
    cache = attn.new_kv_cache(1, tokens, device=device, dtype=dtype, latent=latent)
    return config.n_layer * sum(t.numel() * t.element_size() for t in (cache.k, cache.v))


def decode_rate(model: GPT, prompt: torch.Tensor, new_tokens: int, latent: bool, repeats: int) -> tuple[float, list]:
    """Median new tokens per second, and the tokens, of greedy decoding with the latent or the full cache."""
    length = prompt.numel() + new_tokens
    for block in model.transformer.h:
        block.attn.kv_cache = block.attn.new_kv_cache(1, length, device=prompt.device, dtype=model.lm_head.weight.dtype,
                                                      latent=latent)
    timings, tokens = [], []
    for _ in range(repeats):
        cuda = prompt.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter() if cuda else time.process_time()
        tokens = list(generate(model, prompt, new_tokens, temperature=0.0))
        if cuda:
            torch.cuda.synchronize()
        timings.append((time.perf_counter() if cuda else time.process_time()) - start)
    return new_tokens / statistics.median(timings), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens before decoding")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for config, tokens, device in ((Config.from_name("DeepSeek-V3"), 163840, "meta"),
                                   (Config(**TINY), args.prompt, args.device)):
        latent, full = (cache_bytes(config, tokens, flag, device, torch.bfloat16) for flag in (True, False))
        rows.append(dict(model=config.name, tokens=tokens, latent_bytes_per_token=latent // tokens,
                         full_bytes_per_token=full // tokens, latent_total=latent, full_total=full))

    torch.manual_seed(0)
    model = GPT(Config(**TINY)).to(device=args.device, dtype=dtype)
    model.init_weights()
    model.eval()
    prompt = torch.randint(0, TINY["vocab_size"], (args.prompt,), device=args.device)
    rates = {}
    outputs = {}
    for latent in (True, False, True, False):  # alternated, the second round timed: warm caches and allocator
        rates[latent], outputs[latent] = decode_rate(model, prompt, args.new_tokens, latent, args.repeats)
    assert outputs[True] == outputs[False], "the latent and the full cache decode different tokens"

    print("bf16 KV cache, one sequence          latent (kv_lora_rank + rope)   full (every head's k and v)   ratio")
    for r in rows:
        print(f"{r['model']:<22} bytes/token   {r['latent_bytes_per_token']:>28,}   {r['full_bytes_per_token']:>27,}"
              f"   {r['full_bytes_per_token'] / r['latent_bytes_per_token']:.1f}x")
        print(f"{'':<22} at {r['tokens']:>7} tok {r['latent_total'] / 2**20:>25,.1f} MiB"
              f"   {r['full_total'] / 2**20:>23,.1f} MiB")
    print(f"decode, {TINY['name']} ({args.device}, {args.dtype}, {args.prompt}-token prompt, {args.new_tokens} new)"
          f"   {rates[True]:>8.1f} tok/s   {rates[False]:>8.1f} tok/s   (same tokens)")
    result = dict(device=args.device, dtype=args.dtype, prompt=args.prompt, new_tokens=args.new_tokens, caches=rows,
                  decode_tokens_per_s={"latent": rates[True], "full": rates[False]})
    output = args.output or Path(__file__).parent / "results" / f"mla_cache-{args.device}-{datetime.date.today()}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()

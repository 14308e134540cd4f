"""Hugging Face -> litgpt -> Hugging Face on a small random Llama, with figures: logit agreement and generation speed.

Runs the real commands (`litgpt convert_to_litgpt`, `litgpt generate`, `litgpt convert_from_litgpt`) on a
Llama-shaped model (4 layers, 256 wide, 4 query heads over 2 KV groups, the bundled 4096-token tokenizer) and
compares with `transformers` on the same weights. No download, no GPU; about a minute on a 2-core CPU.

    python benchmarks/convert_and_generate.py [--new_tokens 200] [--out_dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "litgpt" / "data" / "tiny" / "tokenizer"


def litgpt(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "litgpt", *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=200)
    parser.add_argument("--out_dir", type=Path, default=None, help="keep the folders here (default: a temp dir)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from litgpt.generate import generate, load_model_and_tokenizer

    root = args.out_dir or Path(tempfile.mkdtemp(prefix="litgpt-smoke-"))
    hf_dir, back_dir = root / "hf-llama", root / "hf-llama-roundtrip"
    shutil.rmtree(back_dir, ignore_errors=True)

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=4096, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
    )
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(hf_dir)
    for file in BUNDLED_TOKENIZER.iterdir():
        shutil.copy2(file, hf_dir / file.name)
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"model: random Llama, {n_params / 1e6:.1f}M parameters, in {hf_dir}")

    seconds = litgpt("convert_to_litgpt", str(hf_dir))
    print(f"litgpt convert_to_litgpt: {seconds:.1f} s (including interpreter start-up)")

    model, tokenizer = load_model_and_tokenizer(hf_dir, precision="32-true", device="cpu")
    prompt = tokenizer.encode("Once upon a time, a little fox")
    with torch.no_grad():
        ours = model(prompt[None])
        theirs = hf(prompt[None]).logits
    print(f"max |logit difference| litgpt vs transformers (fp32): {(ours - theirs).abs().max().item():.2e}")

    # Greedy decoding, both with a KV cache; eos disabled so that both run the full length.
    start = time.perf_counter()
    our_tokens = list(generate(model, prompt, args.new_tokens, temperature=0.0))
    our_seconds = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        # An explicit attention mask: the bundled tokenizer's BOS is id 0, which must not be taken for padding.
        their_tokens = hf.generate(
            prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=args.new_tokens,
            do_sample=False, eos_token_id=None, pad_token_id=config.eos_token_id,
        )[0, prompt.numel():].tolist()
    their_seconds = time.perf_counter() - start
    same = our_tokens == their_tokens
    print(f"greedy generation, {args.new_tokens} tokens: litgpt {len(our_tokens) / our_seconds:.0f} tokens/s, "
          f"transformers {len(their_tokens) / their_seconds:.0f} tokens/s, identical tokens: {same}")

    seconds = litgpt("generate", str(hf_dir), "--prompt", "Once upon a time", "--max_new_tokens", "20")
    print(f"litgpt generate (20 tokens, end to end): {seconds:.1f} s")

    seconds = litgpt("convert_from_litgpt", str(hf_dir), str(back_dir))
    reloaded = AutoModelForCausalLM.from_pretrained(back_dir).eval()
    with torch.no_grad():
        diff = (reloaded(prompt[None]).logits - theirs).abs().max().item()
    print(f"litgpt convert_from_litgpt: {seconds:.1f} s; reloaded with from_pretrained, max |logit difference| {diff:.2e}")
    if not same or diff > 1e-4:
        sys.exit("litgpt and transformers disagree")


if __name__ == "__main__":
    main()

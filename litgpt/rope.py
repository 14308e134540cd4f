"""Rotary position embeddings: the cos/sin tables of every scaling a family uses (linear, Llama 3, YaRN,
LongRoPE) and their application to queries and keys, in the rotate-half and the interleaved layouts."""

from __future__ import annotations

import math
from typing import Optional

import torch


def build_rope_cache(
    seq_len: int, n_elem: int, base: float, scaling: Optional[dict], device: Optional[torch.device] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..seq_len-1 (seq_len, n_elem), float32; for LongRoPE (2, seq_len, n_elem), the
    tables of the short factors and of the long ones (`GPT.rope_at` picks one per forward pass)."""
    if scaling is not None and scaling["type"] == "longrope":
        short, long, attention_factor = longrope_frequencies(n_elem, base, scaling, seq_len, device)
        tables = [_rope_table(seq_len, inv_freq, attention_factor) for inv_freq in (short, long)]
        return torch.stack([t[0] for t in tables]), torch.stack([t[1] for t in tables])
    inv_freq, attention_factor = rope_frequencies(n_elem, base, scaling, device)
    return _rope_table(seq_len, inv_freq, attention_factor)


def _rope_table(seq_len: int, inv_freq: torch.Tensor, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # the rotate-half layout of Hugging Face checkpoints
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def longrope_frequencies(
    n_elem: int, base: float, scaling: dict, max_positions: int, device=None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini): inverse frequencies divided by per-frequency factors, one set for contexts up
    to original_max_position_embeddings and one past it, and the factor applied to cos/sin. Without `factor` or
    `attention_factor` the context extension is max_positions (block_size) / original, as transformers derives it
    from max_position_embeddings."""
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling.get("factor") or max_positions / original
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    base_freq = base ** (torch.arange(0, n_elem, 2, device=device, dtype=torch.float32) / n_elem)
    short, long = (
        1.0 / (torch.tensor(scaling[key], dtype=torch.float32, device=device) * base_freq)
        for key in ("short_factor", "long_factor")
    )
    return short, long, float(attention_factor)


def rope_frequencies(n_elem: int, base: float, scaling: Optional[dict], device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotary embedding (n_elem // 2,) and the factor applied to cos/sin."""
    exponents = torch.arange(0, n_elem, 2, device=device, dtype=torch.float32) / n_elem
    inv_freq = 1.0 / (base**exponents)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["type"]
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
        original = scaling["original_max_position_embeddings"]
        low_wavelen = original / scaling["low_freq_factor"]
        high_wavelen = original / scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"]
        )
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(in_band, blended, scaled), 1.0
    if kind == "yarn":
        return yarn_frequencies(n_elem, base, scaling, device)
    if kind == "longrope":
        raise ValueError("LongRoPE has two sets of frequencies: use longrope_frequencies.")
    raise ValueError(f"Unknown rope scaling type {kind!r}")


def yarn_frequencies(n_elem: int, base: float, scaling: dict, device=None) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv:2309.00071): interpolate low frequencies, extrapolate high ones, temper the attention."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return n_elem * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, n_elem - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(n_elem // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, n_elem, 2, device=device, dtype=torch.float32) / n_elem)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.size(-1) elements of every head of x (B, nh, T, hs)."""
    n_elem = cos.size(-1)
    if n_elem == 0:
        return x
    rotated, passed = x[..., :n_elem], x[..., n_elem:]
    half = n_elem // 2
    x1, x2 = rotated[..., :half], rotated[..., half:]
    rotated = rotated * cos + torch.cat((-x2, x1), dim=-1) * sin
    if passed.size(-1) == 0:
        return rotated
    return torch.cat((rotated, passed), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x0, x1), (x2, x3), ... of x (B, nh, T, n) by the angles of the rotate-half tables cos and
    sin (T, n), written back de-interleaved (rotated evens, then rotated odds): queries and keys get the same
    permutation, so their products are those of the interleaved rotation (DeepSeek's layout)."""
    half = cos.size(-1) // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

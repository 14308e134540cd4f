"""The model's matmul attention for short sequences on the CPU (`litgpt.model.MatmulAttention`): the same attention
as SDPA's and as transformers' eager attention, in one block of queries and in several (the last one short), taken
exactly where its rule says."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from litgpt.config import Config
from litgpt.model import GPT, MatmulAttention, causal_attention_by_matmuls

HEADS = [(4, 4), (4, 2), (6, 2), (8, 1)]  # (query heads, key groups)
LENGTHS = [24, 150]  # one block of 64 queries; three, the last of 22


def qkv(heads: int, groups: int, dtype: torch.dtype, T: int = 24, hs: int = 16):
    torch.manual_seed(0)
    make = lambda n: torch.randn(2, n, T, hs, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(heads), make(groups), make(groups)


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("heads, groups", HEADS)
def test_it_equals_sdpas_causal_attention_and_its_gradients_in_float32(heads, groups, T):
    q, k, v = qkv(heads, groups, torch.float32, T)
    ours = causal_attention_by_matmuls(q, k, v, 0.3)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=heads != groups)
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("heads, groups", HEADS)
def test_in_bf16_it_is_transformers_eager_attention(heads, groups, T):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    q, k, v = qkv(heads, groups, torch.bfloat16, T)
    T = q.size(-2)
    mask = torch.full((T, T), float("-inf")).triu(1).to(torch.bfloat16)
    module = types.SimpleNamespace(num_key_value_groups=heads // groups, training=False)
    expected, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    ours = causal_attention_by_matmuls(q, k, v, 0.25)
    torch.testing.assert_close(ours.transpose(1, 2), expected, atol=0, rtol=0)


def attention_kernels(model: GPT, idx: torch.Tensor, autocast: bool) -> set[str]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), profile() as trace:
        model(idx)
    names = {event.name for event in trace.events()}
    return {name for name in names if "scaled_dot_product" in name or name == "aten::bmm"}


def test_the_model_takes_it_for_short_sequences_only(monkeypatch):
    """Up to `max_positions` (set here: 32) in float32, and under bf16 autocast where the CPU has native bf16; longer
    sequences and `max_positions` 0 go through SDPA's fused kernel."""
    config = Config(block_size=64, vocab_size=64, padded_vocab_size=64, n_layer=1, n_embd=32, n_head=4,
                    n_query_groups=2, intermediate_size=48, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                    bias=False)
    model = GPT(config)
    short, long = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 33))
    monkeypatch.setattr(MatmulAttention, "max_positions", 32)
    assert attention_kernels(model, short, autocast=False) == {"aten::bmm"}
    if MatmulAttention.bf16:
        assert attention_kernels(model, short, autocast=True) == {"aten::bmm"}
    else:
        assert "aten::bmm" not in attention_kernels(model, short, autocast=True)
    assert "aten::bmm" not in attention_kernels(model, long, autocast=False)
    monkeypatch.setattr(MatmulAttention, "max_positions", 0)
    assert "aten::bmm" not in attention_kernels(model, short, autocast=False)


def test_a_bf16_training_loss_and_its_gradients_follow_sdpas(monkeypatch):
    config = Config(block_size=64, vocab_size=96, padded_vocab_size=96, n_layer=2, n_embd=64, n_head=4,
                    n_query_groups=2, intermediate_size=96, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                    bias=False)
    torch.manual_seed(0)
    model, idx = GPT(config), torch.randint(0, 96, (2, 64))

    def loss_and_grads(max_positions: int):
        monkeypatch.setattr(MatmulAttention, "max_positions", max_positions)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    (ours, our_grads), (fused, fused_grads) = loss_and_grads(64), loss_and_grads(0)
    assert ours == pytest.approx(fused, rel=2e-3)
    assert (our_grads - fused_grads).norm() < 0.02 * fused_grads.norm()

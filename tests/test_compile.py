"""Compiled training (`--compiler torch`): each block compiled equals eager over a few steps, activation checkpointing
applied first still compiles (dynamo's own graph counter), and what `--compiler auto` picks per device kind."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from litgpt.config import Config
from litgpt.distributed.parallelize import apply_activation_checkpointing, auto_compiles, compile_each_block
from litgpt.model import GPT
from litgpt.train.loss import loss_function

TINY = dict(name="tiny", block_size=32, vocab_size=64, padded_vocab_size=64, n_layer=2, n_embd=32, n_head=4,
            n_query_groups=2, intermediate_size=64, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", bias=False,
            parallel_residual=False, rotary_percentage=1.0)


def train_losses(model: GPT, steps: int) -> list[float]:
    """Losses of `steps` AdamW steps (fused, as training builds it) on fixed random batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    loss = loss_function("cross_entropy")
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, 64, (2, 17), generator=generator)
        value = loss(model, batch[:, :-1], batch[:, 1:])["loss"]
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(value.item())
    return losses


@pytest.mark.slow  # 20-100 s of compilation on 2 cores
def test_compiled_checkpointed_blocks_train_like_eager():
    """Three steps with each block compiled after activation checkpointing (`parallelize`'s order) give eager's
    losses and weights, and dynamo compiled graphs: with checkpointing as a `functools.partial` forward it compiled
    none, and every step ran eager."""
    torch.manual_seed(0)
    eager = GPT(Config(**TINY))
    compiled = copy.deepcopy(eager)
    apply_activation_checkpointing(eager, "full")
    apply_activation_checkpointing(compiled, "full")
    torch._dynamo.reset()
    counters.clear()
    compile_each_block(compiled)
    expected, got = train_losses(eager, 3), train_losses(compiled, 3)
    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(("device", "steps", "moe", "expected"), [
    ("cuda", 2, False, True),  # compiled blocks: 1.33x eager on an H100
    ("cuda", 2, True, True),
    ("cpu", 2, False, False),  # a short run: compilation would outlast the steps
    ("cpu", None, True, False),  # mixture-of-experts: data-dependent shapes
])
def test_auto_compiles_per_device_kind(device, steps, moe, expected):
    config = Config(**{**TINY, **(dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2) if moe else {})})
    assert auto_compiles(torch.device(device), config, steps) is expected

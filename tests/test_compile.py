"""Compiled training (`--compiler torch`): compiled equals eager over a few steps, activation checkpointing applied
before each block is compiled still compiles (dynamo's own graph counter), and what `--compiler auto` picks per
device kind."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.distributed.parallelize import apply_activation_checkpointing, compile_each_block, cpp_compiler_found
from litgpt.model import GPT
from litgpt.precision import Precision
from litgpt.train.launch import set_compilation
from litgpt.train.job import Job
from litgpt.train.loss import loss_function
from litgpt.train.recipe import Recipe

TINY = dict(name="tiny", block_size=32, vocab_size=64, padded_vocab_size=64, n_layer=2, n_embd=32, n_head=4,
            n_query_groups=2, intermediate_size=64, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", bias=False,
            parallel_residual=False, rotary_percentage=1.0)


def train_losses(model: GPT, steps: int, compile_loss: bool = False) -> list[float]:
    """Losses of `steps` AdamW steps (fused, as training builds it) on fixed random batches; with `compile_loss`,
    the loss function compiled whole, as the trainer does with `Job.compile_loss`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    loss = loss_function("cross_entropy")
    if compile_loss:
        loss = torch.compile(loss)
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


@pytest.mark.slow  # 20-100 s of compilation on 2 cores
def test_compiled_loss_trains_like_eager():
    """The whole loss compiled (forward, chunked head and cross-entropy in one graph): eager's losses and weights."""
    torch.manual_seed(0)
    eager = GPT(Config(**TINY))
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    expected, got = train_losses(eager, 3), train_losses(compiled, 3, compile_loss=True)
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # Inductor fuses the CPU's matmul attention's softmax and rounds it otherwise than eager; AdamW's normalized steps
    # (lr 1e-2) turn that into weight differences of up to ~3e-5 where a gradient is near zero: far below one step.
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=name)


def job_of(config: Config, max_steps) -> Job:
    return Job(recipe=Recipe(name="pretrain", config=config), out_dir=Path("out"), data=None,
               tokenizer_dir=Path("tokenizer"), train=TrainArgs(max_steps=max_steps, max_tokens=None),
               eval=EvalArgs(), hyperparameters={}, precision=Precision("32-true"))


@pytest.mark.parametrize(("compiler", "device", "world_size", "steps", "moe", "expected"), [
    ("auto", "cuda", 1, 2, False, "blocks"),  # compiled blocks: 1.33x eager on an H100
    ("auto", "cuda", 1, 2, True, "blocks"),
    ("auto", "cpu", 1, 2, False, "none"),  # a short run: compilation would outlast it
    ("auto", "cpu", 1, None, True, "none"),  # mixture-of-experts: its routing gives new shapes every step
    ("auto", "cpu", 1, 1000, False, "loss"),  # one CPU process: the whole loss, measured fastest
    ("auto", "cpu", 2, 1000, False, "blocks"),  # FSDP's hooks sit between the blocks
    ("torch", "cpu", 1, 2, True, "loss"),  # asked for: compiled whatever the run
    ("none", "cuda", 1, 1000, False, "none"),
])
def test_what_each_compiler_setting_compiles(compiler, device, world_size, steps, moe, expected):
    if expected != "none" and device == "cpu" and compiler == "auto" and not cpp_compiler_found():
        pytest.skip("no C++ compiler for inductor's CPU kernels: auto stays eager")
    moe_fields = dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2) if moe else {}
    job = job_of(Config(**{**TINY, **moe_fields}), steps)
    set_compilation(job, compiler, torch.device(device), world_size)
    assert (job.compile_loss, job.compile_blocks) == (expected == "loss", expected == "blocks")


def test_planned_steps_from_the_limits():
    assert TrainArgs(max_steps=7, max_tokens=None).planned_steps(256) == 7
    # max_tokens 10,000 at 4 x 256 tokens a step: 10 steps (the last one partial), the smaller limit wins
    assert TrainArgs(global_batch_size=4, micro_batch_size=4, max_steps=50, max_tokens=10_000).planned_steps(256) == 10
    assert TrainArgs(epochs=3, max_tokens=None).planned_steps(256) is None

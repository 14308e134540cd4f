"""The chunked output head + loss (`litgpt.train.loss`) against the plain computation on whole logits
(`F.cross_entropy` in float64), the memory it holds against what the plain one holds, and `--train.loss_chunk_size`
in a real training run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from test_training import SGD, assert_same_weights, pretrain, text_folder, weights  # noqa: F401 - a fixture too
from live_bytes import LiveBytes
from torch.utils._python_dispatch import TorchDispatchMode

from litgpt.config import Config
from litgpt.data.base import IGNORE_INDEX
from litgpt.lora import LoRALinear, LoRASettings, add_lora, mark_only_lora_as_trainable
from litgpt.model import GPT
from litgpt.train.loss import (
    MIN_CHUNK_POSITIONS,
    OutputHead,
    auto_chunk_size,
    chunked_head_loss,
    compiled_chunk_losses,
    cross_entropy,
    cross_entropy_chunk,
)
from litgpt.train.recipe import Recipe

B, T, C, V = 2, 9, 16, 40  # 18 positions


def inputs(dtype=torch.float32, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, C, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(V, C, generator=generator) / C**0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=generator) / 10).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, T), generator=generator)
    labels[0, :3] = IGNORE_INDEX
    labels[1, -1] = IGNORE_INDEX
    return hidden, weight, b, labels


def reference(hidden, weight, bias, labels, softcap=None, lora=None):
    """The plain computation: whole logits in float64, F.cross_entropy averaged over the labelled positions."""
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    if lora is not None:
        low_rank, lora_b = lora
        logits = logits + low_rank.double() @ lora_b.double().t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def chunked_mean(hidden, head: OutputHead, labels, chunk_size):
    total = chunked_head_loss(hidden, head, labels, cross_entropy_chunk, chunk_size)
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def gradients(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True, retain_graph=True)  # graphs may share a part


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# 18 positions: one per chunk, chunks that do not divide them, one chunk exactly, and a chunk larger than all.
CHUNKS = [1, 4, 5, 7, 18, 1000]


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_loss_and_gradients_equal_whole_logits(chunk_size, softcap):
    hidden, weight, bias, labels = inputs()
    tensors = (hidden, weight, bias)
    loss = chunked_mean(hidden, OutputHead(weight, bias, softcap=softcap), labels, chunk_size)
    expected = reference(hidden, weight, bias, labels, softcap)
    assert loss.dtype == torch.float32
    assert max_diff(loss, expected) < 1e-6
    for got, want in zip(gradients(loss, tensors), gradients(expected, tensors)):
        assert max_diff(got, want) < 1e-6


def test_a_batch_without_labels_has_loss_zero_and_zero_gradients():
    hidden, weight, bias, labels = inputs()
    labels = torch.full_like(labels, IGNORE_INDEX)
    loss = chunked_mean(hidden, OutputHead(weight, bias), labels, 5)
    assert loss.item() == 0.0
    for grad in gradients(loss, (hidden, weight, bias)):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_lora_head_gradients_reach_the_adapters():
    """A LoRA head with dropout: the adapters get the gradients of the whole-logits computation; its low-rank side,
    drawn once before the chunks, is the module's own update under the same random mask."""
    torch.manual_seed(0)
    head = LoRALinear(torch.nn.Linear(C, V, bias=True), r=4, alpha=8, dropout=0.2)
    torch.nn.init.normal_(head.lora_B, std=0.1)  # B starts at zero; make the update matter
    hidden, _, _, labels = inputs()
    params = (hidden, head.weight, head.bias, head.lora_A, head.lora_B)
    torch.manual_seed(1)
    tensors = OutputHead.of(head, hidden)
    torch.manual_seed(1)  # the same dropout mask
    module_out = head(hidden)
    own = F.linear(hidden, head.weight, head.bias) + tensors.lora_input @ tensors.lora_b.t()
    assert max_diff(own, module_out) < 1e-6
    loss = chunked_mean(hidden, tensors, labels, 4)
    expected = reference(hidden, head.weight, head.bias, labels, lora=(tensors.lora_input, tensors.lora_b))
    assert max_diff(loss, expected) < 1e-6
    for got, want in zip(gradients(loss, params), gradients(expected, params)):
        assert got is not None and max_diff(got, want) < 1e-6


def test_bf16_head_is_close_to_float32():
    hidden, weight, bias, labels = inputs()
    low = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight, bias)]
    loss = chunked_mean(low[0], OutputHead(low[1], low[2]), labels, 5)
    expected = reference(*low, labels)  # the same bf16 values, whole and in float64
    assert loss.dtype == torch.float32
    assert max_diff(loss, expected) < 2e-3
    for got, want in zip(gradients(loss, low), gradients(expected, low)):
        assert got.dtype == torch.bfloat16
        assert max_diff(got, want) < 0.02 * want.abs().max().item()


def test_under_autocast_the_head_runs_in_16_bits_and_float32_weights_get_float32_gradients():
    hidden, weight, bias, labels = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_mean(hidden, OutputHead(weight, bias), labels, 5)
        plain = cross_entropy(F.linear(hidden, weight, bias), labels)  # what the model's head did under autocast
    assert max_diff(loss, plain) < 1e-2
    got, want = gradients(loss, (weight,))[0], gradients(plain, (weight,))[0]
    assert got.dtype == torch.float32
    assert max_diff(got, want) < 0.02 * want.abs().max().item()


def test_auto_chunk_size():
    # Llama 3.2 3B, 2 x 4096 tokens: 8192 x 3072 / 128256 = 197 positions, raised to the floor.
    assert auto_chunk_size(8192, 3072, 128256) == MIN_CHUNK_POSITIONS
    assert auto_chunk_size(100_000, 4096, 32000) == 12800  # float32 logits of 12800 x 32000 = hidden 100000 x 4096
    assert auto_chunk_size(300, 64, 512) == 300  # never more than all positions


@pytest.mark.parametrize(("per_position", "softcap", "autocast"), [(False, 2.0, False), (True, None, True)])
def test_compiled_chunk_losses_equal_the_eager_ones_and_the_whole_logits(per_position, softcap, autocast):
    """`compiled_chunk_losses` (a GPU run that compiles its blocks): each chunk's loss and gradient run as one compiled
    function, with the same values and gradients as eager and as whole float64 logits, for the summed loss (the
    gradient taken in the forward pass) and the per-position one (made again in the backward pass, scaled per
    position); the compiled function is traced, and a second call with the same shapes reuses it."""
    hidden, weight, bias, labels = inputs()
    tensors = (hidden, weight, bias)
    scales = torch.linspace(0.5, 2.0, B * T).view(B, T)  # per-position losses reach the gradient with their own scale

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total = chunked_head_loss(hidden, OutputHead(weight, bias, softcap=softcap), labels, cross_entropy_chunk,
                                      5, per_position=per_position)
        return (total * scales).sum() if per_position else total

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them
    eager = loss()
    eager_grads = gradients(eager, tensors)
    with compiled_chunk_losses():
        compiled = loss()
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled_again = loss()
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames > 0
    assert max_diff(compiled, eager) < 1e-5 and max_diff(compiled_again, eager) < 1e-5
    for got, want in zip(gradients(compiled, tensors), eager_grads):
        assert max_diff(got, want) < 1e-5 * max(1.0, want.abs().max().item())
    if not autocast:
        expected = reference(hidden, weight, bias, labels, softcap) * (labels != IGNORE_INDEX).sum()
        assert max_diff(compiled, expected) < 1e-5


# ---- memory --------------------------------------------------------------------------------------------------------
class LogitMatmuls(TorchDispatchMode):
    """Counts the matrix products that make logits: outputs with `vocab` columns."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == self.vocab:
            self.count += 1
        return out


@pytest.mark.parametrize("chunk_size", [4, 18])
def test_a_summed_loss_makes_each_chunks_logits_once_a_per_position_one_again_in_its_backward(chunk_size):
    """The summed loss takes its gradients in the forward pass, while it holds the chunk's logits; preference
    optimization's per-position loss (each position's gradient differs) makes them again in the backward pass."""
    hidden, weight, bias, labels = inputs()
    chunks = -(-B * T // chunk_size)
    for per_position, expected in ((False, chunks), (True, 2 * chunks)):
        with LogitMatmuls(V) as counter:
            total = chunked_head_loss(hidden, OutputHead(weight, bias), labels, cross_entropy_chunk, chunk_size,
                                      per_position=per_position)
            total.sum().backward()
        assert counter.count == expected, (per_position, counter.count)
    with torch.no_grad(), LogitMatmuls(V) as counter:  # validation: the loss alone
        chunked_head_loss(hidden, OutputHead(weight, bias), labels, cross_entropy_chunk, chunk_size)
    assert counter.count == chunks


def test_memory_holds_one_chunk_of_logits_not_all():
    """Forward and backward of a large vocabulary: the plain loss holds (and saves) whole float32 logits, the
    chunked one never more than a few chunks' worth, and saves no logits at all."""
    vocab, chunk = 4096, 64
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 128, 32, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, 32, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 128), generator=generator)
    whole_logits = 2 * 128 * vocab * 4
    one_chunk = chunk * vocab * 4

    def run(loss_fn):
        saved = []
        with LiveBytes() as live, torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t):
            loss_fn().backward()
        return live.peak, sum(saved)

    plain_peak, plain_saved = run(lambda: cross_entropy(F.linear(hidden, weight), labels))
    chunked_peak, chunked_saved = run(lambda: chunked_mean(hidden, OutputHead(weight), labels, chunk))
    # The plain backward begins with the float32 logits, their log-softmax and its gradient alive together.
    assert plain_peak >= 3 * whole_logits and plain_saved >= whole_logits
    # One chunk's float32 logits (becoming their gradient) beside the gradients of the hidden states and the weight,
    # and a transposed copy of the weight the CPU's matmul makes: nothing grows with positions x vocabulary.
    others = hidden.numel() * 4 + 2 * weight.numel() * 4 + 2**16
    assert chunked_peak <= one_chunk + others, (chunked_peak, one_chunk, others)
    assert chunked_saved < one_chunk  # the hidden states and the labels


# ---- through the model and the recipe ----------------------------------------------------------------------------
TINY = dict(block_size=32, vocab_size=50, padded_vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_query_groups=2,
            intermediate_size=48, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")


@pytest.mark.parametrize(("variant", "lora_head", "compiled_chunks"), [
    (dict(), False, False),
    (dict(tie_embeddings=True), False, False),
    (dict(lm_head_bias=True, bias=True, final_logit_softcapping=5.0), False, False),
    (dict(), True, False),
    (dict(lm_head_bias=True, bias=True, final_logit_softcapping=5.0), True, False),
    (dict(lm_head_bias=True, bias=True, final_logit_softcapping=5.0), True, True),
])
def test_a_training_step_through_the_recipe_equals_the_whole_logits_path(variant, lora_head, compiled_chunks):
    """The recipe's loss (chunked, several chunks) against the plain path (`model(x)`, `cross_entropy`): the same loss
    and every parameter's gradient, padded vocabulary rows included (LoRA does not adapt a tied head); also with the
    objective's chunk losses compiled (`with_compiled_chunk_losses`, a GPU run that compiles its blocks)."""
    config = Config(**TINY, **variant)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    if lora_head:
        add_lora(model, LoRASettings(head=True, dropout=0.0))
        mark_only_lora_as_trainable(model)
        torch.nn.init.normal_(model.lm_head.lora_B, std=0.1)
    x = torch.randint(0, config.vocab_size, (2, 24))
    y = torch.randint(0, config.vocab_size, (2, 24))
    y[1, :5] = IGNORE_INDEX
    recipe = Recipe(name="pretrain", config=config, lora=LoRASettings(head=True) if lora_head else None)
    params = [p for p in model.parameters() if p.requires_grad]

    objective = recipe.objective({}, chunk_size=10)
    if compiled_chunks:
        objective = objective.with_compiled_chunk_losses()
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()  # reset() keeps them
    loss = objective.train_loss(model, {"input_ids": x, "labels": y})["loss"]
    if compiled_chunks:  # the chunks' function was traced
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    chunked_grads = torch.autograd.grad(loss, params)
    expected = cross_entropy(model(x), y)
    expected_grads = torch.autograd.grad(expected, params)
    assert abs(loss.item() - expected.item()) < 1e-6
    for got, want in zip(chunked_grads, expected_grads):
        assert max_diff(got, want) < 1e-6
    if lora_head:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert "lm_head.lora_A" in names and "lm_head.lora_B" in names


def test_the_option_reaches_training_and_is_recorded(tmp_path, text_folder, monkeypatch):
    """`--train.loss_chunk_size 5` (13 chunks of a 2 x 32 micro-batch) reaches the training and validation losses,
    trains to the weights and validation loss of the automatic size (one chunk here), and the run records it."""
    import litgpt.train.loss as loss_module

    sizes = []

    def recording(*args, **kwargs):  # the real function, its chunk size noted
        sizes.append(args[4] if len(args) > 4 else kwargs.get("chunk_size"))
        return chunked_head_loss(*args, **kwargs)

    monkeypatch.setattr(loss_module, "chunked_head_loss", recording)
    pretrain(tmp_path / "chunked", text_folder, max_steps=3, optimizer=SGD, loss_chunk_size=5)
    assert sizes and set(sizes) == {5}
    sizes.clear()
    pretrain(tmp_path / "automatic", text_folder, max_steps=3, optimizer=SGD)
    assert sizes and set(sizes) == {None}
    assert_same_weights(weights(tmp_path / "chunked" / "final"), weights(tmp_path / "automatic" / "final"), 1e-6)
    losses = [json.loads((tmp_path / run / "metrics.json").read_text())["val_loss"] for run in ("chunked", "automatic")]
    assert abs(losses[0] - losses[1]) < 1e-5
    hparams = yaml.safe_load((tmp_path / "chunked" / "final" / "hyperparameters.yaml").read_text())
    assert hparams["train"]["loss_chunk_size"] == 5

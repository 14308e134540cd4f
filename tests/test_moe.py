"""The mixture-of-experts layer: grouped experts against the per-expert loop they replace and against transformers'
Mixtral / Qwen3-MoE blocks (forward and gradients), no host sync in the forward pass, what autograd keeps, LoRA on
the experts, and the router's load-balancing loss against transformers' `load_balancing_loss_func`."""

from __future__ import annotations

import functools

import pytest
import torch
from test_model import _hf_moe_block
from torch.utils._python_dispatch import TorchDispatchMode

from litgpt.config import Config
from litgpt.convert.families.configs import config_from_hf, config_to_hf
from litgpt.distributed.parallelize import apply_activation_checkpointing
from litgpt.lora import LoRASettings, add_lora
from litgpt.model import GPT
from litgpt.moe import LLaMAMoE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, vocab_size=100, padded_vocab_size=128, block_size=32,
            mlp_class_name="LLaMAMoE", moe_intermediate_size=32)


def loop_reference(moe: LLaMAMoE, x: torch.Tensor) -> torch.Tensor:
    """The algorithm the grouped layer replaced: every expert module on the tokens that chose it, found with
    torch.where (a host sync per expert), its output weighted and added at those tokens."""
    B, T, C = x.shape
    x = x.reshape(-1, C)
    router = torch.softmax(moe.gate(x), dim=-1, dtype=torch.float32)
    weights, chosen = router.topk(moe.config.n_expert_per_token, dim=-1)
    if moe.config.moe_renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for expert_idx, expert in enumerate(moe.experts):
        token_idx, slot = torch.where(chosen == expert_idx)
        if token_idx.numel() == 0:
            continue
        out.index_add_(0, token_idx, expert(x[token_idx]) * weights[token_idx, slot, None])
    return out.view(B, T, C)


def make_moe(dtype=torch.float64, n_expert=4, k=2, renormalize=True, seed=0, **overrides) -> LLaMAMoE:
    """An MoE layer with weights of order one; the last expert's router row is so negative that it gets no token of
    `positive_input`."""
    torch.manual_seed(seed)
    config = Config(**{**BASE, **overrides}, n_expert=n_expert, n_expert_per_token=k, moe_renormalize=renormalize)
    moe = LLaMAMoE(config).to(dtype)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            param.normal_(0, 0.5 if name == "gate.weight" else 0.2)
        moe.gate.weight[-1] = -1.0
    return moe


def positive_input(*shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).abs() + 0.1


def outputs_and_grads(fn, moe: LLaMAMoE, x: torch.Tensor):
    """fn(moe, x), and the gradients of a fixed random projection of it for the input and every parameter."""
    moe.zero_grad()
    x = x.detach().requires_grad_()
    out = fn(moe, x)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)).sum().backward()
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in moe.named_parameters() if p.grad is not None}


def assert_same(actual, expected, tol: float) -> None:
    """Equal within `tol` of each tensor's largest reference value; a missing gradient counts as zero."""
    (out, x_grad, grads), (ref_out, ref_x_grad, ref_grads) = actual, expected
    pairs = [("output", out, ref_out), ("input grad", x_grad, ref_x_grad)]
    pairs += [(name, grads.get(name), ref_grads.get(name)) for name in grads.keys() | ref_grads.keys()]
    for name, a, b in pairs:
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, atol=tol * max(1.0, b.abs().max().item()), rtol=0, msg=name)


def kernel_of(moe: LLaMAMoE, x: torch.Tensor) -> str:
    return moe._kernel(x, x.dtype)



# ---- equal to the loop, forward and gradients ------------------------------------------------------------------------
@pytest.mark.parametrize(("k", "renormalize"), [(1, True), (2, True), (2, False), (3, False)])
@pytest.mark.parametrize(
    ("dtype", "overrides", "kernel"),
    [
        (torch.float32, {}, "grouped"),  # torch._grouped_mm on the CPU
        (torch.float64, {}, "blocks"),  # no grouped kernel for float64: the padded-block bmm
        (torch.float32, {"moe_intermediate_size": 30}, "blocks"),  # rows of 120 bytes: not 16-byte aligned
    ],
)
def test_grouped_moe_equals_the_loop(dtype, overrides, kernel, k, renormalize):
    moe = make_moe(dtype, n_expert=5, k=k, renormalize=renormalize, **overrides)
    x = positive_input(3, 7, 64, dtype=dtype)
    assert kernel_of(moe, x) == kernel
    chosen = moe.gate(x.reshape(-1, 64)).topk(k, dim=-1).indices.unique().tolist()
    assert 4 not in chosen and len(chosen) > 1  # one expert idles, several work
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    grouped = outputs_and_grads(LLaMAMoE.__call__, moe, x)
    assert grouped[2]["experts.4.fc_1.weight"].abs().max() == 0  # the idle expert's gradient: zero, not missing
    assert_same(grouped, outputs_and_grads(loop_reference, moe, x), tol)


def test_bf16_runs_grouped_and_matches_the_loop():
    """bf16 is the dtype the layer runs torch._grouped_mm in for real; the loop runs the same bf16 matmuls per expert
    (bf16 rounding only: each product is accumulated in float32 by both)."""
    moe = make_moe(torch.bfloat16)
    x = positive_input(2, 9, 64, dtype=torch.bfloat16)
    assert kernel_of(moe, x) == "grouped"
    assert_same(outputs_and_grads(LLaMAMoE.__call__, moe, x), outputs_and_grads(loop_reference, moe, x), 2e-2)


def test_autocast_runs_the_experts_in_its_dtype():
    """Under autocast (bf16-mixed on one device) the experts compute in bf16, as the loop's nn.Linear calls do."""
    moe = make_moe(torch.float32)
    x = positive_input(2, 9, 64, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, loop = outputs_and_grads(LLaMAMoE.__call__, moe, x), outputs_and_grads(loop_reference, moe, x)
    assert ours[0].dtype == loop[0].dtype == torch.float32  # the sum of the weighted experts, in x's dtype
    assert_same(ours, loop, 2e-2)


def test_blocks_with_many_rows_per_expert_equal_the_loop():
    """More rows than one block per expert (the block size follows the mean rows per expert)."""
    moe = make_moe(torch.float64, n_expert=3, k=2)
    x = torch.randn(4, 32, 64, dtype=torch.float64)
    assert assert_same(outputs_and_grads(LLaMAMoE.__call__, moe, x), outputs_and_grads(loop_reference, moe, x),
                       1e-12) is None


def test_lora_on_the_experts_equals_the_loop():
    """LoRA adapters on every expert linear (litgpt.lora) run inside the grouped multiplication: equal to the expert
    modules (LoRALinear) run one by one, and the adapters get the same gradients."""
    torch.manual_seed(0)
    config = Config(**BASE, n_expert=4, n_expert_per_token=2)
    model = GPT(config).double()
    model.init_weights()
    add_lora(model, LoRASettings(r=8, alpha=16, dropout=0.0, query=False, value=False, mlp=True))
    moe = model.transformer.h[0].mlp
    with torch.no_grad():
        for name, param in moe.named_parameters():
            param.normal_(0, 0.5 if name == "gate.weight" else 0.2)  # B too: the adapters change the output
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    grouped, loop = outputs_and_grads(LLaMAMoE.__call__, moe, x), outputs_and_grads(loop_reference, moe, x)
    assert any("lora_B" in name for name in grouped[2])
    assert_same(grouped, loop, 1e-12)
    x32 = x.float()
    assert kernel_of(moe.float(), x32) == "grouped"  # rank 8: 16-byte rows
    assert_same(outputs_and_grads(LLaMAMoE.__call__, moe, x32), outputs_and_grads(loop_reference, moe, x32), 1e-6)


# ---- equal to transformers' blocks -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("n_expert", "k", "renormalize"), [(4, 2, True), (8, 3, True), (4, 1, False), (8, 3, False)])
def test_grouped_moe_equals_transformers_forward_and_gradients(n_expert, k, renormalize):
    """Mixtral's block (renormalized) and Qwen3-MoE's (not), weights copied across (transformers 5 fuses them)."""
    moe = make_moe(torch.float32, n_expert=n_expert, k=k, renormalize=renormalize)
    hf = _hf_moe_block(moe.config, moe)
    x = torch.randn(2, 9, 64)
    ours = outputs_and_grads(LLaMAMoE.__call__, moe, x)
    out, x_grad, grads = outputs_and_grads(lambda _, x: hf(x), moe, x)  # moe's own grads stay None here
    hf_grads = {"gate.weight": hf.gate.weight.grad}
    for e in range(n_expert):
        fc_1, fc_2 = hf.experts.gate_up_proj.grad[e].split(32)
        hf_grads.update({f"experts.{e}.fc_1.weight": fc_1, f"experts.{e}.fc_2.weight": fc_2,
                         f"experts.{e}.proj.weight": hf.experts.down_proj.grad[e]})
    assert_same(ours, (out, x_grad, hf_grads), 1e-5)


# ---- no host sync, and what the backward pass keeps ------------------------------------------------------------------
class HostReads(TorchDispatchMode):
    """Records the operations that read a device value back to the host (.item(), .tolist(), bool(), nonzero)."""

    SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING:
            self.calls.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_forward_reads_nothing_back_to_the_host(dtype):
    moe = make_moe(dtype)
    x = torch.randn(2, 9, 64, dtype=dtype)
    with HostReads() as reads:
        moe(x)
    assert reads.calls == []
    with HostReads() as reads:
        loop_reference(moe, x)
    assert torch.ops.aten.nonzero.default in reads.calls  # the check sees the loop's syncs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_backward_keeps_no_stacked_copy_of_the_experts(dtype):
    """Autograd keeps the parameters themselves, never a stacked copy of them: what the layer saves beyond the
    parameters is its activations, which do not grow with the number of experts."""
    saved = {}
    for n_expert in (4, 16):
        moe = make_moe(dtype, n_expert=n_expert, k=2)
        params = {p.untyped_storage().data_ptr() for p in moe.parameters()}
        stacked = n_expert * 32 * 64
        tensors = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: tensors.append(t) or t, lambda t: t):
            moe(torch.randn(2, 9, 64, dtype=dtype, requires_grad=True))
        others = [t for t in tensors if t.untyped_storage().data_ptr() not in params]
        assert all(t.numel() < stacked for t in others), [t.shape for t in others]
        saved[n_expert] = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in others}.values())
    # 16 experts instead of 4: only the router's (tokens, n_expert) probabilities and the (n_expert,) routing grow.
    growth = 18 * 12 * 4 + 12 * 8 + (0 if dtype == torch.bfloat16 else 2 * 12 * 64 * 32 * 8)
    assert saved[16] - saved[4] <= growth, saved


# ---- the load-balancing loss -----------------------------------------------------------------------------------------
def tiny_model(coef: float, **overrides) -> GPT:
    torch.manual_seed(0)
    model = GPT(Config(**{**BASE, **overrides}, n_expert=4, n_expert_per_token=2, router_aux_loss_coef=coef))
    model.init_weights()
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.gate.weight.normal_(0, 0.5)
    return model


def test_router_aux_loss_equals_transformers():
    """Against transformers' load_balancing_loss_func on the router logits of the same forward pass (captured at
    `mlp.gate`), value and gradient for the routers."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = tiny_model(0.02, n_layer=3)
    logits = []
    for block in model.transformer.h:
        block.mlp.gate.register_forward_hook(lambda module, args, out: logits.append(out))
    model(torch.randint(0, 100, (2, 11)))
    ours = model.router_aux_loss()
    expected = 0.02 * load_balancing_loss_func(tuple(logits), num_experts=4, top_k=2)
    torch.testing.assert_close(ours, expected, atol=1e-7, rtol=1e-6)
    gates = [block.mlp.gate.weight for block in model.transformer.h]
    for a, b in zip(torch.autograd.grad(ours, gates, retain_graph=True), torch.autograd.grad(expected, gates)):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-5)
    assert ours > 0.02 * 0.99  # its minimum, for a perfectly balanced router, is the coefficient itself


def test_router_aux_loss_is_none_without_moe_or_coefficient():
    assert tiny_model(0.0).router_aux_loss() is None
    dense = GPT(Config(**{**BASE, "mlp_class_name": "LLaMAMLP"}))
    dense(torch.zeros(1, 4, dtype=torch.long))
    assert dense.router_aux_loss() is None
    with pytest.raises(RuntimeError, match="forward pass"):
        tiny_model(0.01).router_aux_loss()


class GroupedMatmuls(TorchDispatchMode):
    """Counts the experts' grouped matrix multiplications (torch's, or litgpt's op around it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in (torch.ops.aten._grouped_mm.default, torch.ops.litgpt.grouped_mm.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("checkpointing", ["full", "ops"])
def test_router_aux_loss_with_activation_checkpointing(checkpointing):
    """The recomputation in the backward pass leaves the loss of the forward pass in place: the gradients of the
    total loss equal those of a model that keeps every activation. Op-level checkpointing keeps the experts'
    matmuls: its backward pass runs no more of them than without checkpointing; full checkpointing reruns them."""
    tokens = torch.randint(0, 100, (2, 11))
    grads, backward_matmuls = [], []
    for checkpointed in (False, True):
        model = tiny_model(0.5)
        if checkpointed:
            apply_activation_checkpointing(model, checkpointing)
        loss = model(tokens).logsumexp(-1).mean() + model.router_aux_loss()
        recorded = [block.mlp.router_stats.prob_sum for block in model.transformer.h]
        with GroupedMatmuls() as counter:
            loss.backward()
        backward_matmuls.append(counter.calls)
        assert [block.mlp.router_stats.prob_sum for block in model.transformer.h] == recorded
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)
    assert backward_matmuls[0] > 0
    if checkpointing == "ops":
        assert backward_matmuls[1] == backward_matmuls[0]
    else:
        assert backward_matmuls[1] > backward_matmuls[0]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_coef_round_trips_through_conversion(model_type):
    config = Config(**{**BASE, "hf_model_type": model_type, "norm_qk": model_type == "qwen3_moe"},
                    n_expert=4, n_expert_per_token=2, router_aux_loss_coef=0.02)
    hf = config_to_hf(config)
    assert hf["router_aux_loss_coef"] == 0.02
    assert config_from_hf(hf).router_aux_loss_coef == 0.02
    del hf["router_aux_loss_coef"]  # transformers' default for both families
    assert config_from_hf(hf).router_aux_loss_coef == 0.001


def test_published_coefficients():
    assert Config.from_name("Mixtral-8x7B-v0.1").router_aux_loss_coef == 0.02
    assert Config.from_name("Qwen3-30B-A3B").router_aux_loss_coef == 0.001


# ---- FSDP2 with activation checkpointing -----------------------------------------------------------------------------
def _total_loss(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).logsumexp(-1).mean() + model.router_aux_loss()


def _fsdp_rank(rank: int, port: int, make_models: tuple, tokens: list, expected: list[dict]) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for make_model, expected_grads in zip(make_models, expected):  # one model after the other, in one group
            model = make_model()
            apply_activation_checkpointing(model, "full")
            for block in model.transformer.h:
                fully_shard(block)
            fully_shard(model)
            _total_loss(model, tokens[rank]).backward()
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad.full_tensor(), expected_grads[name], atol=1e-6, rtol=1e-5,
                                           msg=name)
    finally:
        dist.destroy_process_group()


def check_fsdp2_with_checkpointing_equals_one_process(*make_models) -> list[dict]:
    """Two ranks, each block of every `make_model()` sharded (FSDP2 unshards it around its forward and backward) and
    checkpointed: the gradients of a cross-entropy-like loss + router loss equal the mean of one process' over the
    ranks' batches. The models are checked one after the other in one launch of the two ranks; each `make_model`
    must be picklable (a module-level function). Returns one process' gradients of each model."""
    from ports import free_port

    tokens = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(rank)) for rank in range(2)]
    expected = []
    for make_model in make_models:
        model = make_model()
        for batch in tokens:
            (_total_loss(model, batch) / 2).backward()
        expected.append({name: param.grad for name, param in model.named_parameters()})
    from forked_ranks import rank_start_method

    torch.multiprocessing.start_processes(_fsdp_rank, args=(free_port(), make_models, tokens, expected), nprocs=2,
                                          start_method=rank_start_method())
    return expected


@pytest.mark.slow
def test_fsdp2_with_checkpointing_equals_one_process():
    """On the Mixtral-style tiny model and on test_deepseek_moe_commands' DeepSeek-style one (a dense layer, routers
    with groups and correction bias, routed and shared experts), in one launch of two ranks: every parameter gets one
    process' gradient. (The DeepSeek-style check had a launch of its own in that module.)"""
    from test_deepseek_moe_commands import fsdp_model

    _, deepseek = check_fsdp2_with_checkpointing_equals_one_process(functools.partial(tiny_model, 0.1), fsdp_model)
    assert deepseek["transformer.h.2.mlp.shared_experts.fc_1.weight"].abs().sum() > 0

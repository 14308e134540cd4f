"""Context parallelism (`--parallel.context`, Ulysses' head scatter) with real processes on the CPU (gloo), against
one process: the model and loss split by positions, CP2 pretraining, CP2 x TP2, a CP2 checkpoint resumed in one
process, the mesh, and the refusals. In float32 (`--precision 32-true`), as tests/test_tensor_parallel.py explains."""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch
import torch.distributed as dist
from test_distributed import (
    SMALL,
    assert_close_runs,
    assert_resumed_where_it_stopped,
    assert_same_final,
    assert_same_hugging_face_folder,
    child_environment,
    command_args,
    inputs,  # noqa: F401 (the module-scoped fixture, shared)
    litgpt,
    write_config,
)
from test_tensor_parallel import (
    EVERY_ADAPTER,
    FAMILIES,
    assert_refused_before_writing,
    gloo_rank,
    lora_one_process,  # noqa: F401 (the module-scoped fixture)
    run_spawned_ranks,
)

from litgpt.config import Config
from litgpt.distributed.topology import Topology

FLOAT32 = ["--precision", "32-true"]
CP2 = ["--devices", "2", "--parallel.context", "2", *FLOAT32]

# Routers with a load-balancing loss: its statistics are the whole sequence's, summed over the group.
MOE = dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=32,
           router_aux_loss_coef=0.05)
# DeepSeek-V3's shape (test_tensor_parallel.FAMILIES), with a load-balancing loss.
DEEPSEEK_V3 = {**FAMILIES["deepseek-v3"], "router_aux_loss_coef": 0.05}
# gpt-oss's shape: a sink per head, every other layer sliding, biased experts, the clamped SwiGLU.
GPT_OSS = dict(MOE, attention_sinks=True, sliding_window_size=16, sliding_window_pattern=2, bias=True,
               router_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0)
# Phi-3's LongRoPE, with the switch to the long factors at position 32: a sequence of 63 positions rotates by the long
# factors everywhere, also on the rank whose slice ends before position 32.
LONGROPE = dict(rope_scaling={"type": "longrope", "factor": 4.0, "original_max_position_embeddings": 32,
                              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                              "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0]})


@pytest.fixture(scope="module")
def runs(inputs) -> dict:  # noqa: F811
    """The launches the tests share: pretraining in one process (the reference) and over a CP2 group."""
    out = {"one": inputs["root"] / "cp-one", "cp2": inputs["root"] / "cp-two"}
    for name, flags in (("one", ["--devices", "1", *FLOAT32]), ("cp2", CP2)):
        start = time.perf_counter()
        result = litgpt(*command_args("pretrain", inputs, out[name]), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        # The mesh FSDP shards over is laid out from the flattened one, not sliced by its name from the root mesh
        # (deprecated: `Topology.fsdp_device_mesh`)
        assert "Slicing a flattened dim" not in result.stderr, result.stderr[-3000:]
        print(f"{name}: {time.perf_counter() - start:.1f} s")
    return out


@pytest.mark.slow
def test_context_parallel_pretraining_equals_one_process(runs):
    assert_close_runs(runs["cp2"], runs["one"], "lit_model.pth")
    assert json.loads((runs["cp2"] / "metrics.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_a_context_parallel_checkpoint_resumes_in_one_process(inputs, runs, tmp_path):  # noqa: F811
    out_dir = tmp_path / "resumed"
    result = litgpt(*command_args("pretrain", inputs, out_dir), "--devices", "1", *FLOAT32,
                    "--resume", runs["cp2"] / "step-000002")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_final(out_dir, runs["one"], "lit_model.pth", atol=1e-4)


@pytest.mark.slow
def test_a_sharded_context_parallel_checkpoint_resumes_in_one_process(inputs, runs, tmp_path):  # noqa: F811
    cp2 = inputs["root"] / "cp-two-sharded"
    result = litgpt(*command_args("pretrain", inputs, cp2), *CP2, "--fsdp.state_dict_type", "sharded")
    assert result.returncode == 0, result.stderr[-3000:]
    out_dir = tmp_path / "resumed"
    result = litgpt(*command_args("pretrain", inputs, out_dir), "--devices", "1", *FLOAT32,
                    "--resume", cp2 / "step-000002")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_resumed_where_it_stopped(out_dir, runs["one"])
    assert_same_hugging_face_folder(cp2 / "step-000002", runs["one"] / "step-000002", tmp_path / "converted")


# ---- the model and the loss split by positions ---------------------------------------------------------------------
def split_by_positions_matches_whole(rank: int, world: int, port: int, failures) -> None:
    """On each rank: a model whose attention gathers the positions, on its slice of a batch of an odd length
    (padded), whole or packed, gives one process's loss, and its gradients averaged over the group (as FSDP does)
    one process's; with LongRoPE too, whose packed rows here choose different factors (the first row's longest sample
    reaches position 32, the second's stops at 31)."""
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_rank(rank, world, port, failures):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("context",))
        for changes in ({}, LONGROPE):
            split_by_positions_matches(mesh, {**SMALL, **changes})


def split_by_positions_matches(mesh, config: dict, ring: bool = False) -> None:
    """`split_by_positions_matches_whole` for the model of `config`."""
    from litgpt.distributed.context_parallel import ContextParallel, apply_context_parallel
    from litgpt.model import GPT
    from litgpt.train.loss import loss_function
    from litgpt.train.objective import on_local_positions
    from litgpt.train.recipe import batch_loss

    torch.manual_seed(0)
    whole = GPT(Config(**config))
    whole.init_weights()
    split = GPT(Config(**config))
    split.load_state_dict(whole.state_dict())
    group = ContextParallel(mesh, ring=ring)
    apply_context_parallel(split, group)
    generator = torch.Generator().manual_seed(1)
    idx, labels = (torch.randint(0, 4096, (2, 63), generator=generator) for _ in range(2))
    labels[0, :40] = -100  # the ranks hold different numbers of labelled positions
    packed = torch.stack([torch.cat((torch.arange(30), torch.arange(33))),
                          torch.cat((torch.arange(31), torch.arange(32)))])
    for positions in (None, packed):
        batch = {"input_ids": idx, "labels": labels, **({} if positions is None else {"positions": positions})}
        loss = batch_loss(loss_function("cross_entropy"))
        whole.zero_grad(), split.zero_grad()
        expected, actual = loss(whole, batch)["loss"], on_local_positions(loss, group)(split, batch)
        expected.backward()
        actual["loss"].backward()
        torch.testing.assert_close(actual["loss"], expected, rtol=0, atol=1e-6)
        split_params = dict(split.named_parameters())
        for key, param in whole.named_parameters():
            grad = split_params[key].grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad / mesh.size(), param.grad, rtol=1e-5, atol=1e-6, msg=key)


def cpu_flash_attention_kernels() -> list:
    """CPU kernels for the fused attention ops PyTorch's ring attention calls on each pair of slices
    (`aten._scaled_dot_product_flash_attention` and its backward: CUDA-only ops) from its CPU flash kernels, so that
    the ring runs here as it does on CUDA; the list records each forward call. For this process only."""
    aten, calls = torch.ops.aten, []
    library = torch.library.Library("aten", "IMPL")

    def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        calls.append(q.shape)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
        none, empty = q.new_zeros(()), q.new_empty(0)  # what CUDA's kernel leaves undefined for whole sequences
        return out, lse, none, none, q.size(2), k.size(2), empty, none, empty

    def flash_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                       scale=None):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, dropout_p,
                                                                         is_causal, scale=scale)

    library.impl("_scaled_dot_product_flash_attention", flash, "CPU")
    library.impl("_scaled_dot_product_flash_attention_backward", flash_backward, "CPU")
    cpu_flash_attention_kernels.library = library  # registered while it lives
    return calls


def ring_attention_matches_whole(rank: int, world: int, port: int, failures) -> None:
    """On each rank: PyTorch's ring attention (`--parallel.context_attention auto` on CUDA; here on CPU kernels of
    the same ops, `cpu_flash_attention_kernels`) in every layer of a model with grouped keys: one process's loss and,
    averaged over the group, its gradients, for whole sequences (the ring runs: each layer's queries meet the keys of
    both ranks' slices) and packed ones (the head scatter runs them)."""
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_rank(rank, world, port, failures):
        calls = cpu_flash_attention_kernels()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("context",))
        split_by_positions_matches(mesh, SMALL, ring=True)
        # Rank r's queries meet the keys of ranks 0..r (a later rank's are all in their future), in every layer.
        assert len(calls) == SMALL["n_layer"] * (rank + 1), calls


def split_over_context_and_tensor_matches_whole(rank: int, world: int, port: int, failures) -> None:
    """On each of 4 ranks, a (context 2, tensor 2) mesh: a model split by the tensor-parallel plan over the tensor
    dimension and by positions over the context dimension (each rank one slice of positions and half the heads of its
    tensor group's half) gives one process's loss, and its gradients, gathered over the tensor group and averaged over
    the context group (as FSDP over the data x context ranks does), one process's: a dense Llama, and gpt-oss's shape
    (sinks split by heads twice, sliding windows, biased experts with a load-balancing loss), and DeepSeek-V3's
    (latent attention: the latents gathered, each rank expanding its heads' keys and values from them; a dense first
    layer, a shared expert)."""
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_rank(rank, world, port, failures):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("context", "tensor"))
        for changes in ({}, GPT_OSS, DEEPSEEK_V3):  # one key-value group per rank of the 2 x 2 split
            context_and_tensor_split_matches(mesh, {**SMALL, "n_query_groups": 4, **changes})


def context_and_tensor_split_matches(mesh, changes: dict) -> None:
    """`split_over_context_and_tensor_matches_whole` for the model of `changes`."""
    from test_tensor_parallel import split_copy, whole_model

    from litgpt.distributed.context_parallel import ContextParallel, apply_context_parallel
    from litgpt.distributed.dtensor import gather_full
    from litgpt.train.loss import loss_function
    from litgpt.train.objective import on_local_positions
    from litgpt.train.recipe import batch_loss

    whole = whole_model(changes)
    split, orders = split_copy(whole, mesh["tensor"])
    group = ContextParallel(mesh["context"], tensor=2)
    apply_context_parallel(split, group)
    if "kv_lora_rank" in changes:  # latent attention exchanges its latents (every head's keys and values stay home)
        assert all(block.attn.expand.__name__ == "expand_my_heads" for block in split.transformer.h)
    generator = torch.Generator().manual_seed(1)
    idx, labels = (torch.randint(0, 4096, (2, 63), generator=generator) for _ in range(2))
    labels[0, :40] = -100  # the context ranks hold different numbers of labelled positions
    batch = {"input_ids": idx, "labels": labels}
    loss = batch_loss(loss_function("cross_entropy"))
    expected, actual = loss(whole, batch)["loss"], on_local_positions(loss, group)(split, batch)["loss"]
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)  # float32: summed in other orders
    split_params = dict(split.named_parameters())
    for key, param in whole.named_parameters():
        if param.grad is None:
            continue
        grad = gather_full(split_params[key].grad, orders.get(key)).clone()
        dist.all_reduce(grad, group=mesh["context"].get_group())
        torch.testing.assert_close(grad / 2, param.grad, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow  # spawns 2 or 4 processes
@pytest.mark.parametrize("world, worker", [(2, split_by_positions_matches_whole), (2, ring_attention_matches_whole),
                                           (4, split_over_context_and_tensor_matches_whole)],
                         ids=["cp2", "cp2-ring", "cp2xtp2"])
def test_a_model_split_by_positions_equals_the_whole_model(world, worker):
    """CP2 (head scatter, and ring attention), and CP2 x TP2 (4 processes; a CLI run would need 4 CPU cores on one
    node, since a context group stays within a node beside its tensor group, and litgpt starts no more CPU processes
    than cores)."""
    run_spawned_ranks(worker, world)


CP2_TP2_MODEL = {**SMALL, "n_query_groups": 4}  # one key-value group per rank of the 2 x 2 split


def one_training_step(model, loss, optimizer_of) -> "torch.optim.Optimizer":
    """One AdamW step of `model` on a fixed packed batch of an odd length, its labels partly ignored; the optimizer."""
    generator = torch.Generator().manual_seed(1)
    idx, labels = (torch.randint(0, 4096, (2, 63), generator=generator) for _ in range(2))
    labels[0, :40] = -100
    positions = torch.cat((torch.arange(30), torch.arange(33))).expand(2, 63)  # two packed samples
    batch = {"input_ids": idx, "labels": labels, "positions": positions}
    optimizer = optimizer_of(model)
    loss(model, batch)["loss"].backward()
    optimizer.step()
    return optimizer


def adamw(model) -> "torch.optim.Optimizer":
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)


def sharded_save_over_context_and_tensor(rank: int, world: int, port: int, failures, folder) -> None:
    """On each of 4 ranks, the run's mesh for --devices 4 --parallel.context 2 --parallel.tensor 2 (FULL_SHARD): the
    model split by the tensor-parallel plan and by positions, FSDP-sharded over the context ranks, takes one AdamW
    step and writes a sharded checkpoint to `folder`, as the checkpoint manager does."""
    from test_tensor_parallel import split_copy

    from litgpt.args import FSDPArgs
    from litgpt.checkpoint.fsdp_io import FSDPCheckpointIO
    from litgpt.distributed.context_parallel import ContextParallel, apply_context_parallel
    from litgpt.distributed.fsdp import shard_model
    from litgpt.model import GPT
    from litgpt.precision import Precision
    from litgpt.train.loss import loss_function
    from litgpt.train.objective import on_local_positions
    from litgpt.train.recipe import batch_loss

    with gloo_rank(rank, world, port, failures):
        torch.manual_seed(0)
        whole = GPT(Config(**CP2_TP2_MODEL))
        whole.init_weights()
        topology = Topology(4, 1, "FULL_SHARD", tensor=2, context=2)
        mesh = topology.device_mesh("cpu")
        split, _ = split_copy(whole, mesh["tensor"])
        group = ContextParallel(mesh["context"], tensor=2)
        apply_context_parallel(split, group)
        shard_model(split, topology.fsdp_device_mesh(mesh), FSDPArgs(), Precision.resolve("32-true"),
                    torch.device("cpu"))
        loss = on_local_positions(batch_loss(loss_function("cross_entropy")), group)
        optimizer = one_training_step(split, loss, adamw)
        FSDPCheckpointIO("FULL_SHARD", "sharded").save_sharded(folder, split, optimizer, lambda key: True)


@pytest.mark.slow  # spawns 4 processes
def test_a_sharded_checkpoint_of_context_and_tensor_parallelism_loads_in_one_process(tmp_path):
    """TP2 x CP2 (x FSDP2 over the context ranks) saves a sharded checkpoint after one step; one process reads it
    (weights, the fused qkv in one process's row order, and the optimizer's moments) and holds what one process's
    own step gives. (A CLI run would need 4 CPU cores: see the test above.)"""
    from litgpt.checkpoint.fsdp_io import FSDPCheckpointIO
    from litgpt.model import GPT
    from litgpt.train.loss import loss_function
    from litgpt.train.recipe import batch_loss

    run_spawned_ranks(functools.partial(sharded_save_over_context_and_tensor, folder=tmp_path), 4)
    torch.manual_seed(0)
    reference = GPT(Config(**CP2_TP2_MODEL))
    reference.init_weights()
    loaded = GPT(Config(**CP2_TP2_MODEL))
    for model in (reference, loaded):  # as `split_copy` left the split model: one frozen norm
        model.transformer.h[0].norm_1.weight.requires_grad_(False)
    expected = one_training_step(reference, batch_loss(loss_function("cross_entropy")), adamw)
    optimizer = adamw(loaded)
    FSDPCheckpointIO("none", "sharded").load_sharded(tmp_path, loaded, optimizer, lambda key: True)
    torch.testing.assert_close(loaded.state_dict(), reference.state_dict(), rtol=0, atol=1e-5)
    for param, reference_param in zip(loaded.parameters(), reference.parameters()):
        if not param.requires_grad:
            continue
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(optimizer.state[param][name], expected.state[reference_param][name],
                                       rtol=1e-4, atol=1e-7)


# ---- the families beyond dense attention ----------------------------------------------------------------------------
def pretrain_one_and_cp2(inputs: dict, tmp_path, config: dict, seq_length: int) -> None:  # noqa: F811
    """Pretraining of a model of `config` on sequences of `seq_length` positions in one process (tmp_path/one) and
    over a CP2 group (tmp_path/cp2): the same losses and final weights."""
    for name, flags in (("one", ["--devices", "1", *FLOAT32]), ("cp2", CP2)):
        args = command_args("pretrain", inputs, tmp_path / name)
        args[args.index("--config") + 1] = write_config(tmp_path / "model.yaml", **config)
        args[args.index("--train.max_seq_length") + 1] = str(seq_length)
        result = litgpt(*args, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_close_runs(tmp_path / "cp2", tmp_path / "one", "lit_model.pth")


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    # Every other layer attends to a window of 16 positions (of 64), Gemma 2's way with soft-capped scores and a rotary
    # base of its own: each rank's heads attend over the whole sequence with the window's mask.
    dict(sliding_window_size=16, sliding_window_pattern=2, attention_logit_softcapping=50.0, rope_local_base=1000.0),
    # DeepSeek-V3's shape: latent attention (the group's latents gathered, each rank expands its run of heads' keys
    # and values over the whole sequence and attends with them), a dense first layer, a shared expert, sigmoid
    # routing with a correction bias.
    DEEPSEEK_V3,
    # gpt-oss's shape: a sink per head (each rank's heads read theirs), every other layer sliding, biased experts with
    # a load-balancing loss, the clamped SwiGLU.
    GPT_OSS,
], ids=["sliding-windows", "deepseek-v3", "gpt-oss"])
def test_context_parallel_families_equal_one_process(config, inputs, tmp_path):  # noqa: F811
    """Sequences of 63 positions (padded to 64 over the group)."""
    pretrain_one_and_cp2(inputs, tmp_path, config, 63)


@pytest.mark.slow
def test_context_parallel_lora_equals_one_process(inputs, lora_one_process, tmp_path):  # noqa: F811
    """finetune_lora with every adapter (the head's too) over a CP2 group: finetuning's batches of varying lengths,
    each padded to a multiple of 2 and split; the adapters and the merged final weights of one process."""
    result = litgpt(*command_args("finetune_lora", inputs, tmp_path / "cp2"), *EVERY_ADAPTER, *CP2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_close_runs(tmp_path / "cp2", lora_one_process, "lit_model.pth.lora")
    assert_same_final(tmp_path / "cp2", lora_one_process, "lit_model.pth", atol=1e-4)


@pytest.mark.slow
def test_a_context_parallel_mixture_of_experts_equals_one_process(inputs, tmp_path):  # noqa: F811
    """Sequences of 63 positions: the last rank's slice ends with one position of padding, which the routing
    statistics leave out; losses, load-balancing losses and final weights equal one process's."""
    from test_pipeline_parallel import moe_aux_losses

    pretrain_one_and_cp2(inputs, tmp_path, MOE, 63)
    reference = moe_aux_losses(tmp_path / "one")
    assert len(reference) == 4 and min(reference) > 0
    assert moe_aux_losses(tmp_path / "cp2") == pytest.approx(reference, abs=1e-6)


# ---- the mesh and the refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy, devices, nodes, tensor, shape, data_ranks",
    [("FULL_SHARD", 4, 1, 1, (1, 2), [0, 0, 1, 1]), ("HYBRID_SHARD", 4, 2, 2, (2, 1), [0, 0, 0, 0, 1, 1, 1, 1]),
     ("NO_SHARD", 2, 2, 1, (2, 1), [0, 0, 1, 1])],
)
def test_a_context_parallel_group_reads_one_batch(strategy, devices, nodes, tensor, shape, data_ranks):
    topology = Topology(devices, nodes, strategy, tensor=tensor, context=2)
    assert topology.mesh_shape == shape and topology.data_parallel_size == devices * nodes // (2 * tensor)
    assert topology.fsdp_shard_size == shape[1] * 2
    assert [topology.data_parallel_rank(rank) for rank in range(devices * nodes)] == data_ranks


@pytest.mark.parametrize(
    "changes, flags, message",
    [
        ({"n_query_groups": 4}, ["--devices", "2", "--parallel.context", "4"],
         "--parallel.context 4 x --parallel.tensor 1 does not divide --devices 2"),
        ({}, ["--devices", "1", "--parallel.context", "2"], "--parallel.context 2 splits each sequence over 2"),
        ({}, ["--devices", "2", "--parallel.context", "0"], "--parallel.context must be a whole number"),
        ({}, [*CP2, "--parallel.context_attention", "ring"],
         "--parallel.context_attention 'ring' is not one of auto, heads"),
        ({"n_head": 3, "n_query_groups": 3, "n_embd": 48}, CP2, "does not divide the 3 heads (n_head)"),
        ({"n_query_groups": 1}, CP2, "does not divide the 1 key-value groups (n_query_groups)"),
        ({}, ["--devices", "4", "--parallel.context", "2", "--parallel.tensor", "2"],
         "--parallel.context 2 x --parallel.tensor 2 does not divide the 2 key-value groups"),
    ],
)
def test_what_context_parallelism_refuses(changes, flags, message, inputs, tmp_path):  # noqa: F811
    args = command_args("pretrain", inputs, tmp_path / "out")
    args[args.index("--config") + 1] = write_config(tmp_path / "model.yaml", **changes)
    result = litgpt(*args, *flags, env=child_environment())
    assert_refused_before_writing(result, message, tmp_path / "out")

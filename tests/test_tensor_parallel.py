"""Tensor parallelism (`--parallel.tensor`, with sequence parallelism) with real processes on the CPU (gloo), against
one process: TP2, TP2 x FSDP2 (two torchrun "nodes" of 2), checkpoints resumed across the two layouts, the fused
qkv's per-rank layout, every family's plan (query/key norms, sinks, latent attention, mixtures of experts, LoRA on
every layer and the head) and the vocabulary-parallel loss on spawned ranks, and the refusals. A sharded TP2 x FSDP2
checkpoint resumes on FSDP4, FSDP2 and one process and converts to one process's Hugging Face folder. The MoE shapes'
CLI runs are in tests/test_expert_parallel.py, beside their one-process runs.

The runs are in float32 (`--precision 32-true`): under bf16 autocast a rowwise matmul's partial sums are rounded
before they are added, so a split layer cannot equal the whole one to 1e-5.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from forked_ranks import rank_context
from test_distributed import (
    SMALL,
    assert_close_runs,
    assert_resumed_where_it_stopped,
    assert_same_final,
    assert_same_hugging_face_folder,
    child_environment,
    command_args,
    free_port,
    inputs,  # noqa: F401 (the module-scoped fixture, shared)
    litgpt,
    torchrun_nodes,
    write_config,
)

from litgpt.config import Config
from litgpt.distributed.plans.dense import qkv_row_order
from litgpt.distributed.topology import Topology
from litgpt.io import load_state_dict

FLOAT32 = ["--precision", "32-true"]
TP2 = ["--devices", "2", "--parallel.tensor", "2", *FLOAT32]


@pytest.fixture(scope="module")
def one_process(inputs) -> Path:  # noqa: F811
    """The reference: pretraining in one process."""
    out_dir = inputs["root"] / "tp-one"
    result = litgpt(*command_args("pretrain", inputs, out_dir), "--devices", "1", *FLOAT32)
    assert result.returncode == 0, result.stderr
    return out_dir


@pytest.fixture(scope="module")
def tp2_run(inputs) -> Path:  # noqa: F811
    """Pretraining split over 2 processes by tensor parallelism (one tensor-parallel group, no data parallelism)."""
    out_dir = inputs["root"] / "tp-two"
    result = litgpt(*command_args("pretrain", inputs, out_dir), *TP2)
    assert result.returncode == 0, result.stderr
    # FSDP2 warned of the split output, a view (see `apply_tensor_parallel`), on every rank of every run
    assert "returned a view tensor" not in result.stderr, result.stderr
    return out_dir


@pytest.mark.slow
def test_tensor_parallel_pretraining_equals_one_process(tp2_run, one_process):
    assert_close_runs(tp2_run, one_process, "lit_model.pth")
    metrics = json.loads((tp2_run / "metrics.json").read_text())
    assert metrics["world_size"] == 2


@pytest.fixture(scope="module")
def tp2_fsdp2_run(inputs) -> Path:  # noqa: F811
    """4 processes: 2 data-parallel ranks (FULL_SHARD) x 2 tensor-parallel ranks, each group reading its own batches,
    writing sharded checkpoints."""
    out_dir = inputs["root"] / "tp-four"
    args = [*command_args("pretrain", inputs, out_dir), "--devices", "2", "--num_nodes", "2", "--parallel.tensor", "2",
            "--fsdp.sharding_strategy", "FULL_SHARD", "--fsdp.state_dict_type", "sharded", *FLOAT32]
    for result in torchrun_nodes([args, args], [{}, {}], timeout=600):
        assert result.returncode == 0, result.stderr[-3000:]
    return out_dir


@pytest.mark.slow
def test_tensor_parallel_times_fsdp_equals_one_process(tp2_fsdp2_run, one_process):
    assert_close_runs(tp2_fsdp2_run, one_process, "lit_model.pth")  # final/: gathered whole


@pytest.mark.slow
@pytest.mark.parametrize("flags, nodes", [(["--devices", "1"], 1), (["--devices", "2"], 1), (["--devices", "2"], 2)],
                         ids=["one-process", "fsdp2", "fsdp4"])
def test_a_sharded_tensor_parallel_checkpoint_resumes_without_it(flags, nodes, inputs, tp2_fsdp2_run,  # noqa: F811
                                                                  one_process, tmp_path):
    """TP2 x FSDP2's sharded step 2 resumed by one process, by FSDP over 2 processes and by FSDP over 4 (two
    torchrun "nodes" of 2, FULL_SHARD): each goes on as the uninterrupted run."""
    out_dir = tmp_path / "resumed"
    args = [*command_args("pretrain", inputs, out_dir), *flags, "--num_nodes", str(nodes), *FLOAT32,
            "--fsdp.sharding_strategy", "FULL_SHARD", "--fsdp.state_dict_type", "sharded",
            "--resume", tp2_fsdp2_run / "step-000002"]
    results = [litgpt(*args)] if nodes == 1 else torchrun_nodes([args, args], [{}, {}], timeout=600)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out_dir / "metrics.json").read_text())["world_size"] == int(flags[1]) * nodes
    assert_resumed_where_it_stopped(out_dir, one_process)


@pytest.mark.slow
def test_a_sharded_tensor_parallel_checkpoint_converts_as_one_process(tp2_fsdp2_run, one_process, tmp_path):
    assert_same_hugging_face_folder(tp2_fsdp2_run / "step-000002", one_process / "step-000002", tmp_path)


@pytest.mark.slow
def test_a_sharded_tensor_parallel_checkpoint_consolidates_to_the_full_one(tp2_fsdp2_run, tp2_run, tmp_path):
    """`litgpt consolidate` of TP2 x FSDP2's sharded step 2 against TP2's full (gathered, un-permuted) step 2: the
    same weights (up to the data-parallel reduction order), the fused qkv rows in the one-process order."""
    result = litgpt("consolidate", tp2_fsdp2_run / "step-000002", "--out_dir", tmp_path / "one-file")
    assert result.returncode == 0, result.stderr
    consolidated = load_state_dict(tmp_path / "one-file" / "lit_model.pth")
    full = load_state_dict(tp2_run / "step-000002" / "lit_model.pth")
    assert consolidated.keys() == full.keys()
    for key, value in full.items():
        torch.testing.assert_close(consolidated[key], value, rtol=0, atol=1e-5, msg=key)


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_in_one_process(inputs, tp2_run, one_process, tmp_path):  # noqa: F811
    out_dir = tmp_path / "resumed"
    result = litgpt(*command_args("pretrain", inputs, out_dir), "--devices", "1", *FLOAT32,
                    "--resume", tp2_run / "step-000002")
    assert result.returncode == 0, result.stderr
    assert_same_final(out_dir, one_process, "lit_model.pth", atol=1e-4)


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_under_tensor_parallelism(inputs, one_process, tmp_path):  # noqa: F811
    out_dir = tmp_path / "resumed"
    result = litgpt(*command_args("pretrain", inputs, out_dir), *TP2, "--resume", one_process / "step-000002")
    assert result.returncode == 0, result.stderr
    assert_same_final(out_dir, one_process, "lit_model.pth", atol=1e-4)


# ---- LoRA ----------------------------------------------------------------------------------------------------------
# Every kind of adapter the plan splits: q, k and v parts of the fused qkv (colwise, rows permuted), the projection
# and the MLP's output (rowwise), the MLP's inputs (colwise), the head (its B split by vocabulary rows: the loss runs
# on each rank's).
EVERY_ADAPTER = ["--lora_key", "true", "--lora_projection", "true", "--lora_head", "true"]


@pytest.fixture(scope="module")
def lora_one_process(inputs) -> Path:  # noqa: F811
    out_dir = inputs["root"] / "tp-lora-one"
    result = litgpt(*command_args("finetune_lora", inputs, out_dir), *EVERY_ADAPTER, "--devices", "1", *FLOAT32)
    assert result.returncode == 0, result.stderr
    return out_dir


@pytest.fixture(scope="module")
def lora_tp2(inputs) -> Path:  # noqa: F811
    out_dir = inputs["root"] / "tp-lora-two"
    result = litgpt(*command_args("finetune_lora", inputs, out_dir), *EVERY_ADAPTER, *TP2)
    assert result.returncode == 0, result.stderr
    # FSDP2 warned of the split output, a view (see `apply_tensor_parallel`), on every rank of every run
    assert "returned a view tensor" not in result.stderr, result.stderr
    return out_dir


@pytest.mark.slow
def test_tensor_parallel_lora_equals_one_process(lora_tp2, lora_one_process):
    assert_close_runs(lora_tp2, lora_one_process, "lit_model.pth.lora")  # the adapters, in the one-process layout
    assert_same_final(lora_tp2, lora_one_process, "lit_model.pth", atol=1e-4)  # final/: merged into the base


@pytest.mark.slow
def test_a_tensor_parallel_lora_checkpoint_resumes_in_one_process(inputs, lora_tp2, lora_one_process,  # noqa: F811
                                                                   tmp_path):
    out_dir = tmp_path / "resumed"
    result = litgpt(*command_args("finetune_lora", inputs, out_dir), *EVERY_ADAPTER, "--devices", "1", *FLOAT32,
                    "--resume", lora_tp2 / "step-000002")
    assert result.returncode == 0, result.stderr
    assert_same_final(out_dir, lora_one_process, "lit_model.pth.lora", atol=1e-4)


# ---- the fused qkv's layout ------------------------------------------------------------------------------------------
def test_qkv_row_order_gives_each_rank_its_heads_and_groups():
    config = Config(**SMALL)  # 4 heads, 2 key-value groups of head size 16
    order = qkv_row_order(config, 2)
    assert sorted(order.tolist()) == list(range(config.qkv_size))  # a permutation
    rows = torch.arange(config.qkv_size)
    restored = torch.empty_like(rows)
    restored[order] = rows[order]
    assert torch.equal(restored, rows)
    hs, q_rows, kv_rows = 16, 4 * 16, 2 * 16
    rank_1 = order[config.qkv_size // 2:]  # Shard(0)'s second half
    assert rank_1[:2 * hs].tolist() == list(range(2 * hs, 4 * hs))  # query heads 2 and 3
    assert rank_1[2 * hs:3 * hs].tolist() == list(range(q_rows + hs, q_rows + 2 * hs))  # key group 1
    assert rank_1[3 * hs:].tolist() == list(range(q_rows + kv_rows + hs, q_rows + 2 * kv_rows))  # value group 1


def split_copy(whole, mesh, adapt=lambda model: None):
    """`whole`'s config built on the meta device, adapted by `adapt` (LoRA), split over the ranks of `mesh` (a 1-D
    device mesh, or a number of ranks: all of them) by the plan and given `whole`'s weights; and its permuted rows
    (`row_orders`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from litgpt.distributed.dtensor import copy_into_shard
    from litgpt.distributed.tensor_parallel import apply_tensor_parallel, row_orders
    from litgpt.model import GPT

    with torch.device("meta"):
        split = GPT(whole.config)
    adapt(split)
    for model in (whole, split):  # a frozen norm stays frozen (SequenceParallel registers its weight anew)
        model.transformer.h[0].norm_1.weight.requires_grad_(False)
    if isinstance(mesh, int):
        mesh = init_device_mesh("cpu", (mesh,), mesh_dim_names=("tensor",))
    apply_tensor_parallel(split, mesh)
    split.to_empty(device="cpu")
    orders = row_orders(split)
    for key, target in split.state_dict().items():
        copy_into_shard(target, whole.state_dict()[key], orders.get(key))
    return split, orders


def assert_same_loss_and_gradients(whole, split, orders: dict, loss=None) -> None:
    """The split model's loss and gradients (gathered whole, in the checkpoint's row order) are the whole one's.
    `loss(model, idx, labels)`: a scalar (default: the cross-entropy with the router's auxiliary loss)."""
    from litgpt.distributed.dtensor import gather_full
    from litgpt.train.loss import loss_function

    generator = torch.Generator().manual_seed(1)
    idx, labels = (torch.randint(0, 4096, (2, 63), generator=generator) for _ in range(2))
    if loss is None:
        loss = lambda model, idx, labels: loss_function("cross_entropy")(model, idx, labels)["loss"]  # noqa: E731
    expected, actual = loss(whole, idx, labels), loss(split, idx, labels)  # 63: padded to 64
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    split_params = dict(split.named_parameters())
    for key, param in whole.named_parameters():
        assert split_params[key].requires_grad == param.requires_grad, key
        if param.grad is None:
            continue
        grad = gather_full(split_params[key].grad, orders.get(key))
        torch.testing.assert_close(grad, param.grad, rtol=1e-5, atol=1e-6, msg=key)


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, failures):
    """Inside: rank `rank` of a gloo group of `world` (one thread); what fails inside is put in `failures` for the
    test, which runs in the parent (`run_spawned_ranks`)."""
    join_gloo_group(rank, world, port)
    try:
        yield
    except BaseException as error:
        failures.put(f"rank {rank}: {error}")
    finally:
        dist.destroy_process_group()


def adapt_with(settings):
    """`adapt(model)` for `split_copy`: LoRA adapters of `settings` on `model`, only they trainable."""
    from litgpt.lora import add_lora, mark_only_lora_as_trainable

    def adapt(model):
        add_lora(model, settings)
        mark_only_lora_as_trainable(model)

    return adapt


def randomize_lora_b(model) -> None:
    """B factors away from zero: A's gradients, sums over the ranks, are zero otherwise."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)


def split_model_matches_whole(rank: int, world: int, port: int, failures) -> None:
    """On each of `world` ranks: a model split by the plan, loaded with a whole model's weights, gives its loss and
    gradients; so does one with LoRA adapters on every layer the plan splits (B not zero: A's gradients are sums
    over the ranks), and with adapter dropout it trains."""
    from litgpt.lora import LoRASettings
    from litgpt.model import GPT
    from litgpt.train.loss import loss_function

    with gloo_rank(rank, world, port, failures):
        config = Config(**{**SMALL, "bias": True})  # a qkv bias too, permuted as its rows are
        torch.manual_seed(0)
        whole = GPT(config)
        whole.init_weights()
        split, orders = split_copy(whole, world)
        assert set(orders) == {f"transformer.h.{i}.attn.qkv.{p}" for i in range(2) for p in ("weight", "bias")}
        assert_same_loss_and_gradients(whole, split, orders)

        adapt = adapt_with(LoRASettings(r=4, alpha=8, dropout=0.0, key=True, projection=True, mlp=True))
        whole.zero_grad(set_to_none=True)
        adapt(whole)
        randomize_lora_b(whole)
        split, orders = split_copy(whole, world, adapt)
        assert_same_loss_and_gradients(whole, split, orders)
        for module in split.modules():
            if hasattr(module, "lora_dropout"):
                module.lora_dropout = torch.nn.Dropout(0.1)
        generator = torch.Generator().manual_seed(2)
        idx = torch.randint(0, 4096, (2, 64), generator=generator)
        loss = loss_function("cross_entropy")(split, idx, idx)["loss"]
        loss.backward()
        assert torch.isfinite(loss)


def join_gloo_group(rank: int, world: int, port: int) -> None:
    """This spawned process as rank `rank` of a gloo group of `world` meeting on 127.0.0.1:`port`, one thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def assert_refused_before_writing(result, message: str, out_dir) -> None:
    """A refusal: exit code 1, `message` in the last line of stderr, no traceback, and nothing written to `out_dir`."""
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert message in lines[-1] and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not Path(out_dir).exists()


def run_spawned_ranks(worker, world: int) -> None:
    """`worker(rank, world, port, failures)` on `world` gloo ranks (tests/forked_ranks.py); fails with what any of
    them put in `failures`, or when one did not end cleanly."""
    context = rank_context()
    failures = context.Queue()
    port = free_port()
    processes = [context.Process(target=worker, args=(rank, world, port, failures)) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=180)
    messages = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not messages, messages
    assert all(process.exitcode == 0 for process in processes)


@pytest.mark.slow  # spawns 2 processes
def test_a_split_attention_and_mlp_equal_the_whole_model():
    run_spawned_ranks(split_model_matches_whole, 2)


# ---- the families beyond the dense plan ------------------------------------------------------------------------------
MOE = dict(mlp_class_name="LLaMAMoE", moe_intermediate_size=32, n_expert=4, n_expert_per_token=2,
           router_aux_loss_coef=0.01)
FAMILIES = {
    # Qwen3: an RMSNorm over each head's dims of the queries and keys, one weight all heads share.
    "qwen3": {**SMALL, "norm_qk": True},
    # StableLM 2: a LayerNorm weight of each head's own; OLMo 2: norms over all heads' queries (keys) together.
    "stablelm-2": {**SMALL, "norm_class_name": "LayerNorm", "norm_qk": True, "norm_qk_per_head": True},
    "olmo-2": {**SMALL, "norm_qk": True, "norm_qk_type": "olmo2"},
    # gpt-oss: a sink per head, every other layer sliding, biases everywhere (the experts' too), the clamped SwiGLU.
    "gpt-oss": {**SMALL, **MOE, "attention_sinks": True, "sliding_window_size": 16, "sliding_window_pattern": 2,
                "bias": True, "router_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
    "qwen3-moe": {**SMALL, **MOE, "norm_qk": True, "moe_renormalize": False},
    # DeepSeek-V3: latent attention (rope and nope dims per head), a dense first layer, a shared expert, sigmoid
    # routing with a correction bias and group-limited choice.
    "deepseek-v3": {**SMALL, **MOE, "n_expert": 8, "n_expert_per_token": 3, "n_query_groups": 4, "head_size": 24,
                    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "moe_n_shared_expert": 1, "moe_shared_intermediate_size": 32,
                    "moe_score_function": "sigmoid", "moe_expert_bias": True, "moe_n_group": 4, "moe_topk_group": 2,
                    "moe_routed_scaling": 2.5, "moe_first_dense_layers": 1},
}
# LoRA on every layer the plans split or replicate, the experts' and the head's too.
EVERY_LAYER = dict(r=4, alpha=8, dropout=0.0, key=True, projection=True, mlp=True, head=True)


def whole_model(changes: dict):
    """A one-process model of `changes`, its norms, sinks and correction biases drawn away from their initial values
    (ones, zeros: a gradient summed over the wrong ranks would still look right at them)."""
    from litgpt.model import GPT

    torch.manual_seed(0)
    model = GPT(Config(**changes))
    model.init_weights()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name or "sinks" in name or "correction" in name:
                tensor.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


def families_match_whole(rank: int, world: int, port: int, failures) -> None:
    """On each of `world` ranks, every family of `FAMILIES` split by its plan gives the whole model's loss (with the
    router's auxiliary loss) and gradients, on sequences that tensor parallelism pads; and with LoRA on every layer
    (gpt-oss, DeepSeek-V3)."""
    from litgpt.lora import LoRASettings

    adapt = adapt_with(LoRASettings(**EVERY_LAYER))
    with gloo_rank(rank, world, port, failures):
        for family, changes in FAMILIES.items():
            try:
                whole = whole_model(changes)
                split, orders = split_copy(whole, world)
                assert_same_loss_and_gradients(whole, split, orders)
                if family in ("gpt-oss", "deepseek-v3"):
                    whole = whole_model(changes)
                    adapt(whole)
                    randomize_lora_b(whole)
                    split, orders = split_copy(whole, world, adapt)
                    assert_same_loss_and_gradients(whole, split, orders)
            except AssertionError as error:
                raise AssertionError(f"{family}: {error}") from error


@pytest.mark.slow  # spawns 2 processes
def test_every_family_split_equals_the_whole_model():
    run_spawned_ranks(families_match_whole, 2)


def float8_split_matches_whole(rank: int, world: int, port: int, failures) -> None:
    """On each of `world` ranks, fp8-mixed's float8 layers split by the plan (float32 around them, so that only the
    float8 casts round). Tensorwise: the split model's loss and gradients are the whole one's (each amax is reduced
    over the group). Rowwise: a layer split along its output multiplies as the whole layer; one split along its
    input takes a scale per row of each rank's share of the input and weight, as computed here by hand."""
    from test_float8 import rowwise_float8

    from litgpt.distributed.float8 import convert_to_float8

    with gloo_rank(rank, world, port, failures):
        torch.manual_seed(0)
        whole = whole_model(SMALL)
        convert_to_float8(whole, "tensorwise")
        split, orders = split_copy(whole, world, lambda model: convert_to_float8(model, "tensorwise"))
        assert_same_loss_and_gradients(whole, split, orders)

        whole = whole_model(SMALL)
        convert_to_float8(whole, "rowwise")
        split, _ = split_copy(whole, world, lambda model: convert_to_float8(model, "rowwise"))
        # One sequence of 6 positions, its features of magnitudes 0.1 to 10 (rows whose shares differ in amax).
        x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-1, 1, 64)
        positions = slice(rank * 3, (rank + 1) * 3)  # sequence parallelism: this rank's share of the positions
        whole_fc, split_fc = whole.transformer.h[0].mlp.fc_1, split.transformer.h[0].mlp.fc_1
        columns = slice(rank * 64, (rank + 1) * 64)  # this rank's share of fc_1's 128 outputs
        torch.testing.assert_close(split_fc(x), whole_fc(x)[..., columns], rtol=0, atol=0)  # its input gathered
        whole_proj, split_proj = whole.transformer.h[0].attn.proj, split.transformer.h[0].attn.proj
        x_shares, w_shares = x.chunk(world, dim=-1), whole_proj.weight.detach().chunk(world, dim=-1)
        by_hand = 0
        for x_share, w_share in zip(x_shares, w_shares):
            (x8, x_scale), (w8, w_scale) = rowwise_float8(x_share), rowwise_float8(w_share)
            # Each rank's product comes out of the CPU's float8 matmul rounded to bf16 (as one process's does,
            # tests/test_float8.py), before the ranks' products are summed.
            by_hand = by_hand + ((x8.float() / x_scale) @ (w8.float() / w_scale).T).bfloat16().float()
        ours, by_hand = split_proj(x_shares[rank].contiguous()), by_hand[:, positions]
        torch.testing.assert_close(ours, by_hand, rtol=1e-6, atol=1e-6)
        whole_rows = whole_proj(x)[:, positions]
        assert (ours - whole_rows).abs().max() > 100 * (ours - by_hand).abs().max()  # not the whole rows' scales


@pytest.mark.slow  # spawns 2 processes
def test_float8_layers_split_as_each_recipe_scales():
    pytest.importorskip("torchao.float8")
    run_spawned_ranks(float8_split_matches_whole, 2)


class LocalShapes(TorchDispatchMode):
    """The shapes of the plain (not DTensor) tensors every op makes while inside: what a rank holds itself."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor):
                self.shapes.add(tuple(tensor.shape))
        return out


def vocabulary_parallel_loss_matches(rank: int, world: int, port: int, failures) -> None:
    """The chunked losses on each rank's vocabulary rows (16 positions a chunk): the cross-entropy (gradients taken
    in its forward pass), the per-position negative log-likelihood of preference optimization (recomputed in its
    backward pass) and distillation's (`distillation_matches`) equal one process's, and no rank makes a tensor as
    wide as the whole vocabulary (the chunks' logits are (16, vocabulary / 2))."""
    from litgpt.train.loss import loss_function
    from litgpt.train.preference_loss import token_nll

    with gloo_rank(rank, world, port, failures):
        whole = whole_model({**SMALL, "final_logit_softcapping": 30.0})
        split, orders = split_copy(whole, world)
        vocabulary = whole.config.padded_vocab_size
        shapes = LocalShapes()

        def cross_entropy(model, idx, labels):
            if model is not split:
                return loss_function("cross_entropy", chunk_size=16)(model, idx, labels)["loss"]
            with shapes:
                return loss_function("cross_entropy", chunk_size=16)(model, idx, labels)["loss"]

        assert_same_loss_and_gradients(whole, split, orders, cross_entropy)
        assert (16, vocabulary // world) in shapes.shapes, "no chunk's logits were the rank's vocabulary rows"
        assert not [shape for shape in shapes.shapes if vocabulary in shape], shapes.shapes
        whole.zero_grad(set_to_none=True)
        split.zero_grad(set_to_none=True)
        weights = torch.rand(2, 63, generator=torch.Generator().manual_seed(3))
        assert_same_loss_and_gradients(
            whole, split, orders, lambda model, idx, labels: (token_nll(model, idx, labels, 16) * weights).sum())
        distillation_matches(whole, split, orders, world)


def distillation_matches(whole, split, orders: dict, world: int) -> None:
    """Distillation's loss on each rank's vocabulary rows of the student and of a teacher split alike (every
    divergence, a temperature, the cross-entropy mixed in, both heads soft-capped) equals one process's, and no rank
    makes a tensor as wide as the whole vocabulary."""
    from litgpt.args import KDArgs
    from litgpt.train.loss import distillation_loss

    teacher = whole_model({**SMALL, "n_layer": 1, "final_logit_softcapping": 20.0}).requires_grad_(False)
    split_teacher, _ = split_copy(teacher, world)
    vocabulary = whole.config.padded_vocab_size
    for kd in (KDArgs("forward_kl", 2.0, 0.7), KDArgs("reverse_kl", 1.0, 1.0), KDArgs("js", 1.5, 0.5)):
        whole.zero_grad(set_to_none=True)
        split.zero_grad(set_to_none=True)
        shapes = LocalShapes()

        def distill(model, idx, labels):
            if model is not split:
                return distillation_loss(model, teacher, idx, labels, kd, chunk_size=16)["loss"]
            with shapes:
                return distillation_loss(model, split_teacher, idx, labels, kd, chunk_size=16)["loss"]

        assert_same_loss_and_gradients(whole, split, orders, distill)
        assert (16, vocabulary // world) in shapes.shapes, kd
        assert not [shape for shape in shapes.shapes if vocabulary in shape], (kd, shapes.shapes)


@pytest.mark.slow  # spawns 2 processes
def test_the_vocabulary_parallel_loss_equals_one_process():
    run_spawned_ranks(vocabulary_parallel_loss_matches, 2)


# ---- refusals -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, flags, message",
    [
        ({"n_query_groups": 4}, ["--devices", "2", "--parallel.tensor", "4"],
         "--parallel.tensor 4 does not divide --devices 2"),
        ({}, ["--devices", "1", "--parallel.tensor", "2"], "--parallel.tensor 2 splits each layer over 2 devices"),
        ({}, ["--devices", "2", "--parallel.tensor", "0"], "--parallel.tensor must be a whole number"),
        ({"n_head": 3, "n_query_groups": 3, "n_embd": 48}, TP2, "does not divide the 3 heads (n_head)"),
        ({"n_query_groups": 1}, TP2, "does not divide the 1 key-value groups (n_query_groups)"),
        ({"intermediate_size": 129}, TP2, "does not divide the 129 MLP width (intermediate_size)"),
        ({"mlp_class_name": "LLaMAMoE", "n_expert": 4, "n_expert_per_token": 2, "moe_intermediate_size": 33}, TP2,
         "does not divide the 33 experts' width (moe_intermediate_size)"),
        ({"mlp_class_name": "LLaMAMoE", "n_expert": 4, "n_expert_per_token": 2, "moe_intermediate_size": 32,
          "moe_n_shared_expert": 1, "moe_shared_intermediate_size": 33, "intermediate_size": 130,
          "moe_first_dense_layers": 0}, TP2, "does not divide the 33 shared experts' width"),
    ],
)
def test_what_tensor_parallelism_refuses(changes, flags, message, inputs, tmp_path):  # noqa: F811
    args = command_args("pretrain", inputs, tmp_path / "out")
    args[args.index("--config") + 1] = write_config(tmp_path / "model.yaml", **changes)
    result = litgpt(*args, *flags, env=child_environment())
    assert_refused_before_writing(result, message, tmp_path / "out")


def test_tensor_parallelism_refuses_a_quantized_base(inputs, tmp_path):  # noqa: F811
    message = "a quantized base (--quantize, QLoRA) (dist-llama) is not supported yet"
    result = litgpt(*command_args("finetune_lora", inputs, tmp_path / "out"), *TP2, "--quantize", "bnb.nf4")
    assert result.returncode == 1
    assert message in result.stderr.strip().splitlines()[-1] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "strategy, devices, nodes, shape, data_ranks",
    [("HYBRID_SHARD", 4, 2, (2, 2), [0, 0, 1, 1, 2, 2, 3, 3]), ("FULL_SHARD", 4, 1, (1, 2), [0, 0, 1, 1]),
     ("NO_SHARD", 2, 2, (2, 1), [0, 0, 1, 1])],
)
def test_the_tensor_dimension_is_innermost(strategy, devices, nodes, shape, data_ranks):
    topology = Topology(devices, nodes, strategy, tensor=2)
    assert topology.mesh_shape == shape and topology.data_parallel_size == devices * nodes // 2
    assert [topology.data_parallel_rank(rank) for rank in range(devices * nodes)] == data_ranks

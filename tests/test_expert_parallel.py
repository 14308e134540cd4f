"""Expert parallelism (`--parallel.expert`) with real processes on the CPU (gloo), against one process: EP2 on a
Qwen3-MoE shape and on a DeepSeek-V3 shape (latent attention, shared experts, a dense first layer, group-limited
sigmoid routing), EP2 x FSDP2 (4 processes), EP2 checkpoints (full and sharded) resumed in one process and on FSDP
without expert parallelism and converted to one process's Hugging Face folder, the mesh's layout, and the refusals;
and tensor parallelism on the same shapes (TP2, and TP2 x FSDP2 on the DeepSeek-V3 shape: every expert split along
its width).

The runs are in float32 (`--precision 32-true`); the load-balancing loss is on in both shapes, so the logged loss
carries the router's auxiliary loss, which each rank computes on its own whole routing as one process does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_distributed import (
    SMALL,
    assert_close_runs,
    assert_resumed_where_it_stopped,
    assert_same_final,
    assert_same_hugging_face_folder,
    child_environment,
    command_args,
    final_weights,
    inputs,  # noqa: F401 (the module-scoped fixture, shared)
    litgpt,
    torchrun_nodes,
)
from test_tensor_parallel import assert_refused_before_writing

from litgpt.checkpoint.store import TRAINING_STATE_FILE
from litgpt.distributed.topology import Topology
from litgpt.errors import UserError
from litgpt.io import load_state_dict

FLOAT32 = ["--precision", "32-true"]
EP2 = ["--devices", "2", "--parallel.expert", "2", *FLOAT32]
MOE = dict(mlp_class_name="LLaMAMoE", moe_intermediate_size=32, n_expert=4, n_expert_per_token=2,
           router_aux_loss_coef=0.01)
# Qwen3-MoE: softmax routing without renormalization, query/key norms, no shared experts.
QWEN3_MOE = {**SMALL, **MOE, "name": "tiny-qwen3-moe", "hf_model_type": "qwen3_moe", "norm_qk": True,
             "moe_renormalize": False}
# DeepSeek-V3: latent attention, a dense first layer, a shared expert, sigmoid routing with a correction bias and
# group-limited choice (2 of 4 groups of 2), scaled weights.
DEEPSEEK_V3 = {**SMALL, **MOE, "name": "tiny-deepseek-v3", "hf_model_type": "deepseek_v3", "n_layer": 2, "n_expert": 8, "n_expert_per_token": 3,
               "n_query_groups": 4, "head_size": 24, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
               "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_n_shared_expert": 1, "moe_shared_intermediate_size": 32,
               "moe_score_function": "sigmoid", "moe_expert_bias": True, "moe_n_group": 4, "moe_topk_group": 2,
               "moe_routed_scaling": 2.5, "moe_first_dense_layers": 1}
SHAPES = {"qwen3-moe": QWEN3_MOE, "deepseek-v3": DEEPSEEK_V3}
SHARDED = ["--fsdp.state_dict_type", "sharded"]


def pretrain_args(inputs: dict, out_dir: Path, model: dict) -> list:  # noqa: F811
    """Pretraining `model`; the DeepSeek-V3 shape without gradient clipping, so that the logged gradient norm (the
    experts' and the rest's, on two meshes) is measured by the unclipped path too."""
    args = command_args("pretrain", inputs, out_dir)
    config = out_dir.parent / f"{out_dir.name}.yaml"
    config.write_text(json.dumps({"model_config": model}))
    args[args.index("--config") + 1] = config
    if model is DEEPSEEK_V3:
        args[args.index("--train.max_norm") + 1] = "null"
    return args


@pytest.fixture(scope="module")
def runs(inputs):  # noqa: F811
    """`runs(shape, name, *flags)`: the out_dir of pretraining that shape with those flags, launched once for the
    module and shared by the tests that read it."""
    done = {}

    def run(shape: str, name: str, *flags) -> Path:
        if (shape, name) not in done:
            out_dir = inputs["root"] / f"ep-{shape}-{name}"
            result = litgpt(*pretrain_args(inputs, out_dir, SHAPES[shape]), *flags)
            assert result.returncode == 0, result.stderr[-3000:]
            assert ("Expert parallelism: each of 2 devices" in result.stdout + result.stderr) == ("--parallel.expert" in flags)
            done[shape, name] = out_dir
        return done[shape, name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
def test_expert_parallel_pretraining_equals_one_process(shape, runs):
    one = runs(shape, "one", "--devices", "1", *FLOAT32)
    two = runs(shape, "two", *EP2)
    assert_close_runs(two, one, "lit_model.pth")
    reference = final_weights(one, "lit_model.pth")
    # The one-process layout, key order included (gathered over the expert group, experts come slot by slot).
    assert [(k, v.shape) for k, v in final_weights(two, "lit_model.pth").items()] == [
        (k, v.shape) for k, v in reference.items()]
    assert json.loads((two / "metrics.json").read_text())["world_size"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tensor_parallel_pretraining_of_the_moe_shapes_equals_one_process(shape, runs):
    """TP2 on the same shapes (`litgpt.distributed.plans.dense`: every expert split along its width, the router
    replicated, DeepSeek's latent attention split by heads and its shared expert as a dense MLP): the losses (with
    the auxiliary loss) and final weights of one process."""
    one = runs(shape, "one", "--devices", "1", *FLOAT32)
    tp2 = runs(shape, "tp2", "--devices", "2", "--parallel.tensor", "2", *FLOAT32)
    assert_close_runs(tp2, one, "lit_model.pth")


@pytest.mark.slow
def test_context_times_expert_parallel_pretraining_equals_one_process(runs):
    """CP2 x EP2 on 2 processes, the DeepSeek-V3 shape (latent attention, a shared expert; the Qwen3-MoE shape runs
    it with FSDP below): the expert group is the context group (each rank routes its half of every sequence's
    positions to the experts' owners), FSDP averages every gradient over both; the routing statistics of the
    load-balancing loss are the whole sequence's. The losses (with the auxiliary loss) and final weights of one
    process."""
    one = runs("deepseek-v3", "one", "--devices", "1", *FLOAT32)
    both = runs("deepseek-v3", "cp2-ep2", *EP2, "--parallel.context", "2")
    assert_close_runs(both, one, "lit_model.pth")


def four_processes(out_dir: Path, inputs: dict, model: dict, *flags) -> Path:  # noqa: F811
    """Pretraining `model` with `flags` on 4 processes (two torchrun "nodes" of 2, FULL_SHARD); its out_dir."""
    args = [*pretrain_args(inputs, out_dir, model), "--devices", "2", "--num_nodes", "2", *flags,
            "--fsdp.sharding_strategy", "FULL_SHARD", *FLOAT32]
    for result in torchrun_nodes([args, args], [{}, {}], timeout=600):
        assert result.returncode == 0, result.stderr[-3000:]
    return out_dir


@pytest.mark.slow
def test_tensor_parallel_times_fsdp_of_the_deepseek_shape_equals_one_process(inputs, runs):  # noqa: F811
    """2 tensor-parallel groups of 2, each reading its own batches, every rank's piece (its heads, its share of every
    expert's width) FSDP-sharded over the 2 groups."""
    out_dir = four_processes(inputs["root"] / "tp-deepseek-v3-four", inputs, DEEPSEEK_V3, "--parallel.tensor", "2")
    assert_close_runs(out_dir, runs("deepseek-v3", "one", "--devices", "1", *FLOAT32), "lit_model.pth")


@pytest.mark.slow
def test_expert_parallel_times_fsdp_equals_one_process(inputs, runs):  # noqa: F811
    """2 expert groups of 2, each expert's weights FSDP-sharded over the 2 ranks holding it, every rank reading its
    own batches."""
    out_dir = four_processes(inputs["root"] / "ep-qwen3-moe-four", inputs, QWEN3_MOE, "--parallel.expert", "2")
    assert_close_runs(out_dir, runs("qwen3-moe", "one", "--devices", "1", *FLOAT32), "lit_model.pth")


@pytest.mark.slow
def test_context_times_expert_parallel_times_fsdp_equals_one_process(inputs, runs):  # noqa: F811
    """2 context groups of 2 (one per node), each reading its own batches; each an expert group, every expert's
    weights FSDP-sharded over the 2 ranks holding it (one per context group)."""
    out_dir = four_processes(inputs["root"] / "cp-ep-qwen3-moe-four", inputs, QWEN3_MOE, "--parallel.expert", "2",
                             "--parallel.context", "2")
    assert_close_runs(out_dir, runs("qwen3-moe", "one", "--devices", "1", *FLOAT32), "lit_model.pth")


TP2_EP2 = ["--parallel.tensor", "2", "--parallel.expert", "2"]


@pytest.mark.slow
def test_tensor_times_expert_parallel_pretraining_equals_one_process(inputs, runs):  # noqa: F811
    """TP2 x EP2 on 4 processes (a tensor-parallel group of 2 on each torchrun "node", the expert groups across them,
    the ranks sharing a tensor rank): each rank holds 2 of the 4 experts, each half as wide; the losses and final
    weights of one process, saved in the one-process layout."""
    out_dir = four_processes(inputs["root"] / "tp-ep-qwen3-moe", inputs, QWEN3_MOE, *TP2_EP2)
    one = runs("qwen3-moe", "one", "--devices", "1", *FLOAT32)
    assert_close_runs(out_dir, one, "lit_model.pth")
    assert [(k, v.shape) for k, v in final_weights(out_dir, "lit_model.pth").items()] == [
        (k, v.shape) for k, v in final_weights(one, "lit_model.pth").items()]


@pytest.fixture(scope="module")
def eight_processes(inputs):  # noqa: F811
    """The DeepSeek-V3 shape pretrained by 8 processes, 4 torchrun "nodes" of 2 (a node's 2 devices a
    tensor-parallel group), EP2 x TP2 x FSDP2 with sharded checkpoints: the expert groups pair nodes, the dense
    weights are FSDP-sharded over the 4 data-parallel ranks, each expert over the 2 holding it."""
    out_dir = inputs["root"] / "tp-ep-fsdp-deepseek-v3"
    args = [*pretrain_args(inputs, out_dir, DEEPSEEK_V3), "--devices", "2", "--num_nodes", "4", *TP2_EP2,
            "--fsdp.sharding_strategy", "FULL_SHARD", *FLOAT32, *SHARDED]
    results = torchrun_nodes([args] * 4, [{}] * 4, timeout=600)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    assert "each split along its width by tensor parallelism" in "".join(r.stdout + r.stderr for r in results)
    return out_dir


@pytest.mark.slow
def test_eight_processes_of_expert_tensor_and_data_parallelism_equal_one_process(eight_processes, runs, tmp_path):
    """The 2 x 2 x 2 run's losses (with the auxiliary loss) and final weights are one process's, and its sharded
    step 2 converts to one process's Hugging Face folder."""
    one = runs("deepseek-v3", "one", "--devices", "1", *FLOAT32)
    assert_close_runs(eight_processes, one, "lit_model.pth")
    assert json.loads((eight_processes / "metrics.json").read_text())["world_size"] == 8
    assert_same_hugging_face_folder(eight_processes / "step-000002", one / "step-000002", tmp_path)


@pytest.mark.slow
def test_the_eight_process_checkpoint_resumes_in_one_process(eight_processes, inputs, runs, tmp_path):  # noqa: F811
    out_dir = tmp_path / "resumed"
    result = litgpt(*pretrain_args(inputs, out_dir, DEEPSEEK_V3), "--devices", "1", *FLOAT32, *SHARDED,
                    "--resume", eight_processes / "step-000002")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_resumed_where_it_stopped(out_dir, runs("deepseek-v3", "one", "--devices", "1", *FLOAT32))


def gradient_norm_matches_one_process(rank: int, world: int, port: int, failures) -> None:
    """On each of 4 ranks (TP2 x EP2, every data-parallel rank fed the same batch): the DeepSeek-V3 shape split and
    sharded as training does, from one process's seed; its loss and its gradient norm over both meshes (the experts'
    pieces on the expert mesh, the rest on the model's, the tensor-replicated router and norms once) are the whole
    model's."""
    from test_plan import shard_and_initialize, split_model
    from test_tensor_parallel import gloo_rank

    from litgpt.config import Config
    from litgpt.distributed.expert_parallel import gradient_norm_with_experts
    from litgpt.model import GPT
    from litgpt.train.loss import loss_function

    with gloo_rank(rank, world, port, failures):
        config = Config(**DEEPSEEK_V3)
        whole = GPT(config)
        torch.manual_seed(0)
        whole.init_weights()
        with torch.device("meta"):
            split = GPT(config)
        meshes, _ = split_model(split, dict(tensor=2, expert=2))
        torch.manual_seed(0)
        shard_and_initialize(split, meshes, "32-true", torch.device("cpu"))
        idx, labels = (torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(seed))
                       for seed in (1, 2))
        loss = loss_function("cross_entropy")
        expected, actual = (loss(model, idx, labels)["loss"] for model in (whole, split))
        expected.backward()
        actual.backward()
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
        whole_norm = torch.nn.utils.get_total_norm([p.grad for p in whole.parameters() if p.grad is not None])
        _, expert_mesh = meshes
        torch.testing.assert_close(gradient_norm_with_experts(split, expert_mesh["expert"]), whole_norm, rtol=1e-5,
                                   atol=0)


@pytest.mark.slow  # spawns 4 processes
def test_the_gradient_norm_under_tensor_times_expert_parallelism_is_one_process_s():
    from test_tensor_parallel import run_spawned_ranks

    run_spawned_ranks(gradient_norm_matches_one_process, 4)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_in_one_process(inputs, runs, tmp_path):  # noqa: F811
    one = runs("deepseek-v3", "one", "--devices", "1", *FLOAT32)
    two = runs("deepseek-v3", "two", *EP2)
    out_dir = tmp_path / "resumed"
    result = litgpt(*pretrain_args(inputs, out_dir, DEEPSEEK_V3), "--devices", "1", *FLOAT32,
                    "--resume", two / "step-000002")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_final(out_dir, one, "lit_model.pth", atol=1e-4)


@pytest.mark.slow
def test_a_sharded_expert_parallel_checkpoint_keeps_the_one_process_layout(runs):
    """Each rank writes its own experts: under their one-process names, of their one-process shapes, and the
    optimizer's group lists every parameter in one process's order (not the experts of whichever rank wrote it)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from litgpt.io import read_sharded_metadata

    step = runs("deepseek-v3", "two-sharded", *EP2, *SHARDED) / "step-000002"
    reference = runs("deepseek-v3", "one", "--devices", "1", *FLOAT32) / "step-000002"
    weights = load_state_dict(reference / "lit_model.pth")
    metadata = read_sharded_metadata(step / "sharded").state_dict_metadata
    assert {key[len("model."):]: item.size for key, item in metadata.items() if key.startswith("model.")} == {
        key: value.shape for key, value in weights.items()}
    saved = _load_state_dict_from_keys({"optimizer.param_groups.0.params"}, checkpoint_id=step / "sharded")
    one_process = load_state_dict(reference / TRAINING_STATE_FILE)["optimizer"]["param_groups"][0]["params"]
    assert saved["optimizer"]["param_groups"][0]["params"] == one_process


@pytest.mark.slow
@pytest.mark.parametrize("devices", ["1", "2"], ids=["one-process", "fsdp2"])
def test_a_sharded_expert_parallel_checkpoint_resumes_without_it(devices, inputs, runs, tmp_path):  # noqa: F811
    """EP2's sharded step 2 (DeepSeek-V3 shape) resumed by one process and by FSDP over 2 processes holding every
    expert (EP1): each goes on as the uninterrupted run."""
    two = runs("deepseek-v3", "two-sharded", *EP2, *SHARDED)
    out_dir = tmp_path / "resumed"
    result = litgpt(*pretrain_args(inputs, out_dir, DEEPSEEK_V3), "--devices", devices, *FLOAT32, *SHARDED,
                    "--resume", two / "step-000002")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_resumed_where_it_stopped(out_dir, runs("deepseek-v3", "one", "--devices", "1", *FLOAT32))


@pytest.mark.slow
def test_a_sharded_one_process_checkpoint_resumes_under_expert_parallelism(inputs, runs, tmp_path):  # noqa: F811
    """The other way: one process's sharded step 2 read by EP2, each rank taking its own experts."""
    one = runs("deepseek-v3", "one-sharded", "--devices", "1", *FLOAT32, *SHARDED)
    out_dir = tmp_path / "resumed"
    result = litgpt(*pretrain_args(inputs, out_dir, DEEPSEEK_V3), *EP2, *SHARDED, "--resume", one / "step-000002")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_resumed_where_it_stopped(out_dir, runs("deepseek-v3", "one", "--devices", "1", *FLOAT32))


@pytest.mark.slow
def test_a_sharded_expert_parallel_checkpoint_converts_as_one_process(runs, tmp_path):
    two = runs("deepseek-v3", "two-sharded", *EP2, *SHARDED)
    one = runs("deepseek-v3", "one", "--devices", "1", *FLOAT32)
    assert_same_hugging_face_folder(two / "step-000002", one / "step-000002", tmp_path)


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_under_expert_parallelism(inputs, runs, tmp_path):  # noqa: F811
    one = runs("qwen3-moe", "one", "--devices", "1", *FLOAT32)
    out_dir = tmp_path / "resumed"
    result = litgpt(*pretrain_args(inputs, out_dir, QWEN3_MOE), *EP2, "--resume", one / "step-000002")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_final(out_dir, one, "lit_model.pth", atol=1e-4)


# ---- the mesh -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy, devices, nodes, expert, shape",
    [("FULL_SHARD", 2, 1, 2, (1, 1, 2)), ("FULL_SHARD", 2, 2, 2, (1, 2, 2)), ("HYBRID_SHARD", 4, 2, 2, (2, 2, 2)),
     ("HYBRID_SHARD", 2, 2, 4, (1, 1, 4)), ("NO_SHARD", 2, 2, 2, (2, 1, 2))],
)
def test_expert_groups_are_the_innermost_data_parallel_ranks(strategy, devices, nodes, expert, shape):
    topology = Topology(devices, nodes, strategy, expert=expert)
    assert topology.expert_mesh_shape == shape
    assert topology.data_parallel_size == devices * nodes  # every rank reads its own batches


@pytest.mark.parametrize(
    "devices, nodes, strategy, tensor, expert, message",
    [(4, 1, "FULL_SHARD", 1, 3, "--parallel.expert 3 does not divide the 4 data-parallel devices"),
     (4, 1, "FULL_SHARD", 2, 4, "--parallel.expert 4 does not divide the 2 data-parallel devices"),
     (4, 2, "HYBRID_SHARD", 1, 8, None)],
)
def test_what_the_expert_mesh_refuses(devices, nodes, strategy, tensor, expert, message):
    if message is None:
        assert Topology(devices, nodes, strategy, tensor, expert).expert_mesh_shape == (1, 1, 8)
        return
    with pytest.raises(UserError, match=message):
        Topology(devices, nodes, strategy, tensor, expert)


@pytest.mark.parametrize(
    "strategy, devices, nodes, tensor, expert, shape",
    [("FULL_SHARD", 2, 4, 2, 2, (1, 2, 2)), ("HYBRID_SHARD", 8, 4, 8, 2, (2, 1, 2)),
     ("HYBRID_SHARD", 8, 2, 2, 4, (2, 1, 4)), ("FULL_SHARD", 8, 32, 8, 8, (1, 4, 8))],
)
def test_with_tensor_parallelism_the_expert_groups_are_of_data_parallel_ranks(strategy, devices, nodes, tensor,
                                                                              expert, shape):
    """The expert mesh lays out the data-parallel ranks (one per tensor-parallel group): TP within a node, EP over
    the ranks that share a tensor rank (across nodes when a node is one tensor-parallel group), FSDP the rest."""
    topology = Topology(devices, nodes, strategy, tensor, expert)
    assert topology.expert_mesh_shape == shape
    assert topology.data_parallel_size == devices * nodes // tensor


# ---- refusals -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model, flags, message",
    [
        (SMALL, EP2, "--parallel.expert 2: dist-llama is a dense model"),
        ({**QWEN3_MOE, "n_expert": 3}, EP2, "--parallel.expert 2 does not divide the 3 experts (n_expert)"),
        (QWEN3_MOE, ["--devices", "2", "--parallel.expert", "4", *FLOAT32],
         "--parallel.expert 4 does not divide the 2 data-parallel devices"),
        (QWEN3_MOE, ["--devices", "1", "--parallel.expert", "2"], "--parallel.expert 2 splits the experts over 2"),
        (QWEN3_MOE, ["--devices", "2", "--parallel.expert", "0"], "--parallel.expert must be a whole number"),
    ],
)
def test_what_expert_parallelism_refuses(model, flags, message, inputs, tmp_path):  # noqa: F811
    out_dir = tmp_path / "out"
    result = litgpt(*pretrain_args(inputs, out_dir, model), *flags, env=child_environment())
    assert_refused_before_writing(result, message, out_dir)


@pytest.fixture(scope="module")
def lora_runs(inputs, tmp_path_factory):  # noqa: F811
    """`lora_runs(name)`: the out_dir of LoRA on every linear layer, the experts' too (--lora_mlp), of a Qwen3-MoE
    shape: "one" process, "ep2" (2 processes), "tp2-ep2" (4 processes: 2 torchrun "nodes" of 2); launched once."""
    from checkpoint_helpers import write_random_checkpoint

    from litgpt.config import Config

    root = tmp_path_factory.mktemp("ep-lora")
    moe_inputs = {**inputs, "base": write_random_checkpoint(root / "base", Config(**QWEN3_MOE))}
    done = {}

    def run(name: str) -> Path:
        if name not in done:
            args = command_args("finetune_lora", moe_inputs, root / name)
            if name == "tp2-ep2":
                args += ["--devices", "2", "--num_nodes", "2", *TP2_EP2, "--fsdp.sharding_strategy", "FULL_SHARD",
                         *FLOAT32]
                results = torchrun_nodes([args, args], [{}, {}], timeout=600)
            else:
                results = [litgpt(*args, *(EP2 if name == "ep2" else ["--devices", "1", *FLOAT32]))]
            for result in results:
                assert result.returncode == 0, result.stderr[-3000:]
            done[name] = root / name
        return done[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2", "tp2-ep2"])
def test_expert_parallel_lora_equals_one_process(name, lora_runs):
    """Each rank adapts its own experts (under TP2 x EP2 each expert's adapters split with its width: A whole and B
    split next to fc_1 and fc_2, A split and B whole next to proj), whose adapters draw what one process draws; the
    adapters equal one process's."""
    assert_close_runs(lora_runs(name), lora_runs("one"), "lit_model.pth.lora")
    assert any(".mlp.experts.3." in key for key in final_weights(lora_runs(name), "lit_model.pth.lora"))

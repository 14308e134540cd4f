"""Expert parallelism (`--parallel.expert`) with real processes on the CPU (gloo), against one process: EP2 on a
Qwen3-MoE shape and on a DeepSeek-V3 shape (latent attention, shared experts, a dense first layer, group-limited
sigmoid routing), EP2 x FSDP2 (4 processes), an EP2 checkpoint resumed in one process, the mesh's layout, and the
refusals.

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
    assert_same_final,
    child_environment,
    command_args,
    final_weights,
    inputs,  # noqa: F401 (the module-scoped fixture, shared)
    litgpt,
    torchrun_nodes,
)

from litgpt.distributed.topology import Topology
from litgpt.errors import UserError

FLOAT32 = ["--precision", "32-true"]
EP2 = ["--devices", "2", "--parallel.expert", "2", *FLOAT32]
MOE = dict(mlp_class_name="LLaMAMoE", moe_intermediate_size=32, n_expert=4, n_expert_per_token=2,
           router_aux_loss_coef=0.01)
# Qwen3-MoE: softmax routing without renormalization, query/key norms, no shared experts.
QWEN3_MOE = {**SMALL, **MOE, "name": "tiny-qwen3-moe", "norm_qk": True, "moe_renormalize": False}
# DeepSeek-V3: latent attention, a dense first layer, a shared expert, sigmoid routing with a correction bias and
# group-limited choice (2 of 4 groups of 2), scaled weights.
DEEPSEEK_V3 = {**SMALL, **MOE, "name": "tiny-deepseek-v3", "n_layer": 2, "n_expert": 8, "n_expert_per_token": 3,
               "n_query_groups": 4, "head_size": 24, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
               "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_n_shared_expert": 1, "moe_shared_intermediate_size": 32,
               "moe_score_function": "sigmoid", "moe_expert_bias": True, "moe_n_group": 4, "moe_topk_group": 2,
               "moe_routed_scaling": 2.5, "moe_first_dense_layers": 1}
SHAPES = {"qwen3-moe": QWEN3_MOE, "deepseek-v3": DEEPSEEK_V3}


def pretrain_args(inputs: dict, out_dir: Path, model: dict) -> list:  # noqa: F811
    args = command_args("pretrain", inputs, out_dir)
    config = out_dir.parent / f"{out_dir.name}.yaml"
    config.write_text(json.dumps({"model_config": model}))
    args[args.index("--config") + 1] = config
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
    assert {k: v.shape for k, v in final_weights(two, "lit_model.pth").items()} == {
        k: v.shape for k, v in reference.items()}
    assert json.loads((two / "metrics.json").read_text())["world_size"] == 2

"""Pipeline parallelism (`--parallel.pipeline`) with real processes on the CPU (gloo), against one process: PP2 with
each schedule, PP2 x FSDP2 (two torchrun "nodes" of 2), pretraining and LoRA finetuning, checkpoints saved under one
layout and resumed under the other, the stage split, the mesh, and the refusals.

The model has 4 layers, so 2 devices run 4 stages under the interleaved schedules. The runs are in float32
(`--precision 32-true`), the losses compared to 1e-5 and the final weights to 1e-4.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import write_random_checkpoint
from test_distributed import inputs  # noqa: F401 (the module-scoped fixture, shared)
from test_distributed import SMALL, assert_close_runs, assert_same_final, child_environment, command_args, litgpt
from test_distributed import assert_resumed_where_it_stopped, final_weights, losses, torchrun_nodes, write_config
from test_tensor_parallel import assert_refused_before_writing

from litgpt.args import ParallelArgs
from litgpt.config import Config
from litgpt.distributed.pipeline import check_microbatches, stage_layers
from litgpt.distributed.topology import Topology
from litgpt.errors import UserError

FLOAT32 = ["--precision", "32-true"]
LAYERS = 4
PP2 = ["--devices", "2", "--parallel.pipeline", "2", *FLOAT32]


def pretrain_args(inputs: dict, out_dir: Path) -> list:  # noqa: F811
    """pretrain of the test inputs, with a model of LAYERS layers."""
    args = command_args("pretrain", inputs, out_dir)
    args[args.index("--config") + 1] = write_config(inputs["root"] / "pp-model.yaml", n_layer=LAYERS)
    return args


def lora_args(inputs: dict, out_dir: Path) -> list:  # noqa: F811
    """finetune_lora of the test inputs, on a random base of LAYERS layers."""
    base = inputs["root"] / "pp-base"
    if not (base / "lit_model.pth").exists():
        write_random_checkpoint(base, Config(**{**SMALL, "n_layer": LAYERS}))
    args = command_args("finetune_lora", inputs, out_dir)
    args[args.index(inputs["base"])] = base
    return args


def run(args: list, *flags) -> str:
    """Run a command; returns its standard output."""
    result = litgpt(*args, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def trainable_line(stdout: str) -> str:
    """The number of trainable parameters a run says it trains."""
    (line,) = [line for line in stdout.splitlines() if line.endswith("trainable parameters.")]
    return line.rsplit(", ", 1)[1]


def run_four(args: list, *flags) -> None:
    """4 processes: two torchrun "nodes" of 2, each node one pipeline rank's 2 data-parallel ranks (FULL_SHARD)."""
    args = [*args, "--devices", "2", "--num_nodes", "2", "--parallel.pipeline", "2", "--fsdp.sharding_strategy",
            "FULL_SHARD", *FLOAT32, *flags]
    results = torchrun_nodes([args, args], [{}, {}], timeout=600)
    # Every node's error: the one that failed first may be either.
    assert all(result.returncode == 0 for result in results), "\n".join(r.stderr[-20000:] for r in results)


def assert_same_validation(run_dir: Path, reference: Path) -> None:
    """The final validation (the eval forward through the stages) gives one process's loss."""
    ours, theirs = (json.loads((path / "metrics.json").read_text())["val_loss"] for path in (run_dir, reference))
    assert ours == pytest.approx(theirs, abs=1e-5)


@pytest.fixture(scope="module")
def one_process(inputs) -> Path:  # noqa: F811
    out_dir = inputs["root"] / "pp-one"
    run(pretrain_args(inputs, out_dir), "--devices", "1", *FLOAT32)
    return out_dir


@pytest.fixture(scope="module")
def pp2_run(inputs) -> Path:  # noqa: F811
    """PP2 with 1F1B (one stage per device), full checkpoints at steps 2 and 4."""
    out_dir = inputs["root"] / "pp-two"
    run(pretrain_args(inputs, out_dir), *PP2)
    return out_dir


@pytest.mark.slow
def test_pipeline_pretraining_equals_one_process(pp2_run, one_process):
    assert_close_runs(pp2_run, one_process, "lit_model.pth")
    assert_same_validation(pp2_run, one_process)
    assert json.loads((pp2_run / "metrics.json").read_text())["world_size"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_zero_bubble_schedules_equal_one_process(schedule, inputs, one_process, tmp_path):  # noqa: F811
    """Two stages per device, each backward pass split into the inputs' and the weights' gradients."""
    run(pretrain_args(inputs, tmp_path / "out"), *PP2, "--parallel.pipeline_schedule", schedule)
    assert_close_runs(tmp_path / "out", one_process, "lit_model.pth")


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_in_one_process(inputs, pp2_run, one_process, tmp_path):  # noqa: F811
    out_dir = tmp_path / "resumed"
    result = litgpt(*pretrain_args(inputs, out_dir), "--devices", "1", *FLOAT32, "--resume",
                    pp2_run / "step-000002")
    assert result.returncode == 0, result.stderr
    assert "Training 4 steps from step 2" in result.stdout
    assert losses(out_dir) == pytest.approx(losses(one_process)[2:], abs=1e-5)
    assert_same_final(out_dir, one_process, "lit_model.pth", atol=1e-4)


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_under_pipeline_parallelism(inputs, one_process, tmp_path):  # noqa: F811
    out_dir = tmp_path / "resumed"
    run(pretrain_args(inputs, out_dir), *PP2, "--resume", one_process / "step-000002")
    assert losses(out_dir) == pytest.approx(losses(one_process)[2:], abs=1e-5)
    assert_same_final(out_dir, one_process, "lit_model.pth", atol=1e-4)


@pytest.mark.slow
def test_a_tied_embedding_pipeline_equals_one_process(inputs, tmp_path):  # noqa: F811
    """The output head tied to the embedding (Gemma's, Llama 3.2's, small Qwens' layout) lives on the first and the
    last stage: PP2 (1F1B; the two on two devices), ZBVZeroBubble (both on the first device, in its V), PP2 x FSDP2
    (each device's shard of the pair) and PP2 x TP2 (each device's vocabulary rows of the pair) equal one process:
    losses, validation (where one data-parallel rank reads it all) and final weights (the embedding and the head one
    tensor again); LoRA on a tied base too; the PP2 run's full checkpoint and the PP2 x FSDP2 run's sharded one
    resume in one process where they stopped."""
    runs = {}
    for name, flags in {"one": ["--devices", "1", *FLOAT32], "pp2": PP2,
                        "zbv": [*PP2, "--parallel.pipeline_schedule", "ZBVZeroBubble"]}.items():
        args = pretrain_args(inputs, tmp_path / name)
        args[args.index("--config") + 1] = write_config(tmp_path / "tied.yaml", n_layer=LAYERS, tie_embeddings=True)
        stdout = run(args, *flags)
        runs[name] = args, trainable_line(stdout)
    run_four([tmp_path / "four" if arg == tmp_path / "one" else arg for arg in runs["one"][0]],
             "--fsdp.state_dict_type", "sharded")
    run_four([tmp_path / "pp2-tp2" if arg == tmp_path / "one" else arg for arg in runs["one"][0]],
             "--parallel.tensor", "2")
    assert runs["pp2"][1] == runs["zbv"][1] == runs["one"][1]  # the tied weight counted once
    for name in ("pp2", "zbv", "four", "pp2-tp2"):
        assert_close_runs(tmp_path / name, tmp_path / "one", "lit_model.pth")
        if name != "four":  # whose validation averages two data-parallel ranks' samples
            assert_same_validation(tmp_path / name, tmp_path / "one")
        final = final_weights(tmp_path / name, "lit_model.pth")
        assert torch.equal(final["lm_head.weight"], final["transformer.wte.weight"])
    # LoRA on a tied base: the pair frozen, equal on both stages from the base checkpoint's two names.
    base = tmp_path / "tied-base"
    write_random_checkpoint(base, Config(**{**SMALL, "n_layer": LAYERS, "tie_embeddings": True}))
    for name, flags in {"lora-one": ["--devices", "1", *FLOAT32], "lora-pp2": PP2}.items():
        args = lora_args(inputs, tmp_path / name)
        args[args.index(inputs["root"] / "pp-base")] = base
        run(args, *flags)
    assert_close_runs(tmp_path / "lora-pp2", tmp_path / "lora-one", "lit_model.pth.lora")
    for name in ("pp2", "four"):  # a full checkpoint, and a sharded one (the head's optimizer state by its name)
        resumed = [tmp_path / f"resumed-{name}" if arg == tmp_path / "one" else arg for arg in runs["one"][0]]
        run(resumed, "--devices", "1", *FLOAT32, "--resume", tmp_path / name / "step-000002")
        assert_resumed_where_it_stopped(tmp_path / f"resumed-{name}", tmp_path / "one")


@pytest.fixture(scope="module")
def pp2_fsdp2_run(inputs) -> Path:  # noqa: F811
    """4 processes: PP2 x FSDP2 with Interleaved1F1B (2 stages per device), sharded checkpoints."""
    out_dir = inputs["root"] / "pp-four"
    run_four(pretrain_args(inputs, out_dir), "--parallel.pipeline_schedule", "Interleaved1F1B",
             "--fsdp.state_dict_type", "sharded")
    return out_dir


@pytest.mark.slow
def test_pipeline_times_fsdp_equals_one_process(pp2_fsdp2_run, one_process):
    # final/: gathered from both pipeline ranks. (Its validation averages two data-parallel ranks' samples, one
    # process's reads one: the PP2 runs compare validation.)
    assert_close_runs(pp2_fsdp2_run, one_process, "lit_model.pth")


@pytest.mark.slow
def test_a_sharded_pipeline_checkpoint_resumes_in_one_process(inputs, pp2_fsdp2_run, one_process,  # noqa: F811
                                                             tmp_path):
    """The stages keep the one-process names, so torch.distributed.checkpoint reshards their checkpoint."""
    out_dir = tmp_path / "resumed"
    run(pretrain_args(inputs, out_dir), "--devices", "1", *FLOAT32, "--fsdp.state_dict_type", "sharded",
        "--resume", pp2_fsdp2_run / "step-000002")
    assert losses(out_dir) == pytest.approx(losses(one_process)[2:], abs=1e-5)
    assert_same_final(out_dir, one_process, "lit_model.pth", atol=1e-4)


@pytest.fixture(scope="module")
def pp2_tp2_run(inputs) -> Path:  # noqa: F811
    """4 processes: PP2 x TP2 (each node's 2 devices split each of their stages, the residual stream between stages
    split over the sequence), Interleaved1F1B, sharded checkpoints."""
    out_dir = inputs["root"] / "pp-tp"
    run_four(pretrain_args(inputs, out_dir), "--parallel.tensor", "2", "--parallel.pipeline_schedule",
             "Interleaved1F1B", "--fsdp.state_dict_type", "sharded")
    return out_dir


@pytest.mark.slow
def test_pipeline_times_tensor_parallelism_equals_one_process(pp2_tp2_run, one_process):
    assert_close_runs(pp2_tp2_run, one_process, "lit_model.pth")
    assert_same_validation(pp2_tp2_run, one_process)


@pytest.mark.slow
def test_a_pipeline_times_tensor_parallel_checkpoint_resumes_in_one_process(inputs, pp2_tp2_run,  # noqa: F811
                                                                            one_process, tmp_path):
    out_dir = tmp_path / "resumed"
    run(pretrain_args(inputs, out_dir), "--devices", "1", *FLOAT32, "--fsdp.state_dict_type", "sharded",
        "--resume", pp2_tp2_run / "step-000002")
    assert losses(out_dir) == pytest.approx(losses(one_process)[2:], abs=1e-5)
    assert_same_final(out_dir, one_process, "lit_model.pth", atol=1e-4)


# ---- mixtures of experts -------------------------------------------------------------------------------------------
# Routers with a load-balancing loss, a dense first layer (DeepSeek's): the loss over every layer's routing together.
MOE = dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=32,
           router_aux_loss_coef=0.05, moe_first_dense_layers=1)


def moe_aux_losses(run_dir: Path) -> list[float]:
    """The load-balancing loss a run logged at each step."""
    (log,) = run_dir.rglob("metrics.csv")
    with open(log) as f:
        return [float(row["aux_loss"]) for row in csv.DictReader(f) if row.get("aux_loss")]


@pytest.mark.slow
def test_a_mixture_of_experts_pipeline_equals_one_process(inputs, tmp_path):  # noqa: F811
    """The routing statistics of every stage's MoE layers travel beside the residual stream, so the last stage's
    load-balancing loss is the whole model's and its gradient reaches every router: PP2 with 1F1B, PP2 x TP2 with
    Interleaved1F1B (4 stages) and PP2 x EP2 (each stage's experts split over the 2 data-parallel devices of its
    pipeline rank, which read different batches) equal one process: losses, load-balancing losses and final
    weights; the PP2 x EP2 run's checkpoint resumes in one process."""
    runs = {}
    for name, flags in {"one": ["--devices", "1", *FLOAT32], "pp2": PP2}.items():
        args = pretrain_args(inputs, tmp_path / name)
        args[args.index("--config") + 1] = write_config(tmp_path / "moe.yaml", n_layer=LAYERS, **MOE)
        run(args, *flags)
        runs[name] = args
    four = {"pp2-tp2": ["--parallel.tensor", "2", "--parallel.pipeline_schedule", "Interleaved1F1B"],
            "pp2-ep2": ["--parallel.expert", "2"]}
    for name, flags in four.items():
        run_four([tmp_path / name if arg == tmp_path / "one" else arg for arg in runs["one"]], *flags)
    reference = moe_aux_losses(tmp_path / "one")
    assert len(reference) == 4 and min(reference) > 0
    for name in ("pp2", *four):
        assert_close_runs(tmp_path / name, tmp_path / "one", "lit_model.pth")
        assert moe_aux_losses(tmp_path / name) == pytest.approx(reference, abs=1e-6)
    # The PP2 x EP2 checkpoint (every stage's experts and their optimizer state gathered) resumes in one process.
    resumed = [tmp_path / "resumed" if arg == tmp_path / "one" else arg for arg in runs["one"]]
    run(resumed, "--devices", "1", *FLOAT32, "--resume", tmp_path / "pp2-ep2" / "step-000002")
    assert_resumed_where_it_stopped(tmp_path / "resumed", tmp_path / "one")


@pytest.mark.slow
def test_a_mixture_of_experts_lora_pipeline_equals_one_process(inputs, tmp_path):  # noqa: F811
    """Finetuning batches of varying lengths (cut at 63 positions) padded to the schedule's 64: the routing
    statistics leave out the padding one process does not have, under PP2 and under PP2 x CP2 (where the last
    context rank's slice holds it)."""
    base = tmp_path / "moe-base"
    write_random_checkpoint(base, Config(**{**SMALL, "n_layer": LAYERS, **MOE}))
    args = lora_args(inputs, tmp_path / "one")
    args[args.index(inputs["root"] / "pp-base")] = base
    args[args.index("--train.max_seq_length") + 1] = "63"
    run(args, "--devices", "1", *FLOAT32)
    run([tmp_path / "pp2" if arg == tmp_path / "one" else arg for arg in args], *PP2)
    run_four([tmp_path / "pp2-cp2" if arg == tmp_path / "one" else arg for arg in args], "--parallel.context", "2")
    reference = moe_aux_losses(tmp_path / "one")
    assert len(reference) == 4 and min(reference) > 0
    for name in ("pp2", "pp2-cp2"):
        assert_close_runs(tmp_path / name, tmp_path / "one", "lit_model.pth.lora")
        assert moe_aux_losses(tmp_path / name) == pytest.approx(reference, abs=1e-6)


# ---- LoRA ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_one_process(inputs) -> Path:  # noqa: F811
    out_dir = inputs["root"] / "pp-lora-one"
    (out_dir.parent / "pp-lora-one.stdout").write_text(run(lora_args(inputs, out_dir), "--devices", "1", *FLOAT32))
    return out_dir


@pytest.mark.slow
def test_pipeline_lora_equals_one_process(inputs, lora_one_process, tmp_path):  # noqa: F811
    out_dir = tmp_path / "out"
    stdout = run(lora_args(inputs, out_dir), *PP2, "--parallel.pipeline_schedule", "Interleaved1F1B")
    # Every stage's adapters counted, as one process counts them
    assert trainable_line(stdout) == trainable_line((lora_one_process.parent / "pp-lora-one.stdout").read_text())
    assert_close_runs(out_dir, lora_one_process, "lit_model.pth.lora")  # the adapters of every stage
    assert_same_final(out_dir, lora_one_process, "lit_model.pth", atol=1e-4)  # final/: merged into the base
    assert_same_validation(out_dir, lora_one_process)


@pytest.mark.slow
def test_pipeline_times_fsdp_lora_equals_one_process(inputs, lora_one_process):  # noqa: F811
    out_dir = inputs["root"] / "pp-lora-four"
    run_four(lora_args(inputs, out_dir))
    assert_close_runs(out_dir, lora_one_process, "lit_model.pth.lora")


@pytest.mark.slow
def test_pipeline_times_context_parallelism_equals_one_process(inputs, one_process, tmp_path):  # noqa: F811
    """PP2 x CP2: each stage's 2 devices run half of every sequence's positions, attention gathering every position
    of half of the heads; the loss on the last stage's slices, summed over its group."""
    run_four(pretrain_args(inputs, tmp_path / "out"), "--parallel.context", "2")
    assert_close_runs(tmp_path / "out", one_process, "lit_model.pth")
    assert_same_validation(tmp_path / "out", one_process)


@pytest.mark.slow
def test_pipeline_times_tensor_or_context_parallel_lora_equals_one_process(inputs, tmp_path):  # noqa: F811
    """Finetuning's batches of varying lengths, cut at 63 positions, padded to one shape of 64 positions, which split
    over the tensor-parallel group (PP2 x TP2) or the context-parallel one (PP2 x CP2); validation's batches padded the
    same way."""
    args = lora_args(inputs, tmp_path / "one")
    args[args.index("--train.max_seq_length") + 1] = "63"
    run(args, "--devices", "1", *FLOAT32)
    for degree in ("tensor", "context"):
        run_four([tmp_path / degree if arg == tmp_path / "one" else arg for arg in args], f"--parallel.{degree}", "2")
        assert_close_runs(tmp_path / degree, tmp_path / "one", "lit_model.pth.lora")
        assert_same_final(tmp_path / degree, tmp_path / "one", "lit_model.pth", atol=1e-4)


@pytest.mark.slow
def test_pipeline_qlora_equals_one_process(inputs, tmp_path):  # noqa: F811
    """A 4-bit NF4 base (a 704-wide MLP, whose rows do not split into whole NF4 blocks per device) quantized stage by
    stage, under PP2 and under PP2 x FSDP2, trains the adapters as one process does with the same quantization. In
    float32: under bf16-mixed the residual stream crosses between stages in bfloat16, one process keeps it in float32
    (the runs then differ by ~1e-4)."""
    from test_distributed import QLORA_MODEL, qlora_args

    base = write_random_checkpoint(tmp_path / "base", Config(**{**QLORA_MODEL, "n_layer": LAYERS}))
    run(qlora_args(inputs, base, tmp_path / "one", "--quantize", "ao.nf4", "--devices", "1", *FLOAT32))
    run(qlora_args(inputs, base, tmp_path / "pp2", "--quantize", "bnb.nf4", *PP2))
    run_four(qlora_args(inputs, base, tmp_path / "pp2-fsdp2", "--quantize", "bnb.nf4"))
    for name in ("pp2", "pp2-fsdp2"):
        assert_close_runs(tmp_path / name, tmp_path / "one", "lit_model.pth.lora")
        assert_same_final(tmp_path / name, tmp_path / "one", "lit_model.pth", atol=1e-4)


# ---- the layout (no processes) ---------------------------------------------------------------------------------------
def test_stages_hold_consecutive_blocks_as_even_as_they_split():
    assert stage_layers(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert [len(layers) for layers in stage_layers(61, 8)] == [8, 8, 8, 8, 8, 7, 7, 7]


@pytest.mark.parametrize(
    "strategy, devices, nodes, shape, data_ranks",
    [("FULL_SHARD", 4, 1, (1, 2), [0, 1, 0, 1]), ("HYBRID_SHARD", 2, 4, (2, 2), [0, 1, 2, 3, 0, 1, 2, 3]),
     ("NO_SHARD", 2, 2, (2, 1), [0, 1, 0, 1])],
)
def test_the_pipeline_dimension_is_outermost(strategy, devices, nodes, shape, data_ranks):
    """Global rank p x (world / 2) + d runs pipeline rank p's stages and reads data-parallel rank d's batches."""
    topology = Topology(devices, nodes, strategy, pipeline=2)
    assert topology.mesh_shape == shape and topology.data_parallel_size == devices * nodes // 2
    assert [topology.data_parallel_rank(rank) for rank in range(devices * nodes)] == data_ranks


def test_what_the_schedules_need_of_the_micro_batches():
    check_microbatches("1F1B", 4, 4, 4)
    check_microbatches("Interleaved1F1B", 8, 4, 4)
    check_microbatches("Interleaved1F1B", 8, 4, 6)  # one round of 6
    with pytest.raises(UserError, match="needs at least 4 micro-batches per optimizer step, but the run has 2"):
        check_microbatches("1F1B", 4, 4, 2)
    with pytest.raises(UserError, match="do not split into 2 of them: use a multiple of 4"):
        check_microbatches("InterleavedZeroBubble", 8, 4, 9)


@pytest.mark.parametrize(
    "fields, message",
    [(dict(pipeline_schedule="GPipe"), "--parallel.pipeline_schedule 'GPipe' is not one of 1F1B"),
     (dict(pipeline_schedule="1F1B", pipeline_stages_per_rank=2), "runs 1 stage(s) per device, not 2"),
     (dict(pipeline_schedule="ZBVZeroBubble", pipeline_stages_per_rank=3), "runs 2 stage(s) per device, not 3"),
     (dict(pipeline_schedule="Interleaved1F1B", pipeline_stages_per_rank=1),
      "use --parallel.pipeline_stages_per_rank 2"),
     (dict(pipeline=0), "--parallel.pipeline must be a whole number")],
)
def test_what_the_pipeline_options_refuse(fields, message):
    with pytest.raises(UserError) as error:
        ParallelArgs(**fields)
    assert message in str(error.value)


def test_stages_per_rank_default_to_the_schedule():
    assert ParallelArgs(pipeline=2).pipeline_stages == 2
    assert ParallelArgs(pipeline=2, pipeline_schedule="Interleaved1F1B").pipeline_stages == 4
    assert ParallelArgs(pipeline=2, pipeline_schedule="InterleavedZeroBubble",
                        pipeline_stages_per_rank=3).pipeline_stages == 6


# ---- refusals -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, flags, message",
    [
        ({}, ["--devices", "2", "--parallel.pipeline", "3"], "--parallel.pipeline 3 does not divide the 2 devices"),
        ({}, ["--devices", "1", "--parallel.pipeline", "2"], "--parallel.pipeline 2 runs the model's stages on 2"),
        ({"n_layer": 2}, [*PP2, "--parallel.pipeline_schedule", "Interleaved1F1B"],
         "makes 4 pipeline stages, more than the model's 2 layers"),
        ({}, [*PP2, "--train.global_batch_size", "1"],
         "1F1B over 2 stages needs at least 2 micro-batches per optimizer step, but the run has 1"),
        ({}, [*PP2, "--compiler", "torch", "--parallel.pipeline_schedule", "ZBVZeroBubble"],
         "ZBVZeroBubble splits each backward pass in two, which runs eager only"),
    ],
)
def test_what_pipeline_parallelism_refuses(changes, flags, message, inputs, tmp_path):  # noqa: F811
    args = pretrain_args(inputs, tmp_path / "out")
    args[args.index("--config") + 1] = write_config(tmp_path / "model.yaml", **{"n_layer": LAYERS, **changes})
    result = litgpt(*args, *flags, env=child_environment())
    assert_refused_before_writing(result, message, tmp_path / "out")


def test_pipeline_and_context_parallelism_refuse_packed_samples(inputs, tmp_path):  # noqa: F811
    result = litgpt(*lora_args(inputs, tmp_path / "out"), "--data.packing", "true", "--devices", "2", "--num_nodes",
                    "2", "--parallel.pipeline", "2", "--parallel.context", "2", env=child_environment())
    assert_refused_before_writing(result, "--parallel.pipeline 2 with --parallel.context 2 and --data.packing is not "
                                          "supported yet", tmp_path / "out")


def test_preference_and_rl_training_refuse_pipeline_parallelism(inputs, tmp_path):  # noqa: F811
    for command in ("dpo", "grpo"):
        result = litgpt(command, inputs["base"], "--out_dir", tmp_path / "out", "--parallel.pipeline", "2")
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert "--parallel.pipeline" in result.stderr
        assert not (tmp_path / "out").exists()

"""FSDP2 with real processes on the CPU (gloo): every sharding strategy against a single-process run, checkpoints in
both formats, resharded resume, torchrun across two "nodes", QLoRA with a sharded NF4 base, and the launcher checks."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import write_random_checkpoint
from litgpt_forkserver import communicate, launched_litgpt, run_litgpt
from ports import free_port

from litgpt.io import load_state_dict
from litgpt.config import Config
from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR
from litgpt.errors import UserError
from litgpt.distributed.fabric import check_launcher
from litgpt.distributed.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(
    name="dist-llama", block_size=128, vocab_size=4096, padded_vocab_size=4096, n_layer=2, n_embd=64, n_head=4,
    n_query_groups=2, intermediate_size=128, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", bias=False,
    prompt_style="alpaca",
)
# Global batch 4 = 1 process x micro 1 x 4 accumulation = 2 processes x micro 1 x 2 = 4 processes x 1 x 1: the same
# samples per step whatever the world size, and a micro-batch of one sample keeps padding out of the comparison.
TRAIN = [
    "--train.global_batch_size", "4", "--train.micro_batch_size", "1", "--train.max_steps", "4",
    "--train.lr_warmup_steps", "1", "--train.log_interval", "1", "--train.save_interval", "2",
    "--train.max_seq_length", "64", "--train.max_norm", "1.0", "--eval.interval", "1000", "--eval.max_iters", "1",
    "--optimizer.class_path", "torch.optim.AdamW", "--optimizer.init_args.lr", "0.003",
    # Adam divides by sqrt(v) + eps: with the default 1e-8 an embedding row that sees a token once gets a full
    # lr-sized step from a gradient near 1e-8, whose last bits depend on the reduction order of the world size.
    "--optimizer.init_args.eps", "1e-6",
]
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


# ---- launcher checks and mesh layout (no processes) --------------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy, devices, nodes, shape",
    [("HYBRID_SHARD", 2, 2, (2, 2)), ("HYBRID_SHARD", 4, 1, (1, 4)), ("FULL_SHARD", 2, 2, (1, 4)),
     ("SHARD_GRAD_OP", 8, 1, (1, 8)), ("NO_SHARD", 2, 2, (4, 1))],
)
def test_mesh_shape(strategy, devices, nodes, shape):
    topology = Topology(devices, nodes, strategy)
    assert topology.mesh_shape == shape and topology.world_size == devices * nodes


def test_hybrid_shard_on_one_node_is_full_shard(capsys):
    assert Topology(4, 1, "HYBRID_SHARD").sharding_strategy == "FULL_SHARD"
    assert "on one node it is FULL_SHARD" in capsys.readouterr().err


def clean_environment(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")) or name in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        ):
            monkeypatch.delenv(name)


def torchrun_environment(monkeypatch, world: int, local: int) -> None:
    clean_environment(monkeypatch)
    values = dict(RANK=0, LOCAL_RANK=0, GROUP_RANK=0, WORLD_SIZE=world, LOCAL_WORLD_SIZE=local, TORCHELASTIC_RUN_ID="t")
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def slurm_environment(monkeypatch, tasks: int, tasks_per_node: str, per_node_flag: str | None = None) -> None:
    clean_environment(monkeypatch)
    values = dict(SLURM_NTASKS=tasks, SLURM_TASKS_PER_NODE=tasks_per_node, SLURM_JOB_NAME="train", SLURM_PROCID=0,
                  SLURM_LOCALID=0, SLURM_NODEID=0, SLURM_JOB_ID=7, SLURM_NODELIST="node1", SLURM_STEP_ID=0)
    if per_node_flag is not None:
        values["SLURM_NTASKS_PER_NODE"] = per_node_flag
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def test_torchrun_world_must_match_the_flags(monkeypatch):
    torchrun_environment(monkeypatch, world=4, local=2)
    check_launcher(2, 2, os.environ)  # matches
    with pytest.raises(UserError, match=r"torchrun started 4 process\(es\) \(2 per node\), but --devices 2 --num_nodes 1"):
        check_launcher(2, 1, os.environ)
    with pytest.raises(UserError, match="--nproc_per_node 4"):
        check_launcher(4, 1, os.environ)


def test_slurm_tasks_must_match_the_flags(monkeypatch):
    slurm_environment(monkeypatch, tasks=4, tasks_per_node="2(x2)")
    check_launcher(2, 2, os.environ)
    assert os.environ["SLURM_NTASKS_PER_NODE"] == "2"  # what Fabric needs, filled in for `srun --ntasks 4`
    with pytest.raises(UserError, match=r"Slurm started 4 task\(s\) \(2 per node\), but --devices 4 --num_nodes 1"):
        check_launcher(4, 1, os.environ)
    slurm_environment(monkeypatch, tasks=3, tasks_per_node="2,1")
    with pytest.raises(UserError, match="an uneven number per node"):
        check_launcher(3, 1, os.environ)
    slurm_environment(monkeypatch, tasks=2, tasks_per_node="2")
    with pytest.raises(UserError, match="Slurm started 2 task"):
        check_launcher(1, 1, os.environ)  # two independent single-device runs would write over each other


def test_a_multi_task_batch_script_must_use_srun(monkeypatch):
    slurm_environment(monkeypatch, tasks=2, tasks_per_node="2", per_node_flag="2")
    monkeypatch.delenv("SLURM_STEP_ID")  # the batch script itself, not a task started by srun
    with pytest.raises(UserError, match="start it with srun"):
        check_launcher(2, 1, os.environ)


def test_num_nodes_needs_a_launcher(monkeypatch):
    clean_environment(monkeypatch)
    with pytest.raises(UserError, match="--num_nodes 2 needs a launcher"):
        check_launcher(1, 2, os.environ)
    monkeypatch.setenv("NODE_RANK", "1")  # started by hand on each node
    check_launcher(1, 2, os.environ)


# ---- real processes ------------------------------------------------------------------------------------------------------

def child_environment(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def litgpt(*args, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m litgpt ARGS`, forked from a server that imported torch and Lightning once, as are the further ranks
    Lightning's launcher starts (tests/litgpt_forkserver.py)."""
    return run_litgpt(args, cwd=ROOT, env=env or child_environment(), timeout=timeout)


def torchrun_two_nodes(*args, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """Two `torchrun --nnodes 2 --node_rank 0|1` launches of 2 processes each on this machine: a 2 x 2 world."""
    return torchrun_nodes([args, args], [{}, {}], timeout)


def torchrun_nodes(args_per_node: list, env_per_node: list[dict], timeout: int = 600) -> list:
    """One `torchrun --nnodes N --node_rank i` launch of 2 processes on this machine for each of the N "nodes", each
    with its own arguments and extra environment variables (a node's own disks, say). Each rank runs `litgpt ARGS`,
    forked from a server that imported torch and Lightning once (`launched_litgpt`)."""
    port = free_port()
    launches = []
    for node_rank, (args, env) in enumerate(zip(args_per_node, env_per_node)):
        litgpt_command, launcher_env = launched_litgpt(child_environment(**env))
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(args_per_node)),
            "--nproc_per_node", "2",
            "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
            "--no-python", litgpt_command, *map(str, args),
        ]
        launches.append(subprocess.Popen(command, cwd=ROOT, env=launcher_env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for process in launches:
        stdout, stderr = communicate(process, timeout)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


def losses(out_dir: Path) -> list[float]:
    (log,) = Path(out_dir).rglob("metrics.csv")
    with open(log) as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row.get("loss")]


def final_weights(out_dir: Path, name: str) -> dict:
    return {k: v.clone() for k, v in load_state_dict(Path(out_dir) / "final" / name).items()}


def assert_close_runs(run: Path, reference: Path, weights_file: str, loss_tol=1e-5, weight_tol=1e-4) -> None:
    ours, theirs = losses(run), losses(reference)
    assert len(ours) == len(theirs) == 4
    assert min(theirs) > 0.5, f"the runs learn from no token: {theirs}"
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=loss_tol)
    assert_same_final(run, reference, weights_file, weight_tol)


def assert_same_final(run: Path, reference: Path, weights_file: str, atol: float) -> None:
    a, b = final_weights(run, weights_file), final_weights(reference, weights_file)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def assert_resumed_where_it_stopped(resumed: Path, reference: Path, weights_file: str = "lit_model.pth") -> None:
    """A run resumed from `reference`'s (or an equal run's) step 2: the losses of its steps 3 and 4 are the
    uninterrupted run's (the same batches: it went on from the data position it was saved at), and so are its
    final weights."""
    torch.testing.assert_close(torch.tensor(losses(resumed)), torch.tensor(losses(reference)[2:]), rtol=0, atol=1e-5)
    assert_same_final(resumed, reference, weights_file, atol=1e-4)


def hugging_face_tensors(step: Path, work: Path) -> tuple[dict, dict]:
    """(config.json, tensors) of the Hugging Face folder `litgpt convert_from_litgpt` writes from a step folder;
    a sharded one is put in one file by `litgpt consolidate` first."""
    from safetensors.torch import load_file

    work.mkdir(parents=True)
    if (step / "sharded").is_dir():
        result = litgpt("consolidate", step, "--out_dir", work / "consolidated")
        assert result.returncode == 0, result.stderr[-2000:]
        step = work / "consolidated"
    result = litgpt("convert_from_litgpt", step, work / "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    tensors = {}
    for file in sorted((work / "hf").glob("*.safetensors")):
        tensors.update(load_file(file))
    return json.loads((work / "hf" / "config.json").read_text()), tensors


def assert_same_hugging_face_folder(step: Path, reference_step: Path, work: Path) -> None:
    """`step` (saved on some mesh) and `reference_step` (one process's) convert to the same Hugging Face folder: the
    same config, tensor names, shapes and dtypes, and values within the runs' tolerance."""
    config, tensors = hugging_face_tensors(step, work / "run")
    reference_config, reference = hugging_face_tensors(reference_step, work / "reference")
    assert config == reference_config
    assert tensors.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(tensors[key], value, rtol=0, atol=1e-4, msg=key)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("distributed")
    base = write_random_checkpoint(root / "base", Config(**SMALL))
    instructions = root / "instructions.json"
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:40]
    instructions.write_text(json.dumps([{"instruction": "Continue the story.", "output": s[:200]} for s in stories]))
    texts = root / "texts"
    texts.mkdir()
    for i, story in enumerate((TINY_DIR / "train.txt").read_text().split("\n\n")[:60]):
        (texts / f"{i:03d}.txt").write_text(story)
    return {"base": base, "instructions": instructions, "texts": texts, "root": root}


def command_args(command: str, inputs: dict, out_dir: Path) -> list:
    """The command line of one entry point on the test inputs."""
    common = ["--out_dir", out_dir, *TRAIN, "--seed", "5"]
    if command == "pretrain":
        config = inputs["root"] / "model.yaml"
        config.write_text(json.dumps({"model_config": SMALL}))
        return ["pretrain", "--config", config, "--tokenizer_dir", TOKENIZER_DIR, "--data", "TextFiles",
                "--data.train_data_path", inputs["texts"], "--data.cache_dir", out_dir.parent / f"cache-{out_dir.name}",
                *common]
    # The plain prompt style: alpaca's template alone is 80 tokens, more than the 64 a sample keeps here, and would
    # leave no labelled token (losses of 0 that any two runs share).
    data = ["--data", "JSON", "--data.json_path", inputs["instructions"], "--data.val_split_fraction", "0.2",
            "--data.prompt_style", "default"]
    if command == "finetune_full":
        return ["finetune_full", inputs["base"], *data, *common]
    return ["finetune_lora", inputs["base"], *data, *common, "--lora_r", "4", "--lora_alpha", "8",
            "--lora_dropout", "0", "--lora_mlp", "true"]


WEIGHTS = {"pretrain": "lit_model.pth", "finetune_full": "lit_model.pth", "finetune_lora": "lit_model.pth.lora"}


@pytest.fixture(scope="module")
def single_process(inputs) -> dict:
    """The reference: each entry point in one process on the same global batch."""
    runs = {}
    for command in WEIGHTS:
        out_dir = inputs["root"] / f"single-{command}"
        result = litgpt(*command_args(command, inputs, out_dir), "--devices", "1")
        assert result.returncode == 0, result.stderr
        runs[command] = out_dir
    return runs


@pytest.fixture(scope="module")
def two_process_run(inputs):
    """`two_process_run(command, strategy)`: the out_dir of that entry point run by 2 processes with that sharding
    strategy (full checkpoints at steps 2 and 4), launched once for the module and shared by the tests that read it."""
    runs = {}

    def run(command: str, strategy: str) -> Path:
        if (command, strategy) not in runs:
            out_dir = inputs["root"] / f"two-{command}-{strategy}"
            result = litgpt(*command_args(command, inputs, out_dir), "--devices", "2", "--fsdp.sharding_strategy",
                            strategy)
            assert result.returncode == 0, result.stderr
            runs[command, strategy] = out_dir
        return runs[command, strategy]

    return run


# The 4-process runs (two torchrun "nodes" of 2) by entry point; finetune_lora writes sharded checkpoints, which
# test_sharded_checkpoint_from_four_processes_resumes_on_two resumes on 2 processes.
FOUR_PROCESS_FLAGS = {"pretrain": [], "finetune_full": [], "finetune_lora": ["--fsdp.state_dict_type", "sharded"]}


@pytest.fixture(scope="module")
def four_process_run(inputs):
    """`four_process_run(command)`: the out_dir of that entry point run with HYBRID_SHARD over 2 torchrun nodes x 2
    processes (FOUR_PROCESS_FLAGS added), launched once for the module."""
    runs = {}

    def run(command: str) -> Path:
        if command not in runs:
            out_dir = inputs["root"] / f"four-{command}"
            for result in torchrun_two_nodes(*command_args(command, inputs, out_dir), "--devices", "2", "--num_nodes",
                                             "2", *FOUR_PROCESS_FLAGS[command]):
                assert result.returncode == 0, result.stderr
            runs[command] = out_dir
        return runs[command]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("command", list(WEIGHTS))
def test_two_processes_equal_one(command, strategy, single_process, two_process_run):
    out_dir = two_process_run(command, strategy)
    assert_close_runs(out_dir, single_process[command], WEIGHTS[command])
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["sharding_strategy"] == strategy
    assert metrics["fsdp"]["sharding_strategy"] == strategy and len(metrics["peak_memory_mb_per_rank"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("command", list(WEIGHTS))
def test_hybrid_shard_over_two_torchrun_nodes_equals_one_process(command, single_process, four_process_run):
    out_dir = four_process_run(command)
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["num_nodes"] == 2 and metrics["sharding_strategy"] == "HYBRID_SHARD"
    assert_close_runs(out_dir, single_process[command], WEIGHTS[command])


@pytest.mark.slow
def test_cpu_offload_equals_one_process(inputs, single_process, tmp_path):
    out_dir = tmp_path / "offload"
    result = litgpt(*command_args("finetune_full", inputs, out_dir), "--devices", "2", "--fsdp.cpu_offload", "true")
    assert result.returncode == 0, result.stderr
    assert_close_runs(out_dir, single_process["finetune_full"], "lit_model.pth")


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["false", "true"])
def test_offloaded_activations_equal_one_process(checkpointing, inputs, single_process, tmp_path):
    """--train.offload_activations under FSDP (the hooks around the sharded model's forward pass, FSDP's gathered
    weights never copied) trains as one process without it, with and without checkpointing."""
    out_dir = tmp_path / "offload-activations"
    result = litgpt(*command_args("pretrain", inputs, out_dir), "--devices", "2", "--train.offload_activations",
                    "true", "--train.activation_checkpointing", checkpointing)
    assert result.returncode == 0, result.stderr
    assert "--train.offload_activations on a CPU" in result.stdout
    assert_close_runs(out_dir, single_process["pretrain"], "lit_model.pth")


@pytest.mark.slow
def test_bf16_mixed_trains_close_to_float32(inputs, single_process, tmp_path):
    """bf16 compute with float32 master weights and gradient reduction: the losses follow the float32 run's."""
    out_dir = tmp_path / "bf16"
    result = litgpt(*command_args("pretrain", inputs, out_dir), "--devices", "2", "--precision", "bf16-mixed")
    assert result.returncode == 0, result.stderr
    assert json.loads((out_dir / "metrics.json").read_text())["precision"] == "bf16-mixed"
    reference = losses(single_process["pretrain"])
    assert losses(out_dir) == pytest.approx(reference, abs=0.05) and losses(out_dir) != reference
    assert all(t.dtype == torch.float32 for t in final_weights(out_dir, "lit_model.pth").values())


# ---- checkpoints: full and sharded, resumed on other world sizes -------------------------------------------------------
@pytest.fixture(scope="module")
def sharded_run(inputs) -> Path:
    """pretrain with 2 processes writing sharded checkpoints at steps 2 and 4."""
    out_dir = inputs["root"] / "sharded-run"
    result = litgpt(*command_args("pretrain", inputs, out_dir), "--devices", "2",
                    "--fsdp.sharding_strategy", "FULL_SHARD", "--fsdp.state_dict_type", "sharded")
    assert result.returncode == 0, result.stderr
    return out_dir


@pytest.mark.slow
def test_sharded_checkpoint_layout_and_consolidation(sharded_run, single_process, tmp_path):
    step = sharded_run / "step-000002"
    assert (step / "sharded" / ".metadata").is_file() and not (step / "lit_model.pth").exists()
    assert len(list((step / "sharded").glob("*.distcp"))) == 2  # one file per rank, written in parallel
    # final/ holds the consolidated weights, equal to the single-process run's
    assert_same_final(sharded_run, single_process["pretrain"], "lit_model.pth", atol=1e-4)
    result = litgpt("consolidate", sharded_run / "step-000004", "--out_dir", tmp_path / "one-file")
    assert result.returncode == 0, result.stderr
    consolidated = load_state_dict(tmp_path / "one-file" / "lit_model.pth")
    for key, value in final_weights(sharded_run, "lit_model.pth").items():
        assert torch.equal(consolidated[key], value), key
    generated = litgpt("generate", tmp_path / "one-file", "--prompt", "Once", "--max_new_tokens", "3")
    assert generated.returncode == 0, generated.stderr
    unconsolidated = litgpt("generate", step, "--prompt", "Once")
    assert unconsolidated.returncode == 1 and f"litgpt consolidate {step}" in unconsolidated.stderr


@pytest.mark.slow
@pytest.mark.parametrize("devices, atol", [(2, 1e-6), (1, 1e-4)])
def test_sharded_checkpoint_resumes_on_the_same_and_a_smaller_world(devices, atol, sharded_run, inputs, tmp_path):
    out_dir = tmp_path / "resumed"
    result = litgpt(*command_args("pretrain", inputs, out_dir), "--devices", devices,
                    "--resume", sharded_run / "step-000002", "--fsdp.state_dict_type", "sharded")
    assert result.returncode == 0, result.stderr
    assert "Training 4 steps from step 2" in result.stdout
    assert losses(out_dir) == pytest.approx(losses(sharded_run)[2:], abs=1e-5)
    assert_same_final(out_dir, sharded_run, "lit_model.pth", atol=atol)


@pytest.mark.slow
def test_planted_bytes_item_of_a_two_process_checkpoint_is_refused_on_every_rank(sharded_run, inputs, tmp_path):
    """A pickle planted in a bytes item (the optimizer's learning rate) of a 2-process sharded checkpoint, its manifest
    rewritten to match: a 2-process `--resume` refuses it with one line and no rank runs it."""
    from test_safe_loading import plant_in_sharded, rewrite_manifest

    step, marker = tmp_path / "copy" / "step-000002", tmp_path / "marker"
    shutil.copytree(sharded_run / "step-000002", step)
    name = plant_in_sharded(step / "sharded", marker, "bytes item")
    rewrite_manifest(step)
    result = litgpt(*command_args("pretrain", inputs, tmp_path / "out"), "--devices", "2", "--resume", step,
                    "--fsdp.state_dict_type", "sharded")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert "Could not load" in error and name in error and "safely" in error, error
    assert not marker.exists(), "the planted pickle ran"


@pytest.mark.slow
def test_sharded_checkpoint_from_four_processes_resumes_on_two(inputs, single_process, four_process_run, tmp_path):
    four = four_process_run("finetune_lora")  # 2 torchrun nodes x 2 processes, sharded checkpoints
    assert FOUR_PROCESS_FLAGS["finetune_lora"] == ["--fsdp.state_dict_type", "sharded"]
    assert len(list((four / "step-000002" / "sharded").glob("*.distcp"))) == 4
    two = tmp_path / "two"
    result = litgpt(*command_args("finetune_lora", inputs, two), "--devices", "2", "--resume", four / "step-000002")
    assert result.returncode == 0, result.stderr
    assert_same_final(two, four, "lit_model.pth.lora", atol=1e-5)
    assert_same_final(two, single_process["finetune_lora"], "lit_model.pth.lora", atol=1e-4)


@pytest.mark.slow
def test_full_checkpoint_from_two_processes_resumes_in_one_and_generates(inputs, single_process, two_process_run,
                                                                        tmp_path):
    # FULL_SHARD, what the default HYBRID_SHARD is on one node: the run test_two_processes_equal_one checks too
    two = two_process_run("finetune_full", "FULL_SHARD")
    assert set(load_state_dict(two / "step-000002" / "lit_model.pth")) == set(final_weights(two, "lit_model.pth"))
    one = tmp_path / "one"
    result = litgpt(*command_args("finetune_full", inputs, one), "--devices", "1", "--resume", two / "step-000002")
    assert result.returncode == 0, result.stderr
    assert_same_final(one, single_process["finetune_full"], "lit_model.pth", atol=1e-4)
    generated = litgpt("generate", two / "final", "--prompt", "Once", "--max_new_tokens", "3")
    assert generated.returncode == 0, generated.stderr


@pytest.mark.slow
def test_sharded_checkpoint_of_another_model_is_refused(sharded_run, inputs, tmp_path):
    args = command_args("pretrain", inputs, tmp_path / "other")
    args[args.index("--config") + 1] = write_config(inputs["root"] / "wider.yaml", n_embd=128)
    result = litgpt(*args, "--devices", "2", "--resume", sharded_run / "step-000002")
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("Cannot load the sharded checkpoint") == 1 and "Traceback" not in result.stderr


def write_config(path: Path, **changes) -> Path:
    path.write_text(json.dumps({"model_config": {**SMALL, **changes}}))
    return path


# ---- memory: each rank holds its shard ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_each_rank_holds_half_of_a_fully_sharded_model(inputs, tmp_path):
    """finetune_full of a 16M-parameter model: FULL_SHARD needs (weights + gradients + AdamW state) / 2 per rank less
    than NO_SHARD, measured as each rank's peak RSS; loading reads only each rank's half of the memory-mapped file."""
    config = Config(**{**SMALL, "n_layer": 4, "n_embd": 512, "n_head": 8, "n_query_groups": 4,
                       "intermediate_size": 1376})
    base = write_random_checkpoint(tmp_path / "base", config)
    parameters = sum(t.numel() for t in load_state_dict(base / "lit_model.pth").values()) - 4096 * 512  # tied
    # glibc keeps freed memory unless told to return it; without this RSS hides what sharding saves.
    env = child_environment(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0")
    peaks = {}
    for strategy in ("NO_SHARD", "FULL_SHARD"):
        out_dir = tmp_path / strategy
        args = command_args("finetune_full", inputs, out_dir)
        args[1] = base
        args[args.index("--train.max_steps") + 1] = "2"
        args[args.index("--train.save_interval") + 1] = "1000"
        args += ["--eval.final_validation", "false", "--eval.max_new_tokens", "null"]  # not what is measured
        # sharded checkpoints: a full one would gather the whole model and optimizer state on rank 0 to write it
        result = litgpt(*args, "--devices", "2", "--fsdp.sharding_strategy", strategy, "--fsdp.state_dict_type",
                        "sharded", env=env)
        assert result.returncode == 0, result.stderr
        peaks[strategy] = json.loads((out_dir / "metrics.json").read_text())["peak_memory_mb_per_rank"]
    # fp32 weights, gradients and two AdamW moments: 16 bytes per parameter, half of it on each of two ranks.
    # Rank 1 does nothing but train; rank 0 also tokenizes the data and writes final/'s consolidated weights.
    expected_saving = 16 * parameters / 2 / 2**20
    saving = peaks["NO_SHARD"][1] - peaks["FULL_SHARD"][1]
    assert 0.75 * expected_saving < saving < 1.25 * expected_saving, (peaks, expected_saving)
    # Rank 0's peak can come from that other work, the same for both strategies.
    assert peaks["FULL_SHARD"][0] <= peaks["NO_SHARD"][0], peaks


# ---- bad input: one message, exit code 1, before any process waits ---------------------------------------------------
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num_nodes", "2"], "--num_nodes 2 needs a launcher that starts the processes on every node"),
        (["--devices", "2", "--fsdp.sharding_strategy", "ZERO_SHARD"], "HYBRID_SHARD"),
        (["--devices", "2", "--fsdp.state_dict_type", "distributed"], "sharded"),
        (["--devices", "2", "--fsdp.timeout", "soon"], "timeout"),
    ],
)
def test_bad_distributed_flags(flags, message, tmp_path):
    result = litgpt("pretrain", "--config", ROOT / "config_hub" / "pretrain" / "tiny.yaml", "--out_dir",
                    tmp_path / "out", *flags, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "base, flags, message",
    [
        # the first case by default; the others (a Python process each) with the whole suite (CI)
        ("qlora", ["--quantize", "bnb.int8", "--devices", "2"],
         "--quantize bnb.int8 cannot be sharded by FSDP (bitsandbytes keeps its quantization state outside the weight "
         "tensor): on several devices use one of ao.nf4, bnb.nf4, bnb.nf4-dq (stored as torchao NF4), or --devices 1."),
        pytest.param("qlora", ["--quantize", "ao.nf4", "--devices", "2", "--fsdp.sharding_strategy", "NO_SHARD",
                   "--fsdp.cpu_offload", "true"],
         "--fsdp.cpu_offload with --quantize offloads a sharded base, but NO_SHARD keeps the whole 4-bit base on every "
         "device: use FULL_SHARD, or leave out --fsdp.cpu_offload.", marks=pytest.mark.slow),
        pytest.param("qlora", ["--quantize", "ao.nf4", "--devices", "1", "--precision", "bf16-true"],
         "--precision bf16-true would dequantize torchao's NF4 weights where FSDP does not shard them",
                     marks=pytest.mark.slow),
        pytest.param("qlora", ["--devices", "1", "--fsdp.cpu_offload", "true"],
         "--fsdp.cpu_offload true moves FSDP's sharded state to CPU memory, but one device runs without FSDP",
                     marks=pytest.mark.slow),
    ],
)
def test_bad_qlora_and_offload_flags(base, flags, message, inputs, qlora_base, tmp_path):
    """Refused before any process starts, in one line, without a traceback or an out_dir."""
    result = litgpt("finetune_lora", qlora_base if base == "qlora" else inputs["base"], *flags, "--out_dir",
                    tmp_path / "out", "--data", "JSON", "--data.json_path", inputs["instructions"], timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count(message) == 1, result.stderr
    assert "Initializing distributed" not in result.stderr + result.stdout and not (tmp_path / "out").exists()


# ---- QLoRA: the NF4 base sharded by FSDP2 --------------------------------------------------------------------------------
# The attention weights split over 2 ranks into whole NF4 blocks and scale groups; the MLP's, 704 wide, do not and are
# stored with zero rows appended (fc_1 and fc_2 704 -> 768 rows, proj 256 -> 512).
QLORA_MODEL = {**SMALL, "name": "dist-qlora", "n_embd": 256, "intermediate_size": 704}


@pytest.fixture(scope="module")
def qlora_base(inputs) -> Path:
    return write_random_checkpoint(inputs["root"] / "qlora-base", Config(**QLORA_MODEL))


def qlora_args(inputs: dict, base: Path, out_dir: Path, *flags) -> list:
    args = command_args("finetune_lora", inputs, out_dir)
    args[1] = base
    # Room for the prompt and its answer: at 64 tokens the alpaca prompt fills the sample, no token has a label and
    # every loss is 0.
    args[args.index("--train.max_seq_length") + 1] = "128"
    return [*args, *flags]


@pytest.fixture(scope="module")
def qlora_run(inputs, qlora_base):
    """`qlora_run(*flags)`: (out_dir, completed process) of finetune_lora on the QLoRA base with these flags (full
    checkpoints at steps 2 and 4), run once for the module."""
    runs = {}

    def run(*flags) -> tuple[Path, subprocess.CompletedProcess]:
        if flags not in runs:
            out_dir = inputs["root"] / f"qlora-{len(runs)}"
            result = litgpt(*qlora_args(inputs, qlora_base, out_dir, *flags))
            assert result.returncode == 0, result.stderr
            runs[flags] = out_dir, result
        return runs[flags]

    return run


SINGLE_QLORA = ("--quantize", "ao.nf4", "--devices", "1")
SHARDED_QLORA = ("--quantize", "bnb.nf4", "--devices", "2")


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True])
def test_qlora_on_two_processes_equals_one(offload, qlora_run):
    """The issue's command, `--quantize bnb.nf4 --devices 2` (HYBRID_SHARD: FULL_SHARD on one node), stores the base
    as torchao NF4 sharded over the ranks (with --fsdp.cpu_offload in CPU memory, with the adapters, their gradients
    and AdamW's state), and trains as one process does with the same quantization on the same global batch."""
    one, _ = qlora_run(*SINGLE_QLORA)
    two, result = qlora_run(*SHARDED_QLORA, *(["--fsdp.cpu_offload", "true"] if offload else []))
    assert (result.stdout + result.stderr).count("the base is stored as torchao's NF4") == 1
    assert min(losses(one)) > 1.0  # tokens with labels: the comparison compares something
    assert_close_runs(two, one, "lit_model.pth.lora", loss_tol=1e-4, weight_tol=1e-4)
    metrics = json.loads((two / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["sharding_strategy"] == "FULL_SHARD"
    assert metrics["fsdp"]["cpu_offload"] is offload
    # final/ as one process writes it: the adapters, and the model merged into the float base
    assert_same_final(two, one, "lit_model.pth", atol=1e-4)
    assert all("lora_" in key for key in load_state_dict(two / "step-000002" / "lit_model.pth.lora"))


@pytest.mark.slow
def test_qlora_bf16_mixed_on_two_processes_follows_one(qlora_run):
    """bf16-mixed: FSDP gathers the adapters in bf16 (MixedPrecisionPolicy) and the NF4 weights in their own 4-bit
    layout, dequantized to bf16 (the compute dtype); one process runs the same under autocast."""
    bf16 = ("--precision", "bf16-mixed")
    one, _ = qlora_run(*SINGLE_QLORA, *bf16)
    two, _ = qlora_run(*SHARDED_QLORA, *bf16)
    assert losses(two) == pytest.approx(losses(one), abs=0.01)
    assert losses(two) != losses(qlora_run(*SHARDED_QLORA)[0])  # not the float32 run's


@pytest.mark.slow
def test_qlora_on_two_processes_resumes_and_generates(inputs, qlora_base, qlora_run, tmp_path):
    two, _ = qlora_run(*SHARDED_QLORA)
    resumed = tmp_path / "resumed"
    result = litgpt(*qlora_args(inputs, qlora_base, resumed, *SHARDED_QLORA, "--resume", two / "step-000002"))
    assert result.returncode == 0, result.stderr
    assert "Training 4 steps from step 2" in result.stdout
    assert losses(resumed) == pytest.approx(losses(two)[2:], abs=1e-5)
    assert_same_final(resumed, two, "lit_model.pth.lora", atol=1e-6)
    generated = litgpt("generate", two / "final", "--prompt", "Once", "--max_new_tokens", "3")
    assert generated.returncode == 0, generated.stderr


NF4_BYTES_SCRIPT = """
import json, sys
from pathlib import Path
from torch import nn
from litgpt.config import Config
from litgpt.distributed.fabric import build_fabric
from litgpt.lora import LoRASettings
from litgpt.nf4 import is_nf4
from litgpt.precision import Precision
from litgpt.quantize import weight_bytes
from litgpt.train.recipe import Recipe

base, devices = Path(sys.argv[1]), int(sys.argv[2])
recipe = Recipe("finetune_lora", Config.from_checkpoint(base), "checkpoint", base / "lit_model.pth",
                lora=LoRASettings(mlp=True), quantize="ao.nf4")
fabric = build_fabric(devices, precision="32-true")
fabric.launch()
model = recipe.materialize(fabric, recipe.build_model(), Precision("32-true"), False, False, True)
nf4 = [param for param in model.parameters() if is_nf4(param)]
shapes = [list(getattr(param, "_local_tensor", param).shape) for param in nf4]
print(json.dumps({"rank": fabric.global_rank, "shapes": shapes, "bytes": weight_bytes(nn.ParameterList(nf4))}))
"""


def nf4_bytes_by_hand(shape: list[int]) -> int:
    """torchao's NF4 in float32 of a weight (or a rank's rows of it) whose 64-blocks fill groups of 256 scalers: 4
    bits a weight, an int8 scaler a block, a float32 scale a group, the float32 mean of the scalers and 16 codes."""
    numel = shape[0] * shape[1]
    return numel // 2 + numel // 64 + numel // 64 // 256 * 4 + 17 * 4


@pytest.mark.slow
def test_each_rank_holds_its_rows_of_the_nf4_base(qlora_base, tmp_path):
    """The NF4 base as the training commands build it, measured on each rank: half of the rows of each weight (the
    packed weights, their scalers and scales are split by rows; each rank keeps the scalers' mean and the 16 codes),
    the 704-wide MLP's weights with their appended rows; `litgpt plan` counts the same bytes."""
    from litgpt.plan.quantized import nf4_bytes

    script = tmp_path / "nf4_bytes.py"
    script.write_text(NF4_BYTES_SCRIPT)
    one = subprocess.run([sys.executable, str(script), str(qlora_base), "1"], capture_output=True, text=True,
                         cwd=ROOT, env=child_environment(), timeout=300)
    assert one.returncode == 0, one.stderr
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script), str(qlora_base), "2"]
    two = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=child_environment(), timeout=300)
    assert two.returncode == 0, two.stderr
    (whole,) = [json.loads(line) for line in one.stdout.splitlines() if line.startswith("{")]
    ranks = sorted((json.loads(line) for line in two.stdout.splitlines() if line.startswith("{")),
                   key=lambda report: report["rank"])
    assert [report["rank"] for report in ranks] == [0, 1]
    # qkv (4 heads of 64, 2 query groups), the attention output, the MLP's fc_1, fc_2 and proj; in each layer
    layer = [[512, 256], [256, 256], [704, 256], [704, 256], [256, 704]]
    stored = [[512, 256], [256, 256], [768, 256], [768, 256], [512, 704]]
    assert whole["shapes"] == layer * QLORA_MODEL["n_layer"]
    assert whole["bytes"] == sum(nf4_bytes_by_hand(shape) for shape in whole["shapes"])
    for report in ranks:
        assert report["shapes"] == [[rows // 2, columns] for rows, columns in stored] * QLORA_MODEL["n_layer"]
        assert report["bytes"] == sum(nf4_bytes_by_hand(shape) for shape in report["shapes"]), report
        assert report["bytes"] == sum(nf4_bytes(tuple(shape), 4, shard=2) for shape in whole["shapes"])


@pytest.mark.slow
def test_torchrun_process_count_that_does_not_match_the_flags(tmp_path):
    port = str(free_port())
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
               "-m", "litgpt", "pretrain", "--config", ROOT / "config_hub" / "pretrain" / "tiny.yaml", "--out_dir",
               tmp_path / "out", "--devices", "1"]
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True, cwd=ROOT, timeout=120,
                            env=child_environment())
    assert result.returncode != 0
    message = "torchrun started 2 process(es) (2 per node), but --devices 1 --num_nodes 1 asks for 1 process(es)"
    assert result.stderr.count(message) == 1, result.stderr
    # torchrun reports its failed workers with a traceback of its own; none comes from litgpt
    assert f'File "{ROOT / "litgpt"}' not in result.stderr and not (tmp_path / "out").exists()

"""The Thunder extension (extensions/thunder) with real processes on the CPU (gloo).

The ZeRO shardings and bucketings of ThunderFSDPStrategy (COMBINATIONS), and ThunderDDPStrategy, train two processes in
one torchrun launch (this file is the script it runs) against a single-process eager run of the same global batch;
the launch also reads each combination's collectives from thunder's traces and writes checkpoints that the plain
entry points' readers load. The CLI tests run `litgpt pretrain --compiler thunder` as the guide does and resume its
checkpoints in the plain entry point and `litgpt generate`.

thunder is an optional extra (CI installs it): it is imported inside the tests only, so that collecting this module
needs none.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port
from test_distributed import assert_same_final, child_environment, litgpt, losses

from extensions.thunder.compat import NAMED_TENSOR_METHODS, add_named_tensor_methods, check_thunder_version
from litgpt.args import TrainArgs
from litgpt.config import Config
from litgpt.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(
    name="thunder-llama", block_size=64, vocab_size=256, padded_vocab_size=256, n_layer=1, n_embd=32, n_head=4,
    n_query_groups=2, intermediate_size=64, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", bias=False,
)
# LAYER, and NONE with ZERO2, are left out: thunder 0.2.6's FSDP transform applies no bucketing, so every bucketing
# runs what NONE runs (the trace counts below show it for BLOCK with both shardings); LAYER's option is still checked
# (test_unknown_strategy_options).
COMBINATIONS = [("ZERO3", "BLOCK"), ("ZERO3", "NONE"), ("ZERO2", "BLOCK")]
WORLD, MICRO, ACCUMULATION, STEPS, SEQ, LR, MAX_NORM = 2, 1, 2, 3, 16, 0.5, 0.5
GLOBAL_BATCH = WORLD * MICRO * ACCUMULATION


# ---- the model, data and steps both sides share ------------------------------------------------------------------------
def tiny_model():
    from litgpt.model import GPT

    torch.manual_seed(0)
    model = GPT(Config(**TINY))
    model.init_weights()
    return model


def global_batches() -> list[torch.Tensor]:
    """One (GLOBAL_BATCH, SEQ + 1) batch of token ids per step."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def validation_batch() -> torch.Tensor:
    """(WORLD, SEQ + 1) token ids: one validation sample per rank."""
    generator = torch.Generator().manual_seed(2)
    return torch.randint(0, TINY["vocab_size"], (WORLD, SEQ + 1), generator=generator)


PROMPT, NEW_TOKENS = list(range(5, 13)), 6  # the text sample: greedy tokens after this prompt


def sgd(parameters) -> torch.optim.Optimizer:
    """SGD with momentum: unlike Adam's first steps (about lr x sign(gradient)), an update does not amplify the
    rounding differences of near-zero gradients, so losses can be compared at 1e-5 over several steps."""
    return torch.optim.SGD(parameters, lr=LR, momentum=0.9)


def eager_training() -> tuple[list[float], torch.nn.Module]:
    """The reference: one process, the whole global batch at once, plain PyTorch: (losses, the trained model)."""
    from litgpt.train.loss import cross_entropy

    model = tiny_model()
    optimizer = sgd(model.parameters())
    result = []
    for batch in global_batches():
        loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        result.append(loss.item())
    return result, model


def eager_losses() -> list[float]:
    return eager_training()[0]


def eager_evaluation() -> dict:
    """The trained eager model's validation loss (the mean of the samples' losses) and greedy sample."""
    from litgpt.generate import generate
    from litgpt.train.loss import cross_entropy

    model = eager_training()[1].eval()
    batch = validation_batch()
    with torch.no_grad():
        val_loss = torch.stack([cross_entropy(model(sample[None, :-1]), sample[None, 1:]) for sample in batch]).mean()
    return {"val_loss": val_loss.item(), "sample": list(generate(model, PROMPT, NEW_TOKENS, temperature=0.0))}


# ---- no processes, no thunder -------------------------------------------------------------------------------------------
def test_named_tensor_methods_are_added_only_where_missing():
    class WithoutThem:
        pass

    class WithRename:
        def rename(self):
            return "torch's own"

    assert add_named_tensor_methods(WithoutThem) == list(NAMED_TENSOR_METHODS)
    for name in NAMED_TENSOR_METHODS:
        method = getattr(WithoutThem, name)
        assert method.__name__ == name  # thunder registers an operation under its function's name
        with pytest.raises(RuntimeError, match=f"Tensor.{name} was removed"):
            method(WithoutThem())
    original = WithRename.rename
    assert "rename" not in add_named_tensor_methods(WithRename)
    assert WithRename.rename is original and WithRename().rename() == "torch's own"
    assert add_named_tensor_methods(WithoutThem) == []  # a second call changes nothing


def test_thunder_version_check():
    for version in ("0.2.6", "0.2.7.dev20250101", "0.3.0", "1.0"):
        check_thunder_version(version)
    with pytest.raises(UserError, match=r"lightning-thunder 0.2.5 is too old .* pip install -e '.\[thunder\]'"):
        check_thunder_version("0.2.5")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(sharding_strategy="ZERO1"), "sharding_strategy 'ZERO1' is not one of ZERO3, ZERO2"),
        (dict(bucketing_strategy="MODULE"), "bucketing_strategy 'MODULE' is not one of BLOCK, LAYER, NONE"),
        (dict(state_dict_type="distributed"), "state_dict_type 'distributed' is not one of full, sharded"),
    ],
)
def test_unknown_strategy_options(options, message):
    from extensions.thunder.strategies import ThunderFSDPStrategy

    with pytest.raises(UserError, match=message):
        ThunderFSDPStrategy(**options)


def test_fsdp2_options_are_refused_with_thunder():
    from extensions.thunder.pretrain import check_fsdp_args
    from litgpt.args import FSDPArgs

    with pytest.raises(UserError, match="--fsdp.sharding_strategy configures PyTorch's FSDP.*--thunder.sharding_strategy"):
        check_fsdp_args(FSDPArgs(sharding_strategy="FULL_SHARD"))
    check_fsdp_args(FSDPArgs(timeout=30))  # the timeout applies to thunder's collectives too


def test_op_level_checkpointing_is_refused_with_thunder():
    """Thunder ignores the selective policy of `ops`; the settings that checkpoint whole blocks pass."""
    from extensions.thunder.pretrain import check_activation_checkpointing

    with pytest.raises(UserError, match="activation_checkpointing ops .* Thunder ignores"):
        check_activation_checkpointing(TrainArgs(activation_checkpointing="ops"))
    for setting in (False, True, 2, "every:3"):
        check_activation_checkpointing(TrainArgs(activation_checkpointing=setting))


def test_strategy_ddp_without_thunder_is_fsdp_no_shard():
    from litgpt.args import FSDPArgs
    from litgpt.pretrain import fsdp_for_strategy

    assert fsdp_for_strategy("ddp", FSDPArgs()).sharding_strategy == "NO_SHARD"
    assert fsdp_for_strategy("fsdp", FSDPArgs()) == FSDPArgs()
    with pytest.raises(UserError, match="--strategy ddp replicates the model, but --fsdp.sharding_strategy FULL_SHARD"):
        fsdp_for_strategy("ddp", FSDPArgs(sharding_strategy="FULL_SHARD"))


def test_compiler_torch_compiles_each_block_in_place_after_activation_checkpointing():
    """parallelize's order (torchtitan's): checkpointing wraps each block's forward, then the block is compiled
    in place, so the parameter names (and checkpoints) stay those of the eager model."""
    from lightning.fabric import Fabric

    from litgpt.checkpoint.model_files import meta_device
    from litgpt.model import GPT
    from litgpt.distributed.parallelize import parallelize
    from litgpt.precision import Precision

    with meta_device():
        model = GPT(Config(**TINY))
    fabric = Fabric(accelerator="cpu", devices=1)
    model = parallelize(fabric, model, Precision("32-true"), lambda m: m.init_weights(), activation_checkpointing=True,
                          compile_blocks=True)
    for block in model.transformer.h:
        assert block._compiled_call_impl is not None  # nn.Module.compile(): compiled on the first call
        assert block.forward.__name__ == "forward_with_checkpoint"  # what the compiled call runs: the checkpointed block
    assert model.state_dict().keys() == tiny_model().state_dict().keys()


def test_plain_runs_never_import_thunder_and_without_it_the_cli_says_how_to_install_it(tmp_path):
    """thunder hidden from the import system: the core modules load without the extension or thunder, and
    `--compiler thunder` prints one line naming the extra, exits with code 1 and writes nothing."""
    script = (
        "import sys; sys.modules['thunder'] = None\n"
        "import litgpt.pretrain, litgpt.train.job, litgpt.train.trainer, litgpt.checkpoint.manager\n"
        "import litgpt.distributed.fabric, litgpt.registry\n"
        "print([m for m, module in sys.modules.items() if module and m.split('.')[0] in ('thunder', 'extensions')])\n"
        "from litgpt.__main__ import main\n"
        f"main(['pretrain', '--config', {str(ROOT / 'config_hub/pretrain/tiny.yaml')!r}, '--compiler', 'thunder', "
        f"'--out_dir', {str(tmp_path / 'out')!r}])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                            env=child_environment(), timeout=120)
    assert result.stdout.strip() == "[]", result.stdout
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr
    assert "--compiler thunder needs Lightning Thunder" in result.stderr
    assert "pip install -e '.[thunder]'" in result.stderr
    assert not (tmp_path / "out").exists()


# ---- one process with thunder ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_jit_false_needs_a_compiled_module():
    from extensions.thunder.strategies import compile_module

    with pytest.raises(UserError, match=r"ThunderFSDPStrategy\(jit=False\) needs a module already compiled"):
        compile_module(torch.nn.Linear(2, 2), jit=False, executors=None, device=torch.device("cpu"),
                       strategy="ThunderFSDPStrategy")


# ---- two processes: every combination, in one launch ----------------------------------------------------------------------
def collectives(trace) -> dict[str, int]:
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for bound in trace.bound_symbols:
        for kind in counts:
            if kind in bound.sym.name:
                counts[kind] += 1
    return counts


def evaluate_in_this_process(fabric, strategy, model) -> dict:
    """What litgpt's loop does between steps, on every rank: the validation forward of the compiled (and sharded)
    module under no_grad in eval mode (a second thunder trace), then a greedy sample from the strategy's eager
    `sampling_model` (collective under FSDP)."""
    from litgpt.generate import generate
    from litgpt.train.loss import cross_entropy

    sample = validation_batch()[fabric.global_rank][None]
    model.eval()
    with torch.no_grad():
        loss = cross_entropy(model(sample[:, :-1]), sample[:, 1:])
    model.train()
    eager = strategy.sampling_model(model.module)
    return {"val_loss": fabric.all_reduce(loss, reduce_op="mean").item(),
            "sample": list(generate(eager, PROMPT, NEW_TOKENS, temperature=0.0)),
            "sample_model_is_eager": type(eager).__name__ == "GPT"}


def train_in_this_process(fabric, strategy, evaluate: bool = False) -> dict:
    """Called on every rank: set the tiny model up with `strategy`, train STEPS steps, report what happened (and,
    with `evaluate`, validate and sample after the first step and after the last)."""
    from extensions.thunder.compat import import_thunder
    from litgpt.train.loss import cross_entropy

    thunder, _ = import_thunder()

    model = fabric.setup(tiny_model())
    checkpoint_io = strategy.litgpt_checkpoint_io
    optimizer = fabric.setup_optimizers(sgd(checkpoint_io.parameters(None)))
    result = {"losses": [], "evaluations": []}
    for step, batch in enumerate(global_batches()):
        mine = batch[fabric.global_rank * MICRO * ACCUMULATION:(fabric.global_rank + 1) * MICRO * ACCUMULATION]
        step_loss = torch.zeros(())
        for micro in range(ACCUMULATION):
            sample = mine[micro * MICRO:(micro + 1) * MICRO]
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATION - 1):
                loss = cross_entropy(model(sample[:, :-1]), sample[:, 1:])
                fabric.backward(loss / ACCUMULATION)
            step_loss += loss.detach() / ACCUMULATION
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(fabric.all_reduce(step_loss, reduce_op="mean").item())
        if step == 0:
            # The training traces' collectives, before an evaluation traces again: thunder 0.2.6 updates
            # last_backward_traces only when it traces, so after a no-grad trace it is empty for good.
            compiled = model._forward_module
            result["forward"] = collectives(thunder.last_traces(compiled)[-1])
            result["backward"] = collectives(thunder.last_backward_traces(compiled)[-1])
            if evaluate:  # training goes on after an evaluation
                result["evaluations"].append(evaluate_in_this_process(fabric, strategy, model))
    if evaluate:
        result["evaluations"].append(evaluate_in_this_process(fabric, strategy, model))
    result["shards"] = {name: [list(shard.shape), list(checkpoint_io.full_shapes[name])]
                        for name, shard in checkpoint_io.shards().items()}
    return {"result": result, "checkpoint_io": checkpoint_io, "optimizer": optimizer}


def check_checkpoints(fabric, trained: dict, folder: Path) -> dict:
    """Write full and sharded checkpoints of a trained run, read both back into a freshly set-up one."""
    from extensions.thunder.strategies import ThunderFSDPStrategy
    from litgpt.io import save_state_dict
    from litgpt.model import GPT

    checkpoint_io, optimizer = trained["checkpoint_io"], trained["optimizer"]
    every = lambda key: True  # noqa: E731
    weights = checkpoint_io.gather_weights(None, every)
    optimizer_state = checkpoint_io.gather_optimizer_state(None, optimizer)
    if fabric.global_rank == 0:
        save_state_dict({"weights": weights, "optimizer": optimizer_state}, folder / "full.pth")
    checkpoint_io.save_sharded(folder, None, optimizer, every)
    fabric.barrier()

    def same_as_trained(other_io, other_optimizer) -> bool:
        shards = checkpoint_io.shards()
        equal = all(torch.equal(shards[name], shard) for name, shard in other_io.shards().items())
        for param, other in zip(checkpoint_io.parameters(None), other_io.parameters(None)):
            state, other_state = optimizer.state[param], other_optimizer.state[other]
            equal &= state.keys() == other_state.keys() and all(torch.equal(state[k], other_state[k]) for k in state)
        return bool(equal)

    outcome = {}
    saved = torch.load(folder / "full.pth", weights_only=True)
    for seed, kind in enumerate(("sharded", "full")):
        strategy = ThunderFSDPStrategy(sharding_strategy="ZERO3", bucketing_strategy="BLOCK")
        torch.manual_seed(100 + seed)  # other weights than the trained ones
        other = GPT(Config(**TINY))
        other.init_weights()
        fabric_for(strategy).setup(other)
        fresh_optimizer = sgd(strategy.litgpt_checkpoint_io.parameters(None))
        if kind == "sharded":
            strategy.litgpt_checkpoint_io.load_sharded(folder, None, fresh_optimizer, every)
        else:
            strategy.litgpt_checkpoint_io.copy_weights(None, saved["weights"], "full.pth")
            strategy.litgpt_checkpoint_io.load_optimizer_state(None, fresh_optimizer, saved["optimizer"])
        outcome[kind] = same_as_trained(strategy.litgpt_checkpoint_io, fresh_optimizer)
    return outcome


def fabric_for(strategy):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=WORLD, precision="32-true", strategy=strategy)
    fabric.launch()
    return fabric


def worker(out: Path) -> None:
    """Run by torchrun on every rank: the FSDP combinations, DDP, and the checkpoint round trips."""
    from extensions.thunder.compat import import_thunder
    from extensions.thunder.strategies import ThunderDDPStrategy, ThunderFSDPStrategy

    results = {}
    for sharding, bucketing in COMBINATIONS:
        strategy = ThunderFSDPStrategy(sharding_strategy=sharding, bucketing_strategy=bucketing)
        fabric = fabric_for(strategy)
        trained = train_in_this_process(fabric, strategy, evaluate=bucketing == "BLOCK")
        results[f"{sharding}/{bucketing}"] = trained["result"]
        if (sharding, bucketing) == ("ZERO3", "BLOCK"):
            results["checkpoints"] = check_checkpoints(fabric, trained, out.parent / "checkpoint")
    strategy = ThunderDDPStrategy()
    results["DDP"] = train_in_this_process(fabric_for(strategy), strategy, evaluate=True)["result"]
    results["thunder_version"] = import_thunder()[0].__version__
    if fabric.global_rank == 0:
        out.write_text(json.dumps(results))


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("thunder-strategies")
    out = folder / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port",
               str(free_port()), __file__, str(out)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=child_environment(), timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    return {**json.loads(out.read_text()), "folder": folder}


@pytest.mark.slow
@pytest.mark.parametrize("sharding, bucketing", COMBINATIONS)
def test_two_processes_equal_one_eager_process(sharding, bucketing, two_process_results):
    run = two_process_results[f"{sharding}/{bucketing}"]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(eager_losses()), rtol=0, atol=1e-5)
    # Each rank holds 1/world of every parameter (rows; these dimensions divide evenly).
    for name, (shard, full) in run["shards"].items():
        assert shard == [full[0] // WORLD, *full[1:]], name


@pytest.mark.slow
@pytest.mark.parametrize("run", ["ZERO3/BLOCK", "ZERO2/BLOCK", "DDP"])
def test_validation_and_sampling_between_steps(run, two_process_results):
    """Validation (no_grad, eval mode: thunder traces the module again) and the text sample work after the first
    step and again after the last, training in between: the last ones equal the eager model's after the same steps.

    1e-5: what the training losses are compared at (float32, the same kernels, other orders of summation; the weights
    after 3 steps differ by about 1e-7)."""
    evaluations = two_process_results[run]["evaluations"]
    assert len(evaluations) == 2
    reference = eager_evaluation()
    assert evaluations[-1]["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5, rel=0)
    assert evaluations[-1]["sample"] == reference["sample"]
    assert all(e["sample_model_is_eager"] and len(e["sample"]) == NEW_TOKENS for e in evaluations)


@pytest.mark.slow
def test_ddp_equals_one_eager_process(two_process_results):
    run = two_process_results["DDP"]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(eager_losses()), rtol=0, atol=1e-5)
    assert all(shard == full for shard, full in run["shards"].values())  # every rank holds everything
    assert run["backward"]["all_reduce"] >= 1 and run["forward"]["all_gather"] == 0


@pytest.mark.slow
def test_what_bucketing_and_sharding_change_in_the_traces(two_process_results):
    """Collectives per step as thunder's execution traces hold them: one all-gather per parameter (or per bucket)
    in the forward, one reduce-scatter per parameter (or bucket) in the backward. Bucketing can only merge them;
    thunder 0.2.6's FSDP transform (fsdp_v2) does not apply its bucketing pass, so the counts are the same for BLOCK
    and NONE there; for another release the test checks only that bucketing never adds collectives."""
    unbucketed = two_process_results["ZERO3/NONE"]
    parameters = len(unbucketed["shards"])
    assert unbucketed["forward"]["all_gather"] == parameters
    assert unbucketed["backward"]["reduce_scatter"] == parameters
    for sharding in ("ZERO3", "ZERO2"):
        bucketed = two_process_results[f"{sharding}/BLOCK"]
        for direction, kind in (("forward", "all_gather"), ("backward", "reduce_scatter")):
            assert bucketed[direction][kind] <= parameters
        if two_process_results["thunder_version"] == "0.2.6":  # measured: no bucketing in this release
            assert bucketed["forward"]["all_gather"] == parameters, bucketed


@pytest.mark.slow
def test_checkpoints_round_trip_and_load_in_the_plain_readers(two_process_results):
    from litgpt.checkpoint.fsdp_io import FSDPCheckpointIO
    from litgpt.checkpoint.store import consolidated_weights
    from litgpt.io import load_state_dict
    from litgpt.model import GPT

    assert two_process_results["checkpoints"] == {"sharded": True, "full": True}
    folder = two_process_results["folder"] / "checkpoint"
    full = load_state_dict(folder / "full.pth")
    assert full["weights"].keys() == tiny_model().state_dict().keys()
    consolidated = consolidated_weights(folder)  # what `litgpt consolidate` and final/ read
    for name, value in full["weights"].items():
        assert torch.equal(consolidated[name], value), name
    # The FSDP2 entry points' reader (one process here): same weights and optimizer state as the full checkpoint.
    model = GPT(Config(**TINY))
    optimizer = sgd(model.parameters())
    FSDPCheckpointIO().load_sharded(folder, model, optimizer, lambda key: True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, full["weights"][name]), name
    names = dict(model.named_parameters())
    for name, state in full["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(optimizer.state[names[name]][key], value), (name, key)


# ---- the command line, as the guide runs it ----------------------------------------------------------------------------
PRETRAIN = [
    "--train.global_batch_size", "4", "--train.micro_batch_size", "1", "--train.max_steps", "2",
    "--train.lr_warmup_steps", "1", "--train.save_interval", "1", "--train.max_seq_length", "32",
    "--train.max_norm", "1.0", "--eval.final_validation", "false", "--eval.max_iters", "1",
    "--optimizer.class_path", "torch.optim.AdamW", "--optimizer.init_args.lr", "0.003", "--seed", "5",
]


# Validation after every step (the last one the final validation) and a text sample after each.
EVALUATE = ["--eval.interval", "1", "--eval.final_validation", "true", "--eval.max_iters", "2",
            "--eval.max_new_tokens", "5"]


def thunder_pretrain(runs: dict, name: str, *options):
    """`litgpt pretrain --compiler thunder` with validation and sampling on; the result, its out_dir in runs[name]."""
    runs[name] = runs["root"] / name
    args = [*PRETRAIN, *EVALUATE]  # the later value of an option repeated wins
    return litgpt("pretrain", *runs["data"], *args, *options, "--compiler", "thunder", "--out_dir", runs[name])


def eager_reference(final: Path, cache_dir: Path, samples: int) -> dict:
    """From final/ with plain PyTorch: the mean loss over validation samples 0..samples-1 (those the run's
    validation reads: its batches take the samples in order, rank r every world-th) and the text sample the loop
    prints (greedy, from the first validation sample's first 16 tokens)."""
    from litgpt.io import load_state_dict
    from litgpt.data.tiny import Tiny
    from litgpt.generate import generate
    from litgpt.model import GPT
    from litgpt.tokenizer import Tokenizer

    model = GPT(Config.from_file(final / "model_config.yaml"))
    model.load_state_dict(load_state_dict(final / "lit_model.pth"))
    model.eval()
    tokenizer = Tokenizer(final)
    data = Tiny(cache_dir=cache_dir)
    data.connect(tokenizer, 32)
    data.prepare()
    val = data.val_dataset()
    losses = []
    with torch.no_grad():
        for i in range(samples):
            labels = val[i]["labels"]
            assert (labels >= 0).all()  # every position labeled: the run's mean of batch means is this mean
            logits = model(val[i]["input_ids"][None])
            losses.append(torch.nn.functional.cross_entropy(logits[0].float(), labels))
    prompt = val[0]["input_ids"][:16]
    tokens = list(generate(model, prompt, 5, temperature=0.0, stop_ids=tokenizer.stop_ids))
    text = tokenizer.decode(prompt.tolist() + tokens, skip_special_tokens=True)
    continuation = text[len(tokenizer.decode(prompt.tolist(), skip_special_tokens=True)):]
    return {"val_loss": torch.stack(losses).mean().item(), "sample": f"sample: {continuation!r}"}


def check_evaluated_run(result, out_dir: Path, cache_dir: Path, samples: int) -> None:
    """The run validated and sampled after both steps and ended with final/, whose weights load in plain PyTorch
    and give the logged final validation loss and the last sample.

    The loss within 1e-5: thunder runs the same float32 kernels (torch and SDPA executors) as eager PyTorch, in
    other groupings (its traces, the rotary tables computed inside them, the ranks' mean); the two differ by a few
    float32 roundings of a loss of about 8, ~1e-6, the weights being identical."""
    assert result.returncode == 0, result.stderr[-5000:]
    assert "does not sample text" not in result.stderr
    assert result.stdout.count("| val loss ") == 2, result.stdout
    samples_printed = [line for line in result.stdout.splitlines() if line.startswith("sample: ")]
    assert len(samples_printed) == 2, result.stdout
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["steps"] == 2 and math.isfinite(metrics["val_loss"])
    reference = eager_reference(out_dir / "final", cache_dir, samples)
    assert metrics["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5, rel=0)
    assert samples_printed[-1] == reference["sample"]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("thunder-cli")
    config = root / "model.yaml"
    # the bundled tokenizer's 4096 tokens need as many embedding rows
    config.write_text(json.dumps({"model_config": {**TINY, "vocab_size": 4096, "padded_vocab_size": 4096}}))
    data = ["--config", config, "--data", "Tiny", "--data.cache_dir", root / "cache"]
    runs = {"root": root, "data": data}
    eager = litgpt("pretrain", *data, *PRETRAIN, "--devices", "1", "--out_dir", root / "eager")
    assert eager.returncode == 0, eager.stderr
    runs["eager"] = root / "eager"
    runs["thunder_result"] = thunder_pretrain(runs, "thunder", "--devices", "2", "--num_nodes", "1", "--strategy", "fsdp")
    return runs


@pytest.mark.slow
def test_litgpt_pretrain_compiler_thunder_fsdp_validates_samples_and_saves(cli_runs):
    """Two processes (ZeRO-3): batches of 1 sample per rank, 2 iterations: validation samples 0..3."""
    check_evaluated_run(cli_runs["thunder_result"], cli_runs["thunder"], cli_runs["root"] / "cache", samples=4)


@pytest.mark.slow
def test_litgpt_pretrain_compiler_thunder_one_device_validates_samples_and_saves(cli_runs):
    """One device (ThunderSingleDeviceStrategy): batches of 1 sample, 2 iterations: validation samples 0..1."""
    result = thunder_pretrain(cli_runs, "thunder_one", "--devices", "1")
    check_evaluated_run(result, cli_runs["thunder_one"], cli_runs["root"] / "cache", samples=2)


@pytest.mark.slow
def test_litgpt_pretrain_compiler_thunder_equals_eager_and_resumes_in_the_plain_entry_point(cli_runs):
    thunder, eager = cli_runs["thunder"], cli_runs["eager"]
    assert cli_runs["thunder_result"].returncode == 0, cli_runs["thunder_result"].stderr[-5000:]
    assert losses(thunder) == pytest.approx(losses(eager), abs=1e-5)  # validating and sampling change no step
    metrics = json.loads((thunder / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["sharding_strategy"] == "ZERO3"
    assert metrics["fsdp"]["bucketing_strategy"] == "BLOCK" and metrics["fsdp"]["state_dict_type"] == "full"
    assert_same_final(thunder, eager, "lit_model.pth", atol=1e-4)
    resumed = cli_runs["root"] / "resumed"
    result = litgpt("pretrain", *cli_runs["data"], *PRETRAIN, "--devices", "1", "--out_dir", resumed,
                    "--resume", thunder / "step-000001")
    assert result.returncode == 0, result.stderr
    assert "from step 1" in result.stdout
    assert losses(resumed) == pytest.approx(losses(thunder)[1:], abs=1e-5)
    assert_same_final(resumed, thunder, "lit_model.pth", atol=1e-5)
    generated = litgpt("generate", thunder / "final", "--prompt", "Once", "--max_new_tokens", "3")
    assert generated.returncode == 0, generated.stderr


# ---- every training command hands its job to the extension ----------------------------------------------------------
FINETUNE = [
    "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--train.max_steps", "2",
    "--train.lr_warmup_steps", "1", "--train.save_interval", "2", "--train.max_seq_length", "32",
    "--eval.final_validation", "false", "--eval.max_new_tokens", "0", "--seed", "5", "--devices", "2",
    # SGD: rounding differences stay as small in the next step's loss as in the gradients (AdamW's first step
    # normalizes every gradient to about +-lr, and near-zero ones of the two runs may differ in sign).
    "--optimizer.class_path", "torch.optim.SGD", "--optimizer.init_args.lr", "0.5",
]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["finetune_lora", "distill"])
def test_other_training_commands_hand_their_job_to_thunder_and_train_as_eager(command, tmp_path):
    """--compiler thunder on finetune_lora and distill (two processes: Thunder's FSDP) takes the steps the eager run
    takes, within float32 roundings (see `check_evaluated_run`)."""
    from checkpoint_helpers import write_random_checkpoint

    config = Config(**{**TINY, "vocab_size": 4096, "padded_vocab_size": 4096})
    base = write_random_checkpoint(tmp_path / "base", config, seed=2)
    data = ["--data", "Tiny", "--data.cache_dir", tmp_path / "cache"]
    if command == "distill":
        teacher = write_random_checkpoint(tmp_path / "teacher", config, seed=3)
        inputs = [base, "--teacher_dir", teacher]
    else:
        inputs = [base, "--lora_mlp", "true", "--lora_dropout", "0"]  # the two runs draw dropout masks apart
    runs = {}
    for compiler in ("none", "thunder"):
        runs[compiler] = tmp_path / compiler
        result = litgpt(command, *inputs, *data, *FINETUNE, "--compiler", compiler, "--out_dir", runs[compiler])
        assert result.returncode == 0, result.stderr[-5000:]
    metrics = json.loads((runs["thunder"] / "metrics.json").read_text())
    assert metrics["sharding_strategy"] == "ZERO3"  # Thunder's FSDP ran it, not FSDP2
    assert losses(runs["thunder"]) == pytest.approx(losses(runs["none"]), abs=1e-5)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))

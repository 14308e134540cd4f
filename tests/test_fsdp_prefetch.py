"""`--fsdp.forward_prefetch` / `--fsdp.backward_prefetch`: how the settings are read, which blocks each block
prefetches once `shard_model` has run on 2 real gloo processes, and that training with them is the same training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from forked_ranks import rank_start_method
from ports import free_port
from test_distributed import inputs, qlora_base  # noqa: F401 (fixtures: test_distributed's tiny inputs, QLoRA base)

from litgpt.args import FSDPArgs
from litgpt.errors import UserError

TINY = dict(name="prefetch-llama", block_size=32, vocab_size=64, padded_vocab_size=64, n_layer=4, n_embd=32,
            n_head=4, n_query_groups=2, intermediate_size=64, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
            bias=False)


# ---- reading the settings --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, blocks",
    [(0, 0), (1, 1), (2, 2), ("3", 3), (True, 1), (False, 0), (None, 0), ("true", 1), ("False", 0), ("null", 0)],
)
def test_prefetch_settings(value, blocks):
    fsdp = FSDPArgs(forward_prefetch=value, backward_prefetch=value)
    assert (fsdp.forward_prefetch, fsdp.backward_prefetch) == (blocks, blocks)


@pytest.mark.parametrize("name, blocks", [("BACKWARD_PRE", 1), ("backward_pre", 1), ("BACKWARD_POST", 0),
                                          ("NO_PREFETCH", 0)])
def test_fsdp1_backward_prefetch_names(name, blocks):
    assert FSDPArgs(backward_prefetch=name).backward_prefetch == blocks


@pytest.mark.parametrize(
    "field, value",
    [("forward_prefetch", -1), ("forward_prefetch", "soon"), ("forward_prefetch", 1.5),
     ("forward_prefetch", "BACKWARD_PRE"), ("backward_prefetch", "BACKWARD_LATER"), ("backward_prefetch", -2)],
)
def test_bad_prefetch_values_are_refused_in_one_line(field, value):
    with pytest.raises(UserError) as error:
        FSDPArgs(**{field: value})
    message = str(error.value)
    assert message.startswith(f"--fsdp.{field} {value!r} is not a setting") and "\n" not in message
    assert ("BACKWARD_PRE (1)" in message) == (field == "backward_prefetch")


def test_thunder_refuses_prefetching_it_does_not_do():
    from extensions.thunder.pretrain import check_fsdp_args

    with pytest.raises(UserError, match="--fsdp.backward_prefetch configures PyTorch's FSDP"):
        check_fsdp_args(FSDPArgs(backward_prefetch="BACKWARD_PRE"))
    check_fsdp_args(FSDPArgs(forward_prefetch=False, backward_prefetch="BACKWARD_POST"))  # FSDP2's own behaviour: 0


def test_bad_prefetch_value_on_the_command_line(tmp_path):
    """Refused while the arguments are parsed: exit 1, one line, no traceback, nothing on disk."""
    from test_distributed import ROOT, litgpt

    result = litgpt("pretrain", "--config", ROOT / "config_hub" / "pretrain" / "tiny.yaml", "--out_dir",
                    tmp_path / "out", "--devices", "2", "--fsdp.backward_prefetch", "BACKWARD_LATER", timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("--fsdp.backward_prefetch 'BACKWARD_LATER' is not a setting") == 1, result.stderr
    assert not (tmp_path / "out").exists()


# ---- the prefetch lists, on 2 real processes -------------------------------------------------------------------------
# Written out by hand for 4 blocks: forward, block i gathers i+1..i+n ahead; backward, i-1..i-n (nearest first).
# An empty list: the block keeps FSDP2's implicit order.
EXPECTED_FORWARD = {0: [[], [], [], []], 1: [[1], [2], [3], []], 2: [[1, 2], [2, 3], [3], []]}
EXPECTED_BACKWARD = {0: [[], [], [], []], 1: [[], [0], [1], [2]], 2: [[], [0], [1, 0], [2, 1]]}


def prefetch_lists(model) -> tuple[list, list]:
    """The blocks (by index) each block prefetches in the forward and in the backward pass, read from FSDP2's state."""
    index = {id(block._get_fsdp_state()): i for i, block in enumerate(model.transformer.h)}
    states = [block._get_fsdp_state() for block in model.transformer.h]
    return ([[index[id(s)] for s in state._states_to_forward_prefetch] for state in states],
            [[index[id(s)] for s in state._states_to_backward_prefetch] for state in states])


def sharded_tiny_gpt(strategy: str, forward: int, backward: int, checkpointing: str = "false", **changes):
    """The tiny GPT (seed 0; `changes` to its config) sharded over the 2 ranks by `shard_model`, as the recipes
    shard."""
    from litgpt.config import Config
    from litgpt.distributed.fsdp import shard_model
    from litgpt.distributed.parallelize import apply_activation_checkpointing
    from litgpt.distributed.topology import Topology
    from litgpt.model import GPT
    from litgpt.precision import Precision

    torch.manual_seed(0)
    model = GPT(Config(**{**TINY, **changes}))
    model.init_weights()
    apply_activation_checkpointing(model, checkpointing)
    fsdp = FSDPArgs(sharding_strategy=strategy, forward_prefetch=forward, backward_prefetch=backward)
    shard_model(model, Topology(2, 1, strategy).device_mesh("cpu"), fsdp, Precision("32-true"), torch.device("cpu"))
    return model


def full_gradients(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two forward and backward passes (the second on a resharded model) and the whole gradients."""
    for _ in range(2):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def gathered_through_a_step(strategy: str, tied: bool) -> dict[str, list]:
    """Which of the embedding's and the head's weights are gathered (a plain tensor, not the rank's DTensor shard)
    after the training loss's forward pass (`model_loss`: final hidden states, the head read by the chunked loss)
    and after its backward pass, and which FSDP units hold them."""
    from torch.distributed.fsdp import FSDPModule

    from litgpt.train.loss import LOSSES, model_loss

    model = sharded_tiny_gpt(strategy, 0, 0, tie_embeddings=tied)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    loss = lambda: model_loss(model, tokens[:, :-1], tokens[:, 1:], LOSSES["cross_entropy"])["loss"]  # noqa: E731
    gathered = lambda: [not isinstance(p, torch.distributed.tensor.DTensor)  # noqa: E731
                        for p in (model.transformer.wte.weight, model.lm_head.weight)]
    during = []  # in the last block's backward pass: what is gathered, and whether the head's gradient is reduced
    model.transformer.h[-1].register_full_backward_pre_hook(
        lambda *_: during.append(gathered() + [isinstance(model.lm_head.weight.grad, torch.distributed.tensor.DTensor)]))
    loss().backward()
    after_one_step = gathered()
    loss()
    return {"units": [isinstance(model.transformer.wte, FSDPModule), isinstance(model.lm_head, FSDPModule)],
            "after the forward pass": gathered(), "after a step": after_one_step, "the last block's backward": during}


def prefetch_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        lists = {}
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            for n in (0, 1, 2):
                lists[f"{strategy} {n} 0"] = prefetch_lists(sharded_tiny_gpt(strategy, n, 0))
                lists[f"{strategy} 0 {n}"] = prefetch_lists(sharded_tiny_gpt(strategy, 0, n))
        differences = {}
        tokens = torch.randint(0, TINY["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(rank))
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            for checkpointing in ("false", "full"):
                plain = full_gradients(sharded_tiny_gpt(strategy, 0, 0, checkpointing), tokens)
                ahead = full_gradients(sharded_tiny_gpt(strategy, 2, 2, checkpointing), tokens)
                difference = max((plain[k] - ahead[k]).abs().max().item() for k in plain)
                differences[f"{strategy} {checkpointing}"] = difference
        units = {f"{strategy} {'tied' if tied else 'untied'}": gathered_through_a_step(strategy, tied)
                 for strategy in ("FULL_SHARD", "SHARD_GRAD_OP") for tied in (False, True)}
        if rank == 0:
            Path(out).write_text(json.dumps({"lists": lists, "differences": differences, "units": units}))
        dist.barrier()
    finally:
        dist.destroy_process_group()



@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("prefetch") / "results.json"
    mp.start_processes(prefetch_worker, args=(free_port(), str(out)), nprocs=2, join=True,
                       start_method=rank_start_method())
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("n", [0, 1, 2])
def test_each_block_prefetches_the_next_n(strategy, n, two_rank_results):
    lists = two_rank_results["lists"]
    assert lists[f"{strategy} {n} 0"] == [EXPECTED_FORWARD[n], EXPECTED_BACKWARD[0]]
    assert lists[f"{strategy} 0 {n}"] == [EXPECTED_FORWARD[0], EXPECTED_BACKWARD[n]]


@pytest.mark.slow
def test_no_shard_gathers_nothing_so_prefetches_nothing(two_rank_results):
    empty = [EXPECTED_FORWARD[0], EXPECTED_BACKWARD[0]]
    assert all(two_rank_results["lists"][f"NO_SHARD {a} {b}"] == empty for a, b in [(1, 0), (2, 0), (0, 1), (0, 2)])


@pytest.mark.slow
def test_prefetching_leaves_the_gradients_as_they_are(two_rank_results):
    """The same gradients with prefetch 2/2 as with FSDP2's implicit order, with and without checkpointing."""
    assert two_rank_results["differences"] == {
        "FULL_SHARD false": 0.0, "FULL_SHARD full": 0.0, "SHARD_GRAD_OP false": 0.0, "SHARD_GRAD_OP full": 0.0,
    }



@pytest.mark.slow
def test_the_embedding_and_the_head_are_units_of_their_own_gathered_only_around_their_use(two_rank_results):
    """Untied, the embedding and the head are FSDP units of their own: after the loss's forward pass both weights are
    back to the rank's shard (FULL_SHARD); SHARD_GRAD_OP keeps both until the backward pass. When the blocks'
    backward passes run, the head is sharded again and its gradient reduce-scattered (the embedding still waits in
    SHARD_GRAD_OP). After a step both are sharded. Tied, the one weight stays in the root, gathered for the loss and
    through the backward pass, its gradient reduced at the end."""
    units = two_rank_results["units"]
    expected_after_forward = {"FULL_SHARD": [False, False], "SHARD_GRAD_OP": [True, True]}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        assert units[f"{strategy} untied"] == {
            "units": [True, True], "after a step": [False, False],
            "after the forward pass": expected_after_forward[strategy],
            "the last block's backward": [[strategy == "SHARD_GRAD_OP", False, True]]}
        assert units[f"{strategy} tied"] == {"units": [False, False], "after a step": [False, False],
                                             "after the forward pass": [True, True],
                                             "the last block's backward": [[True, True, False]]}


# ---- training with prefetching, 2 real processes through the CLI ----------------------------------------------------
PREFETCH_2 = ("--fsdp.forward_prefetch", "2", "--fsdp.backward_prefetch", "2")


def trained(args: list) -> Path:
    from test_distributed import litgpt

    result = litgpt(*args)
    assert result.returncode == 0, result.stderr
    return Path(args[args.index("--out_dir") + 1])


def assert_same_training(run: Path, reference: Path, weights_file: str) -> None:
    from test_distributed import assert_same_final, losses

    ours, theirs = losses(run), losses(reference)
    assert len(ours) == len(theirs) == 4 and min(theirs) > 0.5, (ours, theirs)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-6)
    assert_same_final(run, reference, weights_file, atol=1e-6)


@pytest.mark.slow
def test_pretrain_with_prefetching_trains_as_without(inputs, tmp_path):
    """FULL_SHARD over 4 blocks with activation checkpointing: prefetch 2/2 gives the losses and weights of FSDP2's
    implicit order, and metrics.json records the settings."""
    from test_distributed import command_args

    flags = ["--devices", "2", "--fsdp.sharding_strategy", "FULL_SHARD", "--model_config.n_layer", "4",
             "--train.activation_checkpointing", "true"]
    plain = trained([*command_args("pretrain", inputs, tmp_path / "plain"), *flags])
    ahead = trained([*command_args("pretrain", inputs, tmp_path / "ahead"), *flags, *PREFETCH_2])
    assert_same_training(ahead, plain, "lit_model.pth")
    fsdp = json.loads((ahead / "metrics.json").read_text())["fsdp"]
    assert (fsdp["forward_prefetch"], fsdp["backward_prefetch"]) == (2, 2)


@pytest.mark.slow
def test_qlora_with_prefetching_trains_as_without(inputs, qlora_base, tmp_path):
    """QLoRA's path (each block's NF4 base made just before it is sharded), with FSDP1's spellings from a YAML file."""
    from test_distributed import SHARDED_QLORA, qlora_args

    config = tmp_path / "prefetch.yaml"
    config.write_text("fsdp:\n  forward_prefetch: true\n  backward_prefetch: BACKWARD_PRE\n")
    plain = trained(qlora_args(inputs, qlora_base, tmp_path / "plain", *SHARDED_QLORA))
    ahead = trained(qlora_args(inputs, qlora_base, tmp_path / "ahead", *SHARDED_QLORA, "--config", config))
    assert_same_training(ahead, plain, "lit_model.pth.lora")
    fsdp = json.loads((ahead / "metrics.json").read_text())["fsdp"]
    assert (fsdp["forward_prefetch"], fsdp["backward_prefetch"]) == (1, 1)


def test_the_plan_counts_the_blocks_backward_prefetch_gathers():
    """`litgpt plan --fsdp.backward_prefetch N`: N blocks gathered ahead of the one running, so each block beyond
    FSDP2's own one adds a Llama block's parameters in bf16 (counted here from the config by hand)."""
    from litgpt.args import TrainArgs
    from litgpt.config import Config
    from litgpt.plan import plan_for

    config = Config.from_name("Llama-3.2-1B")
    e, q, kv = config.n_embd, config.n_head * config.head_size, config.n_query_groups * config.head_size
    block_bytes = 2 * (e * (q + 2 * kv) + q * e + 3 * e * config.intermediate_size + 2 * e)
    settings = dict(precision="bf16-mixed", devices=8, train=TrainArgs(micro_batch_size=1, max_seq_length=2048))
    gathered = [plan_for(config, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD", backward_prefetch=n), **settings)
                .gathered_params for n in (0, 1, 2, 3)]
    assert gathered[0] == gathered[1]  # FSDP2 prefetches one block by itself
    assert gathered[2] - gathered[1] == block_bytes
    assert gathered[3] - gathered[2] == block_bytes
    with pytest.raises(UserError, match="--fsdp.backward_prefetch 'later' is not a setting"):
        plan_for(config, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD", backward_prefetch="later"), **settings)

"""`litgpt compress_moe`: the expert selection against a hand computation, the merge against a hand-computed weighted
average, the round trip through transformers (Qwen3-MoE, Mixtral) and the bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_helpers import write_random_checkpoint
from litgpt_forkserver import run_litgpt
from test_bad_input import tree_state

from litgpt.__main__ import main as cli_main
from litgpt.checkpoint.model_files import load_model_weights
from litgpt.compress_moe import (
    collect_routing, compress_state_dict, experts_by_layer, nearest_kept_experts, select_experts
)
from litgpt.config import Config
from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR
from litgpt.io import load_state_dict
from litgpt.model import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
N_EMBD = 8
# Routing probabilities of the four calibration token ids (rows) over the four experts (columns).
PROBABILITIES = [
    [0.5, 0.3, 0.1, 0.1],
    [0.1, 0.2, 0.3, 0.4],
    [0.05, 0.15, 0.6, 0.2],
    [0.1, 0.6, 0.1, 0.2],
]
# Two sequences: [0, 1, 2, 3, 2] and [1, 2] right-padded with id 0, whose routing must not count.
TOKENS = torch.tensor([[0, 1, 2, 3, 2], [1, 2, 0, 0, 0]])
LENGTHS = torch.tensor([5, 2])


def hand_routing(renormalize: bool) -> list[float]:
    """Per expert, the routing weight the real tokens of TOKENS give it with top-2 routing, in plain Python."""
    totals = [0.0] * 4
    for row, length in zip(TOKENS.tolist(), LENGTHS.tolist()):
        for token in row[:length]:
            p = PROBABILITIES[token]
            top = sorted(range(4), key=lambda e: -p[e])[:2]
            norm = sum(p[e] for e in top) if renormalize else 1.0
            for e in top:
                totals[e] += p[e] / norm
    return totals


def routed_model(renormalize: bool) -> GPT:
    """A one-layer MoE whose router sees, for token t, sqrt(n_embd) * e_t (to within the norm's eps): attention adds
    nothing, token t's embedding is 3 * e_t, and router column t is log(PROBABILITIES[t]) / sqrt(n_embd)."""
    config = Config(n_layer=1, n_embd=N_EMBD, n_head=2, vocab_size=16, padded_vocab_size=16, block_size=16,
                    mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=8,
                    moe_renormalize=renormalize)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    block = model.transformer.h[0]
    with torch.no_grad():
        block.attn.proj.weight.zero_()
        block.norm_2.weight.fill_(1.0)
        model.transformer.wte.weight.zero_()
        model.transformer.wte.weight[:N_EMBD].copy_(3.0 * torch.eye(N_EMBD))
        scale = 3.0 / math.sqrt(9.0 / N_EMBD + config.norm_eps)  # what RMSNorm makes of 3 * e_t
        block.mlp.gate.weight.zero_()
        block.mlp.gate.weight[:, :4].copy_(torch.tensor(PROBABILITIES).log().T / scale)
    return model.eval()


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_and_selection_equal_a_hand_computation(renormalize):
    model = routed_model(renormalize)
    routing = collect_routing(model, [(TOKENS, LENGTHS)])
    expected = hand_routing(renormalize)
    torch.testing.assert_close(routing.weight[0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-5)
    # Tokens per expert: token ids 0, 1, 2, 3 occur 1, 2, 3, 1 times; their top-2 are {0,1}, {2,3}, {2,3}, {1,3}.
    assert routing.tokens[0].tolist() == [1, 2, 5, 6] and routing.num_tokens == 7
    # renormalized: 0.625, 1.125, 3.107, 2.143; not: 0.5, 0.9, 2.4, 1.6. Counting the 3 padding positions (id 0)
    # would lift expert 0 above expert 1 in both.
    assert select_experts(routing.weight[0], 2) == [2, 3]
    assert select_experts(routing.weight[0], 3) == [1, 2, 3]


def test_ties_go_to_the_lower_index_and_kept_experts_keep_their_order():
    assert select_experts(torch.tensor([1.0, 2.0, 2.0, 1.0]), 1) == [1]
    assert select_experts(torch.tensor([1.0, 2.0, 2.0, 1.0]), 3) == [0, 1, 2]
    assert select_experts(torch.tensor([0.0, 0.0, 0.0, 0.0]), 2) == [0, 1]
    assert select_experts(torch.tensor([5.0, 1.0, 7.0, 6.0]), 2) == [2, 3]


def expert(state_dict: dict, layer: int, index: int) -> dict[str, torch.Tensor]:
    prefix = f"transformer.h.{layer}.mlp.experts.{index}."
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def test_sliced_router_and_experts_are_the_source_rows():
    model = routed_model(renormalize=True)
    source = model.state_dict()
    routing = collect_routing(model, [(TOKENS, LENGTHS)])
    kept = {0: select_experts(routing.weight[0], 2)}
    compressed = compress_state_dict(source, kept, {0: {}}, routing.weight)
    assert torch.equal(compressed["transformer.h.0.mlp.gate.weight"], source["transformer.h.0.mlp.gate.weight"][[2, 3]])
    for new, old in enumerate([2, 3]):
        ours, theirs = expert(compressed, 0, new), expert(source, 0, old)
        assert ours.keys() == theirs.keys() == {"fc_1.weight", "fc_2.weight", "proj.weight"}
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert not expert(compressed, 0, 2)  # experts 2 and 3 are now 0 and 1; there is no third
    others = {k for k in source if ".mlp." not in k}
    assert all(compressed[k] is source[k] for k in others)
    # The compressed model loads with K experts, and a token whose two experts were both kept is served as before
    # (its renormalized weights do not change): token 2 routes to experts 2 and 3.
    small = GPT(Config(**{**model.config.to_dict(), "n_expert": 2}))
    load_model_weights(small, compressed, "compressed")
    x = torch.zeros(1, 3, N_EMBD)
    x[0, :, 2] = torch.tensor([1.0, 2.0, 4.0])  # router logits: multiples of log(PROBABILITIES[2])
    with torch.no_grad():
        torch.testing.assert_close(small.transformer.h[0].mlp(x), model.transformer.h[0].mlp(x))


def test_merge_is_the_routing_weighted_average_with_the_nearest_kept_expert():
    model = routed_model(renormalize=True)
    with torch.no_grad():  # expert 0 points like expert 3, expert 1 like expert 2 (cosine similarity near 1)
        experts = model.transformer.h[0].mlp.experts
        for dropped, like, factor in ((0, 3, 2.0), (1, 2, 0.5)):
            for name in ("fc_1", "fc_2", "proj"):
                target = getattr(experts[like], name).weight
                getattr(experts[dropped], name).weight.copy_(factor * target + 0.01 * torch.randn_like(target))
    source = model.state_dict()
    routing = collect_routing(model, [(TOKENS, LENGTHS)])
    kept = {0: select_experts(routing.weight[0], 2)}
    merged_into = {0: nearest_kept_experts(experts_by_layer(source)[0], kept[0])}
    assert kept == {0: [2, 3]} and merged_into == {0: {0: 3, 1: 2}}
    compressed = compress_state_dict(source, kept, merged_into, routing.weight)
    w = hand_routing(renormalize=True)
    for new, group in ((0, (2, 1)), (1, (3, 0))):
        for name in ("fc_1.weight", "fc_2.weight", "proj.weight"):
            weighted = sum(w[e] * source[f"transformer.h.0.mlp.experts.{e}.{name}"] for e in group)
            average = weighted / sum(w[e] for e in group)
            merged = compressed[f"transformer.h.0.mlp.experts.{new}.{name}"]
            torch.testing.assert_close(merged, average, rtol=0, atol=1e-6)
    assert torch.equal(compressed["transformer.h.0.mlp.gate.weight"], source["transformer.h.0.mlp.gate.weight"][[2, 3]])


def test_nearest_kept_expert_ties_go_to_the_lower_index():
    same = {e: {"fc_1.weight": torch.ones(2, 2) * (e + 1)} for e in range(4)}
    assert nearest_kept_experts(same, [1, 3]) == {0: 1, 2: 1}


# ---- through the CLI and transformers -------------------------------------------------------------------------
def litgpt_cli(*args, env=None) -> subprocess.CompletedProcess:
    """`python -m litgpt ARGS`, forked from a server that imported torch and Lightning once."""
    return run_litgpt(args, cwd=ROOT, env=env)


def text_folder(folder: Path) -> Path:
    """Five .txt files of the bundled stories: calibration data the test writes itself."""
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")
    folder.mkdir(parents=True)
    for index in range(5):
        (folder / f"{index}.txt").write_text("\n\n".join(stories[index * 4 : index * 4 + 4]))
    return folder


def hf_moe_model(family: str):
    """A tiny random transformers Qwen3-MoE or Mixtral with 6 experts, 2 per token, and the bundled 4096-token
    tokenizer's vocabulary."""
    import transformers

    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=4096,
                 num_experts_per_tok=2)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**shape, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                             head_dim=16, norm_topk_prob=True)
        model_class = transformers.Qwen3MoeForCausalLM
    elif family == "glm4_moe":  # a dense first layer, a shared expert, a sigmoid router with a correction bias
        config = transformers.Glm4MoeConfig(**{**shape, "num_hidden_layers": 3}, intermediate_size=96,
                                            moe_intermediate_size=32, n_routed_experts=6, n_shared_experts=1,
                                            first_k_dense_replace=1, routed_scaling_factor=2.0)
        torch.manual_seed(0)
        model = transformers.Glm4MoeForCausalLM(config).eval()
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
        return model
    else:
        config = transformers.MixtralConfig(**shape, intermediate_size=32, num_local_experts=6, sliding_window=None)
        model_class = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    return model_class(config).eval()


def hf_experts(model, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router, gate_up_proj, down_proj) of a transformers MoE layer (experts fused in transformers 5)."""
    mlp = model.model.layers[layer].mlp
    return mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_compressed_checkpoint_round_trips_through_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint
    from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint

    hf_dir, out_dir, back_dir, k = tmp_path / "hf", tmp_path / "compressed", tmp_path / "back", 3
    source = hf_moe_model(family)
    source.save_pretrained(hf_dir)
    for file in TOKENIZER_DIR.iterdir():
        shutil.copy2(file, hf_dir / file.name)
    convert_hf_checkpoint(hf_dir, dtype="float32")
    env = {**os.environ, "LITGPT_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    result = litgpt_cli("compress_moe", hf_dir, "--out_dir", out_dir, "--num_experts", k, "--data", "TextFiles",
                        "--data.train_data_path", text_folder(tmp_path / "text"), "--calibration.samples", 8,
                        "--calibration.max_seq_length", 32, env=env)
    assert result.returncode == 0, result.stderr
    assert "layer   1: kept experts" in result.stdout and "of the routing weight over 2 layers" in result.stdout
    report = json.loads((out_dir / "compress_moe.json").read_text())
    assert yaml.safe_load((out_dir / "model_config.yaml").read_text())["n_expert"] == k
    assert (out_dir / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert report["calibration"]["tokens"] == 8 * 32

    convert_lit_checkpoint(out_dir, back_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(back_dir).eval()
    assert type(reloaded) is type(source)
    assert (reloaded.config.num_experts if family == "qwen3_moe" else reloaded.config.num_local_experts) == k
    ours = GPT(Config.from_checkpoint(out_dir))
    load_model_weights(ours, load_state_dict(out_dir / "lit_model.pth"), str(out_dir))
    assert [entry["layer"] for entry in report["layers"]] == ([1, 2] if family == "glm4_moe" else [0, 1])
    for entry in report["layers"]:
        layer, kept = entry["layer"], [e["expert"] for e in entry["kept"]]
        assert len(kept) == k and kept == sorted(kept)
        for got, want in zip(hf_experts(reloaded, layer), hf_experts(source, layer)):
            assert torch.equal(got, want[kept])  # the kept experts' router rows and weights, bit for bit
        moe = ours.transformer.h[layer].mlp
        assert torch.equal(moe.gate.weight, hf_experts(reloaded, layer)[0])
        if family == "glm4_moe":  # the kept experts' correction biases; the shared expert as it was
            source_mlp = source.model.layers[layer].mlp
            bias = reloaded.model.layers[layer].mlp.gate.e_score_correction_bias
            assert torch.equal(bias, source_mlp.gate.e_score_correction_bias[kept])
            assert torch.equal(moe.shared_experts.proj.weight, source_mlp.shared_experts.down_proj.weight)
        for j, expert_module in enumerate(moe.experts):
            gate_up = torch.cat([expert_module.fc_1.weight, expert_module.fc_2.weight])
            assert torch.equal(gate_up, hf_experts(reloaded, layer)[1][j])
            assert torch.equal(expert_module.proj.weight, hf_experts(reloaded, layer)[2][j])
    tokens = torch.randint(0, 4096, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (ours.eval()(tokens) - reloaded(tokens).logits).abs().max().item()
    assert difference <= 1e-4


def test_cli_merge_writes_folder_and_report_in_place_of_an_existing_out_dir(tmp_path):
    """The merge strategy through the CLI: the files, the config (only n_expert changed), the report and the summary;
    an existing out_dir is replaced with --overwrite true (refused without it: see the bad input below)."""
    config = Config(n_layer=2, n_embd=32, n_head=2, vocab_size=4096, block_size=64, intermediate_size=64,
                    mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=16)
    source = write_random_checkpoint(tmp_path / "moe", config)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "old.txt").write_text("old")
    data = ["--data", "TextFiles", "--data.train_data_path", text_folder(tmp_path / "text")]
    env = {**os.environ, "LITGPT_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    args = ["compress_moe", source, "--out_dir", out_dir, "--num_experts", 2, "--strategy", "merge", *data,
            "--calibration.samples", 4, "--calibration.max_seq_length", 16, "--overwrite", "true"]
    result = litgpt_cli(*args, env=env)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        ["lit_model.pth", "model_config.yaml", "compress_moe.json", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json"])
    assert not list(tmp_path.glob(".out*"))  # no staging folder left behind
    source_config = yaml.safe_load((source / "model_config.yaml").read_text())
    assert yaml.safe_load((out_dir / "model_config.yaml").read_text()) == {**source_config, "n_expert": 2}
    report = json.loads((out_dir / "compress_moe.json").read_text())
    assert report["strategy"] == "merge" and report["calibration"] == {"samples": 4, "max_seq_length": 16, "tokens": 64}
    for layer in report["layers"]:
        shares = [e["routing_share"] for e in layer["kept"]]
        assert math.isclose(sum(shares), layer["kept_share"]) and 0.5 <= layer["kept_share"] <= 1
        dropped = {0, 1, 2, 3} - {e["expert"] for e in layer["kept"]}
        assert sorted(int(d) for d in layer["merged_into"]) == sorted(dropped)
    assert sum(e["tokens"] for e in report["layers"][0]["kept"]) <= 2 * 64
    assert result.stdout.count("(merged ") == 2 and "of the routing weight over 2 layers" in result.stdout


# ---- bad input: one line, exit code 1, nothing on disk changed ----------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("compress_bad_input")
    moe = Config(n_layer=1, n_embd=32, n_head=2, vocab_size=4096, block_size=64, intermediate_size=64,
                 mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=16)
    write_random_checkpoint(root / "moe", moe)
    write_random_checkpoint(root / "dense", Config(n_layer=1, n_embd=32, n_head=2, vocab_size=4096, block_size=64,
                                                   intermediate_size=64))
    shutil.copytree(root / "moe", root / "no_weights")
    (root / "no_weights" / "lit_model.pth").unlink()
    (root / "taken").mkdir()
    (root / "taken" / "keep.txt").write_text("mine")
    return root


def case(case_id: str, args: list[str], message: str):
    return pytest.param(args, message, id=case_id)


# Run in this process (the CLI's main): the error comes before any heavy work, so each case takes milliseconds.
BAD_INPUT = [
    case("num-experts-zero", ["{w}/moe", "--num_experts", "0"],
         "--num_experts 0 is out of range: the model has 4 experts per layer"),
    case("num-experts-above-count", ["{w}/moe", "--num_experts", "5"], "--num_experts 5 is out of range"),
    case("num-experts-below-per-token", ["{w}/moe", "--num_experts", "1"],
         "routes each token to 2, so keep between 2 and 4"),
    case("dense-model", ["{w}/dense", "--num_experts", "2"],
         "is dense (LLaMAMLP): compress_moe needs a mixture-of-experts checkpoint"),
    case("no-weights", ["{w}/no_weights", "--num_experts", "2"], "no_weights' has no lit_model.pth"),
    case("unknown-strategy", ["{w}/moe", "--num_experts", "2", "--strategy", "prune"],
         "--strategy 'prune' is not one of top_routed, merge"),
    case("out-dir-exists", ["{w}/moe", "--num_experts", "2", "--out_dir", "{w}/taken"],
         "taken' already exists and is not empty"),
    case("no-samples", ["{w}/moe", "--num_experts", "2", "--calibration.samples", "0"],
         "--calibration.samples must be at least 1"),
    case("seq-length-over-block-size", ["{w}/moe", "--num_experts", "2", "--calibration.max_seq_length", "65"],
         "and the model's block size 64"),
    case("out-dir-is-the-source", ["{w}/moe", "--num_experts", "2", "--out_dir", "{w}/moe", "--overwrite", "true"],
         "is the checkpoint being compressed"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input(world, args, message, capsys):
    before = tree_state(world)
    if "--out_dir" not in args:
        args = [*args, "--out_dir", "{w}/out"]
    command = [arg.replace("{w}", str(world)) for arg in args]
    with pytest.raises(SystemExit) as exit_info:  # any other exception (a traceback) fails the test
        cli_main(["compress_moe", *command])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("litgpt")]
    assert len(errors) == 1 and message in errors[0], stderr
    assert tree_state(world) == before

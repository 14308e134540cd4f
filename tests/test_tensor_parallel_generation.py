"""Generation on a model split by tensor parallelism (`litgpt generate` and `litgpt serve` with --parallel.tensor),
with real processes on the CPU (gloo), against one process: each rank's share loaded from a checkpoint gives the whole
model's logits (with and without the KV cache), the command prints the same tokens (greedy and seeded sampling), the
server answers as `generate` alone does and stops with its ranks; and the refusals, one line each.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch
from test_distributed import child_environment, litgpt
from test_generate import tiny_config, tiny_model
from test_serve import MAX_NEW_TOKENS, start_server, stop, write_checkpoint
from test_serve import reference  # noqa: F401 (the fixture: `generate` alone on this module's `checkpoint`)
from test_tensor_parallel import FAMILIES, gloo_rank, run_spawned_ranks
from tokenizer_helpers import make_tokenizer_folder

from litgpt.args import ParallelArgs
from litgpt.errors import UserError
from litgpt.io import load_state_dict, save_state_dict

FLOAT32 = ["--precision", "32-true", "--device", "cpu"]
TP2 = ["--parallel.tensor", "2", "--devices", "2"]
LLAMA_VOCAB = 589  # the llama-style test tokenizer's


def rule_out_padding(folder: Path, vocab_size: int) -> None:
    """The head's bias keeps the padded vocabulary rows (no token of the tokenizer) from ever being picked."""
    state_dict = {key: value.clone() for key, value in load_state_dict(folder / "lit_model.pth").items()}
    state_dict["lm_head.bias"][vocab_size:] = -1e4
    save_state_dict(state_dict, folder / "lit_model.pth")


def write_split_checkpoint(folder: Path, **changes) -> Path:
    """A random checkpoint with the llama-style tokenizer whose vocabulary, padded to 590 rows, splits in two."""
    make_tokenizer_folder(folder, "llama")
    config = tiny_config(**{"vocab_size": LLAMA_VOCAB, "padded_vocab_size": 590, "lm_head_bias": True, **changes})
    save_state_dict(tiny_model(config).state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    rule_out_padding(folder, LLAMA_VOCAB)
    return folder


# ---- each rank's share against the whole model ------------------------------------------------------------------
SPLIT_CASES = {
    "llama": dict(mlp_class_name="LLaMAMLP", intermediate_size=128, norm_class_name="RMSNorm"),
    # biases everywhere (the fused qkv's permuted with its rows), a parallel residual, the head tied to the embedding
    "neox": dict(n_query_groups=4, bias=True, parallel_residual=True, tie_embeddings=True,
                 final_logit_softcapping=8.0),
    # Training's families (test_tensor_parallel.FAMILIES) on this vocabulary: query/key norms of the three kinds,
    # sinks with sliding windows and biased experts, mixtures of experts with and without a shared expert and a dense
    # first layer, latent attention (its latent KV cache whole on each rank, a decoded token attending to it folded).
    **{name: {key: value for key, value in FAMILIES[name].items()
              if key not in ("name", "vocab_size", "padded_vocab_size", "block_size")}
       for name in ("qwen3", "stablelm-2", "olmo-2", "gpt-oss", "qwen3-moe", "deepseek-v3")},
}
# DeepSeek-V2-Lite's latent attention: one q_proj instead of the query's low-rank pair.
SPLIT_CASES["deepseek-v2-lite"] = {**SPLIT_CASES["deepseek-v3"], "q_lora_rank": None}


def split_logits_match_whole(root: Path, rank: int, world: int, port: int, failures) -> None:
    """On each rank: the share `load_split_model` reads from a checkpoint holds 1/world of the heads, every expert's
    width, the vocabulary and the KV cache's key-value groups (latent attention: the whole latent), and gives the whole
    model's logits within 1e-5, without and with the cache (a prompt, then one token at a time)."""
    from torch.distributed.device_mesh import init_device_mesh

    from litgpt.config import Config
    from litgpt.distributed.inference import load_split_model
    from litgpt.model import GPT

    with gloo_rank(rank, world, port, failures):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor",))
        for name in SPLIT_CASES:
            folder = root / name
            config = Config.from_checkpoint(folder)
            whole = GPT(config).eval()
            whole.load_state_dict(load_state_dict(folder / "lit_model.pth"))
            split = load_split_model(folder, torch.float32, mesh, torch.device("cpu"))
            by_heads = "kv_b_proj" if config.kv_lora_rank else "qkv"  # the last block's: DeepSeek's first is dense
            rows = getattr(split.transformer.h[-1].attn, by_heads).weight.to_local().shape[0]
            assert rows == getattr(whole.transformer.h[-1].attn, by_heads).weight.shape[0] // world, name
            if config.mlp_class_name == "LLaMAMoE":
                expert = split.transformer.h[-1].mlp.experts[0].fc_1.weight
                assert expert.to_local().shape[0] == config.moe_intermediate_size // world, name
            assert split.lm_head.weight.to_local().shape[0] == config.padded_vocab_size // world, name
            idx = torch.randint(0, LLAMA_VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
            with torch.inference_mode():
                torch.testing.assert_close(split(idx), whole(idx), rtol=1e-5, atol=1e-5, msg=name)
                for model in (whole, split):
                    model.set_kv_cache(batch_size=1, max_seq_length=24)
                groups = split.transformer.h[0].attn.kv_cache.k.shape[1]
                assert groups == (1 if config.kv_lora_rank else config.n_query_groups // world), name
                tokens, positions = idx[:1, :7], torch.arange(7)
                for _ in range(6):
                    expected = whole(tokens, input_pos=positions)
                    torch.testing.assert_close(split(tokens, input_pos=positions), expected, rtol=1e-5, atol=1e-5,
                                               msg=name)
                    tokens, positions = expected[:, -1:].argmax(-1), positions[-1:] + 1


@pytest.mark.slow  # spawns 2 processes
def test_each_rank_loads_its_share_and_the_logits_equal_the_whole_model(tmp_path):
    for name, changes in SPLIT_CASES.items():
        write_split_checkpoint(tmp_path / name, **changes)
    run_spawned_ranks(functools.partial(split_logits_match_whole, tmp_path), 2)


# ---- the commands ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory) -> Path:
    return write_split_checkpoint(tmp_path_factory.mktemp("tp-generate") / "tiny")


@pytest.mark.slow  # 2 processes per run
@pytest.mark.parametrize(
    "sampling",
    [["--temperature", "0"],
     ["--temperature", "0.9", "--top_k", "20", "--top_p", "0.9", "--seed", "3", "--num_samples", "2"]],
    ids=["greedy", "sampled"],
)
def test_generate_on_two_processes_prints_what_one_process_prints(split_checkpoint, sampling):
    args = ["generate", split_checkpoint, "--prompt", "Once upon a", "--max_new_tokens", "24", *FLOAT32, *sampling]
    one, two = litgpt(*args), litgpt(*args, *TP2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert one.stdout.startswith("Once upon a") and len(one.stdout) > len("Once upon a") + 10
    assert two.stdout == one.stdout
    assert "over 2 devices" in two.stderr and "Traceback" not in two.stderr


@pytest.mark.slow  # 2 processes
def test_a_split_mixture_of_experts_with_latent_attention_generates_what_one_process_does(tmp_path):
    folder = write_split_checkpoint(tmp_path / "deepseek", **SPLIT_CASES["deepseek-v3"])
    args = ["generate", folder, "--prompt", "Once upon a", "--max_new_tokens", "16", "--temperature", "0", *FLOAT32]
    one, two = litgpt(*args), litgpt(*args, *TP2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert len(one.stdout) > len("Once upon a") + 5 and two.stdout == one.stdout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """test_serve's chat model with a vocabulary of 504 rows (503 tokens): the reference's checkpoint too."""
    folder = write_checkpoint(tmp_path_factory.mktemp("tp-serve") / "tiny-chatml", padded_vocab_size=504,
                              lm_head_bias=True)
    rule_out_padding(folder, 503)
    return folder


@pytest.mark.slow  # 2 processes
def test_a_split_server_answers_as_generate_alone_and_stops_with_its_ranks(checkpoint, reference,  # noqa: F811
                                                                           tmp_path):
    psutil = pytest.importorskip("psutil")
    openai = pytest.importorskip("openai")
    log = tmp_path / "server.log"
    process, port = start_server(checkpoint, log, *TP2, *FLOAT32[:2], "--max_new_tokens", str(MAX_NEW_TOKENS),
                                 "--kv_block_size", "8")
    ranks = [process.pid] + [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        text, _, new_tokens = reference("The llama", chat=False)
        answer = client.completions.create(model="tiny-chatml", prompt="The llama", temperature=0)
        assert answer.choices[0].text == text and answer.usage.completion_tokens == new_tokens
        text, _, _ = reference("What do llamas eat?", chat=True)
        chunks = client.chat.completions.create(model="tiny-chatml", temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "What do llamas eat?"}])
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finally:
        stop(process)
    assert process.returncode == 0 and "litgpt serve: stopped" in log.read_text(), log.read_text()[-3000:]
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in ranks if psutil.pid_exists(pid)], timeout=30)
    assert not alive, f"still running: {alive}"
    assert len(ranks) >= 2 and "Traceback" not in log.read_text()


# ---- refusals ---------------------------------------------------------------------------------------------------
TENSOR_2 = dict(parallel=ParallelArgs(tensor=2))


@pytest.mark.parametrize(
    "command, changes, options, message",
    [
        ("generate", {"n_head": 3, "n_query_groups": 3, "n_embd": 48}, TENSOR_2, "does not divide the 3 heads (n_head)"),
        ("generate", {"n_query_groups": 1}, TENSOR_2, "does not divide the 1 key-value groups (n_query_groups)"),
        ("generate", {"padded_vocab_size": 589}, TENSOR_2,
         "does not divide the 589 vocabulary rows (padded_vocab_size)"),
        ("generate", {"mlp_class_name": "LLaMAMoE", "n_expert": 4, "n_expert_per_token": 2,
                      "moe_intermediate_size": 33}, TENSOR_2, "does not divide the 33 experts' width"),
        ("generate", {}, dict(**TENSOR_2, compile=True), "--compile with --parallel.tensor 2 is not supported yet"),
        ("generate", {}, dict(**TENSOR_2, device="cuda:1"), "--device cuda:1 with --parallel.tensor 2"),
        ("generate", {}, dict(**TENSOR_2, devices=1),
         "--parallel.tensor 2 splits the model over 2 devices, but --devices is 1: use --devices 2."),
        ("generate", {}, dict(parallel=ParallelArgs(expert=2)), "splits a model with --parallel.tensor only"),
        ("generate", {}, dict(parallel=ParallelArgs(tensor=4096)), "--parallel.tensor 4096 needs 4096 devices, and "
                                                                   "this machine has"),
        ("serve", {"n_query_groups": 1}, TENSOR_2, "does not divide the 1 key-value groups (n_query_groups)"),
        ("serve", {}, dict(**TENSOR_2, devices=4), "--devices 4 with --parallel.tensor 2"),
    ],
    ids=["heads", "groups", "vocabulary", "experts-width", "compile", "one-device", "too-few-devices", "expert", "machine",
         "serve-groups", "serve-devices"],
)
def test_what_split_generation_refuses(command, changes, options, message, tmp_path):
    from litgpt.generate import main as generate
    from litgpt.serving.server import main as serve

    folder = write_split_checkpoint(tmp_path / "tiny", **changes)
    with pytest.raises(UserError, match=re.escape(message)):
        (generate if command == "generate" else serve)(folder, **{"device": "cpu", **options})


@pytest.mark.parametrize(
    "command, flags, message",
    [("generate", ["--devices", "2"], "--devices 2 with --parallel.tensor 1: litgpt generate runs one copy of the "
                                      "model, split over --parallel.tensor devices: add --parallel.tensor 2"),
     ("serve", [*TP2, "--quantize", "bnb.nf4"], "--quantize bnb.nf4 with --parallel.tensor 2 is not supported")],
)
def test_a_refused_split_is_one_line_before_any_process_starts(command, flags, message, split_checkpoint):
    result = litgpt(command, split_checkpoint, *FLOAT32, *flags, env=child_environment())
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, result.stderr[-2000:]

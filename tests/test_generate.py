"""Generation: sampling math, the KV cache against the full forward, stopping, limits, loading, the CLI, and greedy
agreement with `transformers` on converted checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.generate import generate, held_back, sample
from litgpt.model import GPT

REPO = Path(__file__).resolve().parents[1]


# ---- sampling ------------------------------------------------------------------------------------------------------
def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, temperature=0.0), logits.argmax(-1))
    # top_k / top_p do not matter for greedy decoding
    assert torch.equal(sample(logits, temperature=0, top_k=3, top_p=0.5), logits.argmax(-1))
    assert sample(logits[0], temperature=0).shape == ()


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0, 2.0, 3.0])
    generator = torch.Generator().manual_seed(0)
    drawn = set(sample(logits.expand(400, 6), temperature=10.0, top_k=3, generator=generator).tolist())
    assert drawn == {1, 3, 5}  # the three largest logits, each drawn at a high temperature
    drawn = {int(sample(logits, temperature=1.0, top_k=1, generator=generator)) for _ in range(50)}
    assert drawn == {1}
    # k above the vocabulary keeps everything
    drawn = set(sample(logits.expand(600, 6), temperature=100.0, top_k=1000, generator=generator).tolist())
    assert drawn == set(range(6))


def test_top_p_on_a_hand_built_distribution():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.25, 0.1])
    logits = probs.log()
    generator = torch.Generator().manual_seed(0)

    def support(top_p, n=4000):
        # n independent rows, sampled in one call
        counts = torch.bincount(sample(logits.expand(n, 5), 1.0, None, top_p, generator), minlength=5)
        return {i for i in range(5) if counts[i] > 0}, counts.float() / n

    assert support(0.4)[0] == {1}  # 0.5 alone reaches 0.4
    assert support(0.6)[0] == {1, 3}  # 0.5 + 0.25 = 0.75 >= 0.6
    kept, _ = support(0.8)  # 0.5 + 0.25 falls short: one of the two 0.1s joins (which one, the sort decides)
    assert len(kept) == 3 and {1, 3} < kept and 0 not in kept
    assert support(0.9)[0] == {1, 2, 3, 4}  # 0.5 + 0.25 + 0.1 + 0.1 = 0.95 >= 0.9, the 0.05 is dropped
    assert support(1.0)[0] == set(range(5))
    # renormalized: at top_p 0.6 the kept tokens keep their ratio 0.5 : 0.25
    _, freq = support(0.6)
    assert abs(freq[1].item() - 2 / 3) < 0.03


def test_top_k_then_top_p_batched():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    generator = torch.Generator().manual_seed(1)
    out = torch.stack([sample(logits, 1.0, 2, 0.01, generator) for _ in range(20)])
    assert out.shape == (20, 2)
    assert (out[:, 0] == 3).all() and (out[:, 1] == 0).all()


def test_seeded_sampling_repeats():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    a = [sample(logits, 0.9, 20, 0.9, torch.Generator().manual_seed(42)) for _ in range(3)]
    b = [sample(logits, 0.9, 20, 0.9, torch.Generator().manual_seed(42)) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [int(sample(logits[0], 1.0, None, 1.0, g1)) for _ in range(30)] == [
        int(sample(logits[0], 1.0, None, 1.0, g2)) for _ in range(30)
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-3), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_sampling_ranges_are_checked(kwargs, match):
    with pytest.raises(UserError, match=match):
        sample(torch.zeros(5), **kwargs)


# ---- KV cache ------------------------------------------------------------------------------------------------------
def tiny_config(**overrides) -> Config:
    base = dict(
        n_layer=2, n_embd=64, n_head=4, n_query_groups=2, vocab_size=100, block_size=64, padded_vocab_size=100
    )
    return Config(**{**base, **overrides})


def tiny_model(config: Config, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():  # larger weights: logits far apart, so greedy choices are not near ties
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(5)
    return model.eval()


KV_CASES = {
    "plain": {},
    "sliding_window": dict(sliding_window_size=6),
    "sliding_every_other": dict(sliding_window_size=5, sliding_window_pattern=2),
    "softcapping": dict(attention_logit_softcapping=2.0, final_logit_softcapping=4.0),
}


@pytest.mark.parametrize("case", list(KV_CASES))
@torch.inference_mode()
def test_kv_cache_matches_full_forward(case):
    config = tiny_config(**KV_CASES[case])
    model = tiny_model(config)
    idx = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(3))
    full = model(idx)

    model.set_kv_cache(batch_size=2, max_seq_length=32)
    prefill = 9
    pieces = [model(idx[:, :prefill], input_pos=torch.arange(prefill))]
    for pos in range(prefill, idx.size(1)):
        pieces.append(model(idx[:, pos : pos + 1], input_pos=torch.tensor([pos])))
    incremental = torch.cat(pieces, dim=1)
    assert (incremental - full).abs().max().item() < 1e-5


@torch.inference_mode()
def test_generate_greedy_matches_recomputing_without_cache():
    model = tiny_model(tiny_config(sliding_window_size=4))
    prompt = torch.tensor([5, 17, 42, 8, 99, 3])
    out = list(generate(model, prompt, 15, temperature=0))
    assert len(out) == 15 and all(isinstance(t, int) for t in out)
    sequence = prompt.tolist()
    for _ in range(15):
        sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
    assert out == sequence[len(prompt) :]


# ---- generate(): stopping and limits ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_config())


PROMPT = [1, 2, 3, 4]


def greedy(model, **kwargs):
    return list(generate(model, PROMPT, kwargs.pop("max_new_tokens", 20), temperature=0, **kwargs))


def first_new_index(tokens):
    """An index whose token does not appear before it (so that it stops generation exactly there)."""
    return next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])


def test_generate_stops_at_any_stop_id(model):
    full = greedy(model)
    assert len(full) == 20
    i = first_new_index(full)
    assert greedy(model, stop_ids=[full[i]]) == full[:i]
    assert greedy(model, stop_ids=[999_999, full[i]]) == full[:i]
    assert greedy(model, stop_ids=[full[0]]) == []


def test_generate_stop_sequences(model):
    full = greedy(model)
    i = next(j for j in range(1, len(full) - 1) if all(full[k : k + 2] != full[j : j + 2] for k in range(j)))
    assert greedy(model, stop_sequences=[full[i : i + 2]]) == full[:i]
    # a sequence that starts to match but never completes releases every token
    assert greedy(model, stop_sequences=[[full[3], -1]]) == full
    assert held_back([1, 2, 3], [[3, 4, 5], [2, 3, 9, 9]]) == 2
    assert held_back([1, 2, 3], [[4, 5]]) == 0


def test_generate_never_exceeds_block_size(model):
    block = model.config.block_size
    prompt = list(range(1, block - 2))  # 61 tokens: room for 3
    out = list(generate(model, prompt, 50, temperature=0))
    assert len(out) == 3
    out = list(generate(model, list(range(block - 1)), 50, temperature=0))
    assert len(out) == 1


@pytest.mark.parametrize("length", [64, 80])
def test_prompt_too_long_is_a_user_error(model, length):
    with pytest.raises(UserError) as error:
        generate(model, list(range(length)), 5)  # raised at the call, before iteration
    assert f"{length} tokens" in str(error.value) and "64" in str(error.value)


def test_generate_argument_errors(model):
    with pytest.raises(UserError, match="empty"):
        generate(model, [], 5)
    with pytest.raises(UserError, match="top_p"):
        generate(model, PROMPT, 5, top_p=0)
    assert list(generate(model, PROMPT, 0)) == []


def test_seeded_generation_repeats(model):
    def run(seed):
        return list(generate(model, PROMPT, 20, 1.5, 20, 0.95, generator=torch.Generator().manual_seed(seed)))

    assert run(3) == run(3)
    assert run(3) != run(4)


# ---- checkpoints -----------------------------------------------------------------------------------------------------
def write_lit_checkpoint(folder: Path, tokenizer_style: str = "llama", block_size: int = 64, **overrides) -> Path:
    """A random litgpt checkpoint folder (lit_model.pth, model_config.yaml, tokenizer files)."""
    from tokenizers import Tokenizer as Backend

    from litgpt.io import save_state_dict
    from tokenizer_helpers import make_tokenizer_folder

    make_tokenizer_folder(folder, tokenizer_style)
    vocab = Backend.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    config = tiny_config(vocab_size=vocab, padded_vocab_size=vocab, block_size=block_size, **overrides)
    save_state_dict(tiny_model(config).state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    return folder


@pytest.fixture(scope="module")
def lit_checkpoint(tmp_path_factory) -> Path:
    return write_lit_checkpoint(tmp_path_factory.mktemp("lit") / "tiny")


def test_load_model_and_tokenizer(lit_checkpoint):
    from litgpt.generate import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(lit_checkpoint, precision="32-true", device="cpu")
    assert not any(p.is_meta for p in model.parameters())
    assert not model.training
    expected = torch.load(lit_checkpoint / "lit_model.pth", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert tokenizer.decode(tokenizer.encode("hello world", bos=False)) == "hello world"
    model16, _ = load_model_and_tokenizer(lit_checkpoint, precision="bf16-true", device="cpu")
    assert model16.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.slow  # torch.compile's compilation of the decoding step: with the whole suite (CI)
def test_compiled_decoding_equals_eager_and_compiles_once(lit_checkpoint):
    """--compile compiles the one-token step once per sampling setting and cache size: later positions and prompts of
    other lengths reuse the graph (the whole cache, sized in powers of two, is attended with a mask), and the tokens
    equal eager decoding's, greedy and with seeded sampling."""
    from torch._dynamo.utils import counters

    from litgpt.generate import load_model_and_tokenizer

    eager, _ = load_model_and_tokenizer(lit_checkpoint, precision="32-true", device="cpu")
    compiled, _ = load_model_and_tokenizer(lit_checkpoint, precision="32-true", device="cpu", compile=True)
    torch._dynamo.reset()
    counters.clear()
    for prompt in ([5, 6, 7], [9, 10, 11, 12, 13]):  # 14 and 16 positions: both in a 16-position cache
        assert list(generate(compiled, prompt, 12, temperature=0)) == list(generate(eager, prompt, 12, temperature=0))
        runs = [list(generate(m, prompt, 12, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(7)))
                for m in (compiled, eager)]
        assert runs[0] == runs[1]
    assert counters["stats"]["unique_graphs"] == 2  # greedy, and top-k sampling

    # Within a generation only the first step runs all guards: a new top_k, and a prompt that needs a larger cache,
    # must still compile new graphs, not reuse the old ones.
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # 21 positions: a 32-position cache
    for settings in (dict(temperature=1.0, top_k=5), dict(temperature=0)):
        runs = [list(generate(m, prompt, 12, **settings, generator=torch.Generator().manual_seed(3)))
                for m in (compiled, eager)]
        assert runs[0] == runs[1]
    assert counters["stats"]["unique_graphs"] == 4


def test_tied_embeddings_stay_tied(tmp_path):
    from litgpt.generate import load_model_and_tokenizer

    folder = write_lit_checkpoint(tmp_path / "tied", tie_embeddings=True)
    model, _ = load_model_and_tokenizer(folder, precision="bf16-true", device="cpu")
    assert model.lm_head.weight is model.transformer.wte.weight


def test_load_errors(tmp_path, lit_checkpoint):
    import shutil

    from litgpt.generate import load_model_and_tokenizer

    def error(folder, **kwargs):
        with pytest.raises(UserError) as info:
            load_model_and_tokenizer(folder, **{"device": "cpu", **kwargs})
        return str(info.value)

    assert "does not exist" in error(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "lit_model.pth" in error(tmp_path / "empty")

    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("lit_model.pth", "model_config.yaml"):
        shutil.copy(lit_checkpoint / name, no_tokenizer / name)
    assert "tokenizer.json" in error(no_tokenizer)

    mismatch = tmp_path / "mismatch"
    shutil.copytree(lit_checkpoint, mismatch)
    text = (mismatch / "model_config.yaml").read_text().replace("n_layer: 2", "n_layer: 3")
    (mismatch / "model_config.yaml").write_text(text)
    assert "do not match" in error(mismatch)

    assert "precision" in error(lit_checkpoint, precision="fp8")
    assert "device" in error(lit_checkpoint, device="tpu")
    if not torch.cuda.is_available():
        assert "CUDA is not available" in error(lit_checkpoint, device="cuda")


def test_main_num_samples(lit_checkpoint, capsys):
    from litgpt.generate import main

    main(lit_checkpoint, "hello", num_samples=3, max_new_tokens=6, temperature=0, device="cpu")
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 3 and all(line.startswith("hello") for line in lines)
    assert len(set(lines)) == 1  # greedy: every sample is the same
    assert err.count("tokens/s") == 3

    def sampled(seed):
        main(lit_checkpoint, "hello", num_samples=4, max_new_tokens=8, temperature=2.0, top_k=None, seed=seed,
             device="cpu")
        out, err = capsys.readouterr()
        assert err.count("tokens/s") == 4 and out.count("hello") >= 4
        return out

    first = sampled(5)
    assert sampled(5) == first  # the seed repeats the samples
    assert sampled(6) != first


def test_main_streams_the_decoded_continuation(lit_checkpoint, capsys):
    from litgpt.generate import generate as generate_tokens
    from litgpt.generate import load_model_and_tokenizer, main

    main(lit_checkpoint, "The quick brown", max_new_tokens=12, temperature=0, device="cpu")
    out = capsys.readouterr().out
    model, tokenizer = load_model_and_tokenizer(lit_checkpoint, device="cpu")
    ids = tokenizer.encode("The quick brown")
    new = list(generate_tokens(model, ids, 12, temperature=0, stop_ids=tokenizer.stop_ids))
    full = tokenizer.decode(ids.tolist() + new)
    assert out == "The quick brown" + full[len(tokenizer.decode(ids)) :] + "\n"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(quantize="bnb.nf5"), "bnb.nf5"),
        (dict(num_samples=0), "num_samples"),
        (dict(top_p=2.0), "top_p"),
        (dict(prompt="hello " * 80), "tokens long"),
    ],
)
def test_main_user_errors(lit_checkpoint, kwargs, match):
    from litgpt.generate import main

    with pytest.raises(UserError, match=match):
        main(lit_checkpoint, **{"device": "cpu", **kwargs})


# ---- greedy agreement with transformers --------------------------------------------------------------------------------
def hf_tiny_model(family: str, vocab_size: int):
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,  # logits far apart: no near-ties for greedy decoding
    )
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    with torch.no_grad():  # biases (Qwen2's q/k/v) start at zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.2)
    return model.eval()


@pytest.mark.parametrize(("family", "tokenizer_style"), [("llama", "llama"), ("qwen2", "chatml")])
def test_greedy_matches_transformers(tmp_path, family, tokenizer_style):
    from tokenizers import Tokenizer as Backend
    from transformers import GenerationConfig

    from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint
    from litgpt.generate import load_model_and_tokenizer
    from tokenizer_helpers import make_tokenizer_folder

    folder = make_tokenizer_folder(tmp_path / family, tokenizer_style)
    hf_model = hf_tiny_model(family, Backend.from_file(str(folder / "tokenizer.json")).get_vocab_size())
    hf_model.save_pretrained(folder)
    make_tokenizer_folder(folder, tokenizer_style)  # the tokenizer's generation_config.json, as in a hub repo
    convert_hf_checkpoint(folder)

    model, tokenizer = load_model_and_tokenizer(folder, precision="32-true", device="cpu")
    prompt = tokenizer.encode("The quick brown fox jumps over")
    ours = list(generate(model, prompt, 20, temperature=0))

    no_stop = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        theirs = hf_model.generate(
            prompt[None], attention_mask=torch.ones_like(prompt)[None], generation_config=no_stop
        )[0, len(prompt) :].tolist()
    assert len(theirs) == 20
    assert ours == theirs

    # With the tokenizer's stop ids the same sequence is cut at the first one.
    stop_ids = set(tokenizer.stop_ids)
    with_stops = list(generate(model, prompt, 20, temperature=0, stop_ids=stop_ids))
    cut = next((i for i, t in enumerate(theirs) if t in stop_ids), len(theirs))
    assert with_stops == theirs[:cut]


# ---- the command line ------------------------------------------------------------------------------------------------
def run_cli(*args: str, **popen_kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-m", "litgpt", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        **popen_kwargs,
    )


@pytest.fixture(scope="module", autouse=True)
def cli_processes(tmp_path_factory):
    """The CLI runs of this module, started when the module starts: each process spends seconds importing torch,
    which overlaps with the other tests."""
    checkpoint = write_lit_checkpoint(tmp_path_factory.mktemp("cli") / "tiny")
    no_weights = tmp_path_factory.mktemp("no_weights")
    processes = {
        "ok": run_cli("generate", str(checkpoint), "--prompt", "hello", "--max_new_tokens", "5", "--device", "cpu"),
        "no_weights": run_cli("generate", str(no_weights)),
        "too_long": run_cli("generate", str(checkpoint), "--prompt", "hello " * 80, "--device", "cpu"),
    }
    yield processes
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.fixture(scope="module")
def cli_runs(cli_processes):
    results = {}
    for name, process in cli_processes.items():
        out, err = process.communicate(timeout=120)
        results[name] = (process.returncode, out, err)
    return results


def test_cli_generates(cli_runs):
    code, out, err = cli_runs["ok"]
    assert code == 0, err
    assert out.startswith("hello") and len(out.strip()) > len("hello")
    assert "tokens/s" in err and "Traceback" not in err


def test_cli_missing_weights(cli_runs):
    code, out, err = cli_runs["no_weights"]
    assert code == 1
    assert "Traceback" not in err
    assert "lit_model.pth" in err and len(err.strip().splitlines()) == 1


def test_cli_prompt_too_long(cli_runs):
    code, out, err = cli_runs["too_long"]
    assert code == 1
    assert "Traceback" not in err
    assert "tokens long" in err and "64" in err


def test_generate_with_quantized_weights(lit_checkpoint, capsys):
    """--quantize bnb.nf4 loads the weights 4-bit and still generates (bitsandbytes runs nf4 on the CPU)."""
    from litgpt.generate import load_model_and_tokenizer, main

    model, _ = load_model_and_tokenizer(lit_checkpoint, device="cpu", quantize="bnb.nf4")
    qkv_weight = model.transformer.h[0].attn.qkv.weight
    assert qkv_weight.dtype == torch.uint8  # stored packed, two 4-bit values a byte
    main(lit_checkpoint, prompt="hello", max_new_tokens=5, device="cpu", quantize="bnb.nf4", temperature=0.0)
    assert capsys.readouterr().out.startswith("hello")

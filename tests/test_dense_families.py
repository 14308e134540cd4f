"""OLMo 2/3, SmolLM3 and LongRoPE (Phi-3.5, Phi-4-mini) beyond the shared conversion test (tests/test_convert.py):
LongRoPE below and above its original context, greedy generation equal to transformers' (also across LongRoPE's
switch), their config fields through model_config.yaml, and contradicting fields."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from hf_models import build_hf_model, save_hf_model

from litgpt.checkpoint.model_files import load_model_weights
from litgpt.config import LITGPT_DEFAULTS, Config
from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint
from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint
from litgpt.errors import UserError
from litgpt.generate import generate
from litgpt.io import load_state_dict
from litgpt.model import GPT

CASES = ["olmo2", "olmo3", "smollm3", "phi3_longrope", "phi4_mini"]
ORIGINAL = 16  # original_max_position_embeddings of the LongRoPE cases (tests/hf_models.py)


def load_lit(folder) -> GPT:
    model = GPT(Config.from_checkpoint(folder))
    load_model_weights(model, load_state_dict(folder / "lit_model.pth"), str(folder))
    return model.eval()


@pytest.mark.parametrize("case", ["phi3_longrope", "phi4_mini"])
@torch.no_grad()
def test_longrope_below_and_above_the_original_context(case, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = save_hf_model(case, tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf")
    lit = load_lit(tmp_path / "hf")
    convert_lit_checkpoint(tmp_path / "hf", tmp_path / "back")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    tokens = torch.randint(0, 211, (2, 40), generator=torch.Generator().manual_seed(1))
    # 8 and 16 run with the short factors, 17 and 40 with the long ones, in both libraries.
    for length in (8, ORIGINAL, ORIGINAL + 1, 40):
        ours = lit(tokens[:, :length])[..., :211]
        for reference in (hf, back):
            assert (ours - reference(tokens[:, :length]).logits).abs().max().item() <= 1e-4, length
    # The two sets differ: the first 8 positions rotate otherwise in a pass of 40 tokens than in one of 8.
    assert (lit(tokens[:, :8]) - lit(tokens)[:, :8]).abs().max().item() > 1e-3


def scaled_hf_model(case: str):
    """The tiny model with larger weights: logits far apart, so that greedy choices are no near-ties."""
    model = build_hf_model(case)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.mul_(4)
    return model


@pytest.mark.parametrize("case", CASES)
@torch.inference_mode()
def test_greedy_generation_matches_transformers(case, tmp_path):
    """The KV cache decoding of each family gives transformers' greedy tokens. The LongRoPE cases start within the
    original context (10 tokens) and generate past it (to 34): transformers then runs the sequence again with the
    long factors, and so does `generate` (litgpt.generate.longrope_restart)."""
    from transformers import GenerationConfig

    hf = scaled_hf_model(case)
    hf.save_pretrained(tmp_path)
    convert_hf_checkpoint(tmp_path)
    lit = load_lit(tmp_path)
    prompt = torch.randint(3, 211, (10,), generator=torch.Generator().manual_seed(2))
    ours = list(generate(lit, prompt, 24, temperature=0))
    settings = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    theirs = hf.generate(prompt[None], attention_mask=torch.ones(1, 10, dtype=torch.long), generation_config=settings)
    assert ours == theirs[0, 10:].tolist()


@torch.inference_mode()
def test_longrope_generation_crossing_the_original_context_reruns_the_sequence(tmp_path):
    """Decoding past the original context without running the sequence again would keep the earlier keys rotated
    with the short factors: the logits at the first position past it then differ from a full pass, which the restart
    reproduces exactly."""
    save_hf_model("phi3_longrope", tmp_path)
    convert_hf_checkpoint(tmp_path)
    lit = load_lit(tmp_path)
    tokens = torch.randint(0, 211, (1, ORIGINAL + 1), generator=torch.Generator().manual_seed(3))
    full = lit(tokens)[0, -1]  # one pass of 17 tokens: long factors everywhere
    lit.set_kv_cache(batch_size=1, max_seq_length=32)
    lit(tokens[:, :ORIGINAL], input_pos=torch.arange(ORIGINAL))  # short factors in the cache
    stale = lit(tokens[:, ORIGINAL:], input_pos=torch.tensor([ORIGINAL]))[0, -1]
    assert (stale - full).abs().max().item() > 1e-3
    rerun = lit(tokens, input_pos=torch.arange(ORIGINAL + 1))[0, -1]
    assert (rerun - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", CASES)
def test_fields_survive_model_config_yaml(case, tmp_path):
    save_hf_model(case, tmp_path)
    convert_hf_checkpoint(tmp_path)
    config = Config.from_checkpoint(tmp_path)
    written = yaml.safe_load((tmp_path / "model_config.yaml").read_text())
    assert set(written) == set(LITGPT_DEFAULTS)  # LitGPT 0.5.13's keys only
    assert Config.from_file(tmp_path / "model_config.yaml") == config
    expected = {
        "olmo2": dict(norm_1=False, norm_2=False, norm_qk_type="olmo2", post_attention_norm=True, post_mlp_norm=True),
        "olmo3": dict(norm_qk_type="olmo2", sliding_window_size=5, sliding_window_pattern=4, rope_local_base=50000.0),
        "smollm3": dict(no_rope_layers=[1, 1, 1, 0], tie_embeddings=True),
        "phi3_longrope": dict(rotary_percentage=1.0),
        "phi4_mini": dict(rotary_percentage=0.75, tie_embeddings=True),
    }[case]
    assert {key: getattr(config, key) for key in expected} == expected


def test_litgpt_olmo2_model_config_loads(tmp_path):
    """LitGPT 0.5.13 writes OLMo 2 with the same field names: norm_1/norm_2 False and norm_qk_type 'olmo2'."""
    values = dict(LITGPT_DEFAULTS, name="OLMo-2-1124-7B", hf_config={"org": "allenai", "name": "OLMo-2-1124-7B"},
                  n_layer=2, n_embd=64, n_head=4, vocab_size=100, padded_vocab_size=100, norm_class_name="RMSNorm",
                  norm_qk=True, norm_qk_type="olmo2", norm_1=False, norm_2=False, post_attention_norm=True,
                  post_mlp_norm=True, parallel_residual=False, bias=False, mlp_class_name="LLaMAMLP",
                  intermediate_size=96, rotary_percentage=1.0, rope_base=500000)
    (tmp_path / "model_config.yaml").write_text(yaml.safe_dump(values))
    config = Config.from_file(tmp_path / "model_config.yaml")
    assert config.hf_model_type == "olmo2" and config.norm_qk_type == "olmo2" and not config.norm_1
    model = GPT(config)
    assert model.transformer.h[0].attn.norm_q.weight.shape == (64,)  # all 4 heads of 16 together
    assert model.transformer.h[0].attn.norm_k.weight.shape == (64,)
    assert isinstance(model.transformer.h[0].norm_1, torch.nn.Identity)


# ---- contradicting fields ----------------------------------------------------------------------------------------------
def longrope(n_short: int, n_long: int) -> dict:
    return {"type": "longrope", "short_factor": [1.0] * n_short, "long_factor": [2.0] * n_long,
            "original_max_position_embeddings": 16}


TINY = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=100)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(rope_scaling=longrope(7, 8)), r"short_factor must list rope_n_elem / 2 = 8 factors.*got 7 values"),
        (dict(rope_scaling=longrope(6, 8), rotary_percentage=0.75), r"long_factor must list rope_n_elem / 2 = 6"),
        (dict(rope_scaling={**longrope(8, 8), "original_max_position_embeddings": 0}), "original_max_position_emb"),
        (dict(no_rope_layers=[1, 1, 0]), r"no_rope_layers must give .* n_layer=4 layers, got \[1, 1, 0\]"),
        (dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers"),
        (dict(norm_qk_type="olmo2"), "norm_qk_type='olmo2'.*norm_qk=True"),
        (dict(norm_qk=True, norm_qk_type="whole"), "norm_qk_type must be"),
    ],
)
def test_contradicting_fields_are_one_line_errors(fields, match):
    with pytest.raises(UserError, match=match) as error:
        Config(**TINY, **fields)
    assert "\n" not in str(error.value)


def test_config_json_with_wrong_longrope_lengths(tmp_path):
    save_hf_model("phi4_mini", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    scaling = config.get("rope_parameters") or config["rope_scaling"]
    scaling["long_factor"] = scaling["long_factor"][:-1]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="long_factor must list rope_n_elem / 2 = 6 factors"):
        convert_hf_checkpoint(tmp_path)
    assert not (tmp_path / "lit_model.pth").exists()


# ---- the commands at tiny scale -----------------------------------------------------------------------------------------
TINY_SHAPE = dict(n_layer=4, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=96, vocab_size=4096,
                  padded_vocab_size=4096, block_size=128)
# The named configs at tiny scale; Phi-4-mini's LongRoPE over 3/4 of 16-wide heads (6 factors), switching past 32.
TINY_NAMED = {
    "OLMo-2-0425-1B": {},
    "SmolLM3-3B": {},
    "Phi-4-mini-instruct": dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 6, original_max_position_embeddings=32,
                                                  long_factor=[1.0 + 2 * i for i in range(6)])),
}


def tiny_named(name: str) -> Config:
    return Config.from_name(name, **TINY_SHAPE, **TINY_NAMED[name])


@pytest.mark.parametrize("name", list(TINY_NAMED))
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_plan_counts_what_autograd_saves(name, tuning):
    """`litgpt plan` runs the real model: its saved activations per block equal autograd's (sequence of 64: past
    the tiny Phi-4-mini's original context, so its long factors run)."""
    from test_plan import TUNINGS, autograd_saved_bytes, planned_saved

    config, lora = tiny_named(name), TUNINGS[tuning]
    measured_layers, measured_root = autograd_saved_bytes(config, "32-true", lora, "cpu")
    planned = planned_saved(config, "32-true", "cpu", lora)
    assert planned.per_layer == measured_layers and planned.root == measured_root


@pytest.mark.parametrize("name", list(TINY_NAMED))
def test_plan_command_on_the_published_sizes(name, capsys):
    from litgpt.__main__ import main as cli_main

    seq_length = min(8192, Config.from_name(name).block_size)  # past Phi-4-mini's original 4096
    cli_main(["plan", name, "--method", "lora", "--train.max_seq_length", str(seq_length), "--json", "true"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"], plan


@pytest.fixture(scope="module")
def instructions(tmp_path_factory):
    from litgpt.data.tiny import TINY_DIR

    path = tmp_path_factory.mktemp("sft") / "data.json"
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:12]
    path.write_text(json.dumps([{"instruction": "Tell a story.", "output": s[:300]} for s in stories]))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TINY_NAMED))
def test_finetune_lora_merge_generate_and_convert(name, tmp_path, instructions):
    """finetune_lora (which merges into final/), the merged weights equal base + adapters, `litgpt generate` with the
    KV cache past the original context, and the merged checkpoint through transformers."""
    from checkpoint_helpers import write_random_checkpoint
    from transformers import AutoModelForCausalLM

    from litgpt.__main__ import main as cli_main
    from litgpt.lora import LoRASettings, add_lora, load_base_weights, load_lora_weights

    base = write_random_checkpoint(tmp_path / "base", tiny_named(name))
    out = tmp_path / "run"
    cli_main(["finetune_lora", str(base), "--out_dir", str(out), "--data", "JSON", "--data.json_path",
              str(instructions), "--data.val_split_fraction", "0.2", "--train.global_batch_size", "2",
              "--train.micro_batch_size", "1", "--train.max_seq_length", "128", "--train.max_steps", "2",
              "--train.log_interval", "1", "--eval.max_iters", "1", "--eval.max_new_tokens", "4", "--lora_mlp", "true"])
    final = out / "final"
    merged = load_lit(final)
    settings = LoRASettings.from_hparams(yaml.safe_load((final / "hyperparameters.yaml").read_text()))
    adapted = GPT(Config.from_checkpoint(base))
    add_lora(adapted, settings)
    load_base_weights(adapted, load_state_dict(base / "lit_model.pth"), "base")
    load_lora_weights(adapted, load_state_dict(final / "lit_model.pth.lora"), "adapters")
    tokens = torch.randint(0, 4096, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (merged(tokens) - adapted.eval()(tokens)).abs().max().item() < 1e-4

    cli_main(["generate", str(final), "--prompt", "Once upon a time", "--max_new_tokens", "40", "--temperature", "0",
              "--device", "cpu"])
    cli_main(["convert_from_litgpt", str(final), str(tmp_path / "hf")])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (merged(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


@torch.inference_mode()
def test_serving_engine_crosses_the_longrope_switch_as_generate_does(tmp_path):
    """`litgpt serve`'s batching engine: requests in one batch, one crossing the original context of 16 and one
    starting past it, each get `generate`'s tokens alone (which equal transformers', tested above)."""
    from serving_helpers import run_engine

    hf = scaled_hf_model("phi4_mini")
    hf.save_pretrained(tmp_path)
    convert_hf_checkpoint(tmp_path)
    lit = load_lit(tmp_path)
    prompts = [[5, 9, 14, 3, 77, 120], list(range(30, 50)), [8, 8, 9]]
    alone = [list(generate(lit, p, 20, temperature=0)) for p in prompts]
    lit.clear_kv_cache()
    assert run_engine(lit, prompts, 20, max_batch_size=3, prefill_tokens=8)[0] == alone


@torch.inference_mode()
def test_per_row_positions_pick_longrope_factors_per_row(tmp_path):
    """With per-row positions (the serving engine's batch), a row within the original context keeps the short
    factors while another row of the same pass is past it: each row's logits equal its run alone (its prefix in
    one pass, then the same four positions)."""
    save_hf_model("phi4_mini", tmp_path)
    convert_hf_checkpoint(tmp_path)
    lit = load_lit(tmp_path)
    tokens = torch.randint(0, 211, (2, 18), generator=torch.Generator().manual_seed(5))
    lit.set_kv_cache(batch_size=2, max_seq_length=32)
    lit(tokens[:, :14], input_pos=torch.arange(14).expand(2, 14))  # both rows within the original 16: short
    positions = torch.tensor([[10, 11, 12, 13], [14, 15, 16, 17]])  # row 1 reaches past 16, row 0 does not
    both = lit(torch.stack([tokens[0, 10:14], tokens[1, 14:18]]), input_pos=positions)
    for row in range(2):
        start = positions[row, 0].item()
        lit.set_kv_cache(batch_size=1, max_seq_length=32)
        lit(tokens[row : row + 1, :start], input_pos=torch.arange(start))
        alone = lit(tokens[row : row + 1, start : start + 4], input_pos=positions[row])[0]
        assert (both[row] - alone).abs().max().item() <= 1e-5, row


@torch.inference_mode()
def test_evaluation_greedy_decoding_crosses_the_longrope_switch_as_generate_does(tmp_path):
    """lm-evaluation-harness' generate_until (`greedy_until`): prompts of one length decoded together past the
    original context give `generate`'s tokens for each prompt alone."""
    from litgpt.evaluation.harness import greedy_until

    class Ids:  # a "tokenizer" whose text is the token ids, so that the continuations compare exactly
        @staticmethod
        def decode(ids):
            return " ".join(map(str, ids))

    hf = scaled_hf_model("phi4_mini")
    hf.save_pretrained(tmp_path)
    convert_hf_checkpoint(tmp_path)
    lit = load_lit(tmp_path)
    prompts = [[5, 9, 14, 3, 77, 120], [8, 8, 9, 100, 4, 61]]
    alone = [Ids.decode(generate(lit, p, 20, temperature=0)) for p in prompts]
    lit.clear_kv_cache()
    assert greedy_until(lit, Ids, prompts, [[], []], 20, stop_id=None) == alone


YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1)
OLMO = dict(hf_model_type="olmo3", norm_1=False, norm_2=False, post_attention_norm=True, post_mlp_norm=True,
            norm_qk=True, norm_qk_type="olmo2")
LIT_TO_HF = {
    "olmo3_no_window": Config(**TINY, **OLMO),
    # Scaled rotary in every layer, the sliding ones included (rope_local_base None).
    "olmo3_scaled_everywhere": Config(**TINY, **OLMO, sliding_window_size=6, sliding_window_pattern=2,
                                      rope_scaling=YARN, block_size=128),
    "smollm3_any_layers": Config(**TINY, hf_model_type="smollm3", no_rope_layers=[0, 1, 1, 0], tie_embeddings=True),
}
COMPARED = ("rope_scaling", "rope_local_base", "sliding_window_size", "sliding_window_pattern", "no_rope_layers")


@pytest.mark.parametrize("case", list(LIT_TO_HF))
@torch.no_grad()
def test_litgpt_configs_transformers_reads_alike(case, tmp_path):
    """litgpt -> Hugging Face for layouts the tiny transformers cases do not start from: the written config.json
    makes transformers compute our logits, and reads back as the same Config."""
    from checkpoint_helpers import write_random_checkpoint
    from transformers import AutoModelForCausalLM

    from litgpt.io import save_state_dict

    config = LIT_TO_HF[case]
    folder = write_random_checkpoint(tmp_path / "lit", config)
    lit = load_lit(folder)
    generator = torch.Generator().manual_seed(6)
    for name, param in lit.named_parameters():  # norms away from 1, so that a misplaced one shows
        if "norm" in name:
            param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    save_state_dict(lit.state_dict(), folder / "lit_model.pth")
    convert_lit_checkpoint(folder, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 100, (2, 19), generator=torch.Generator().manual_seed(7))
    assert (lit(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4
    convert_hf_checkpoint(tmp_path / "hf")
    back = Config.from_checkpoint(tmp_path / "hf")
    assert {f: getattr(back, f) for f in COMPARED} == {f: getattr(config, f) for f in COMPARED}


@pytest.mark.slow
def test_litgpt_runs_our_olmo2_folder_alike(tmp_path):
    """LitGPT 0.5.13 names OLMo 2's fields as we do (norm_1/norm_2, norm_qk_type): our converted folder greedy-decodes
    to the same tokens in LitGPT's own model."""
    from litgpt_reference import READ_FOLDERS, run_litgpt

    save_hf_model("olmo2", tmp_path)
    convert_hf_checkpoint(tmp_path)
    prompt = [1, 17, 100, 42]
    ours = list(generate(load_lit(tmp_path), prompt, 12, temperature=0))
    job = dict(folder=str(tmp_path), prompt=prompt, max_new_tokens=12, no_tokenizer=True)
    (theirs,) = run_litgpt(READ_FOLDERS, [job])
    assert ours == theirs["no_cache_tokens"] == theirs["tokens"]

"""Checkpoint folders written by LitGPT 0.5.13 work here, and ours work in LitGPT: same greedy tokens both ways.

The reference is LitGPT's own code (tests/litgpt_reference.py), run in a subprocess.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

# Our `python -m litgpt`: each a process of its own, forked from one that imported torch and Lightning once.
from litgpt_forkserver import run_litgpt as litgpt_process
from litgpt_reference import CONFIG_FIELDS, READ_FOLDERS, WRITE_FOLDERS, run_litgpt, run_litgpt_cli

from litgpt.config import EXTRA_KEY, LITGPT_DEFAULTS, Config
from litgpt.data.tiny import TOKENIZER_DIR
from litgpt.errors import UserError

# Each test runs LitGPT 0.5.13's own code in a subprocess (or a command of ours): the whole suite (-m '', CI) runs
# them, the quick default run leaves them out.
pytestmark = pytest.mark.slow

PROMPT = [1, 306, 465, 278, 3186, 2988, 450, 499]
NEW_TOKENS = 12
_BASE = dict(block_size=128, n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=4096,
             padded_vocab_size=4096, norm_class_name="RMSNorm", bias=False, parallel_residual=False,
             rotary_percentage=1.0, mlp_class_name="LLaMAMLP", intermediate_size=48)
# Tiny models in LitGPT's own config fields, one per family whose fields differ.
LITGPT_CASES = {
    "llama3": dict(_BASE, name="Llama-3-tiny", hf_config={"org": "meta-llama", "name": "Llama-3-tiny"},
                   rope_base=500000, rope_adjustments=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                           original_max_seq_len=16)),
    "qwen3": dict(_BASE, name="tiny-qwen3", head_size=16, norm_qk=True, norm_eps=1e-6, rope_base=1000000),
    "gemma2": dict(_BASE, name="Gemma-2-tiny", mlp_class_name="GemmaMLP", gelu_approximate="tanh", head_size=16,
                   post_attention_norm=True, post_mlp_norm=True, scale_embeddings=True, attention_scores_scalar=24,
                   attention_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window_size=10,
                   sliding_window_indices=[1, 0]),
    "mixtral": dict(_BASE, name="Mixtral-tiny", mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2,
                    moe_intermediate_size=16, sliding_window_size=None),
    "neox": dict(_BASE, name="pythia-tiny", norm_class_name="LayerNorm", bias=True, parallel_residual=True,
                 rotary_percentage=0.25, mlp_class_name="GptNeoxMLP", intermediate_size=None),
    "falcon": dict(_BASE, name="falcon-tiny", norm_class_name="LayerNorm", parallel_residual=True,
                   shared_attention_norm=True, n_query_groups=1, mlp_class_name="GptNeoxMLP"),
    "phi": dict(_BASE, name="phi-tiny", norm_class_name="LayerNorm", bias=True, parallel_residual=True,
                shared_attention_norm=True, lm_head_bias=True, rotary_percentage=0.5, mlp_class_name="GptNeoxMLP",
                gelu_approximate="tanh", n_query_groups=4),
    "stablelm": dict(_BASE, name="stablelm-tiny", norm_class_name="LayerNorm", rotary_percentage=0.25),
    "olmo": dict(_BASE, name="OLMo-tiny", norm_class_name="LayerNorm"),
}
# LitGPT's full finetuning saves {"model": ...} and writes prompt_style.yaml; its converter saves the state dict.
SAVED_AS = {"llama3": dict(wrapped=True, prompt_style="alpaca"), "qwen3": {}, "gemma2": dict(wrapped=True),
            "mixtral": {}, "neox": {}, "falcon": {}, "phi": {}, "stablelm": {}, "olmo": {}}
LITGPT_HPARAMS = {"checkpoint_dir": "checkpoints/meta-llama/Llama-3.2-1B", "out_dir": "out/finetune/full",
                  "precision": "bf16-true",
                  "data": {"class_path": "litgpt.data.Alpaca2k", "init_args": {"num_workers": 4}},
                  "train": {"save_interval": 800, "global_batch_size": 64, "epochs": 1}, "logger_name": "csv"}


@pytest.fixture(scope="module")
def litgpt_folders(tmp_path_factory) -> dict:
    """{case: (folder, LitGPT's greedy decodes)} for folders that LitGPT 0.5.13 wrote."""
    root = tmp_path_factory.mktemp("litgpt_written")
    jobs = [
        dict(folder=str(root / case), config=config, prompt=PROMPT, max_new_tokens=NEW_TOKENS,
             tokenizer_dir=str(TOKENIZER_DIR), hyperparameters=LITGPT_HPARAMS, **SAVED_AS[case])
        for case, config in LITGPT_CASES.items()
    ]
    # The llama3 model again (same seed), decoding a text prompt for the command-line test.
    jobs.append({**jobs[0], "folder": str(root / "llama3_text"), "prompt": text_prompt_ids(), "max_new_tokens": 8})
    found = run_litgpt(WRITE_FOLDERS, jobs)
    cases = [*LITGPT_CASES, "llama3_text"]
    return {case: (Path(job["folder"]), result) for case, job, result in zip(cases, jobs, found)}


TEXT_PROMPT = "The quick brown fox"


def text_prompt_ids() -> list[int]:
    from litgpt.tokenizer import Tokenizer

    return [int(t) for t in Tokenizer(TOKENIZER_DIR).encode(TEXT_PROMPT)]


def our_greedy(folder: Path, prompt=PROMPT, new_tokens: int = NEW_TOKENS) -> list[int]:
    from litgpt.generate import generate, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(folder, precision="32-true", device="cpu")
    return [int(t) for t in generate(model, prompt, new_tokens, temperature=0.0, top_k=None, top_p=1.0)]


@pytest.mark.parametrize("case", list(LITGPT_CASES))
def test_litgpt_folder_generates_litgpt_tokens(litgpt_folders, case):
    folder, litgpt = litgpt_folders[case]
    ours = our_greedy(folder)
    assert len(ours) == NEW_TOKENS and ours == litgpt["no_cache_tokens"]
    if LITGPT_CASES[case].get("attention_logit_softcapping") is None:
        assert ours == litgpt["tokens"]
    # else LitGPT 0.5.13's KV-cache path adds its boolean mask to the soft-capped scores instead of masking them, so
    # its `generate` departs from its own model's forward pass; ours follows the forward pass.


def test_litgpt_folder_fields_map_to_ours(litgpt_folders):
    """Every LitGPT field reads as the field of ours that computes the same thing."""
    llama = Config.from_checkpoint(litgpt_folders["llama3"][0])
    assert llama.rope_scaling == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16}
    assert llama.prompt_style == "alpaca"  # LitGPT's prompt_style.yaml
    gemma = Config.from_checkpoint(litgpt_folders["gemma2"][0])
    assert gemma.norm_unit_offset and gemma.sliding_window_pattern == 2 and gemma.hf_model_type == "gemma2"
    mixtral = Config.from_checkpoint(litgpt_folders["mixtral"][0])
    assert mixtral.hf_model_type == "mixtral" and mixtral.moe_renormalize  # LitGPT: softmax over the top-k logits
    neox = Config.from_checkpoint(litgpt_folders["neox"][0])
    assert neox.parallel_residual and neox.rope_n_elem == 2 and neox.hf_model_type == "gpt_neox"
    older = {case: Config.from_checkpoint(litgpt_folders[case][0]) for case in ("falcon", "phi", "stablelm", "olmo")}
    assert {case: c.hf_model_type for case, c in older.items()} == {case: case for case in older}
    assert not older["olmo"].norm_affine and older["stablelm"].norm_affine


@pytest.mark.parametrize("case", ["llama3", "qwen3", "gemma2", "mixtral", "falcon", "phi", "stablelm", "olmo"])
def test_convert_from_litgpt_on_a_litgpt_folder(litgpt_folders, case, tmp_path):
    """LitGPT's folder converts to a Hugging Face model that continues the prompt as LitGPT's model does."""
    from transformers import AutoModelForCausalLM

    from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint

    folder, litgpt = litgpt_folders[case]
    convert_lit_checkpoint(folder, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat((ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert ids[0, len(PROMPT):].tolist() == litgpt["no_cache_tokens"]


def test_generate_command_on_a_litgpt_folder(litgpt_folders):
    """`litgpt generate` itself loads LitGPT's training output ({"model": ...}, prompt_style.yaml, its
    hyperparameters.yaml) and prints the greedy continuation LitGPT decodes."""
    from litgpt.tokenizer import Tokenizer

    folder, reference = litgpt_folders["llama3_text"][0], litgpt_folders["llama3_text"][1]["tokens"]
    tokenizer = Tokenizer(folder)
    prompt, prompt_ids = TEXT_PROMPT, text_prompt_ids()
    assert our_greedy(folder, prompt_ids, 8) == reference
    without_bos = prompt_ids[1:] if prompt_ids[0] == tokenizer.bos_id else prompt_ids
    expected = tokenizer.decode(torch.tensor(without_bos + reference))
    result = litgpt_process(["generate", str(folder), "--prompt", prompt, "--max_new_tokens", "8", "--temperature", "0",
                             "--device", "cpu", "--precision", "32-true"], cwd=os.getcwd())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_chat_command_on_a_litgpt_folder(litgpt_folders):
    """`litgpt chat` on LitGPT's folder replies in the style of its prompt_style.yaml (Alpaca): the greedy reply is
    LitGPT's greedy continuation of the message laid out in alpaca."""
    from litgpt.prompts import PromptStyle
    from litgpt.tokenizer import Tokenizer

    folder = litgpt_folders["llama3"][0]
    tokenizer = Tokenizer(folder)
    prompt_ids = [int(t) for t in tokenizer.encode(PromptStyle.from_name("alpaca").apply("Hello there"))]
    result = litgpt_process(["chat", str(folder), "--max_new_tokens", "6", "--temperature", "0", "--device", "cpu",
                             "--precision", "32-true"], cwd=os.getcwd(), input="Hello there\n")
    assert result.returncode == 0, result.stderr
    reply = tokenizer.decode(torch.tensor(our_greedy(folder, prompt_ids, 6)), skip_special_tokens=True)
    assert reply.strip() and reply.strip() in result.stdout


def test_litgpt_config_fields_are_known():
    """Our table of LitGPT's fields is LitGPT 0.5.13's Config, field for field and default for default."""
    fields = run_litgpt(CONFIG_FIELDS, None)
    assert fields == {**LITGPT_DEFAULTS, "hf_config": {}}


# ---- our folders in LitGPT -------------------------------------------------------------------------------------------
# Converted from tiny Hugging Face models: Llama, and families whose fields LitGPT spells differently (Gemma 2: the
# sliding-window layers, the unit-offset norms that LitGPT derives from the name; Qwen 3: QK norms, tied head;
# Llama 3 scaled rotary frequencies; Falcon and phi: parallel attention and MLP). The prompt fits in Gemma 2's window:
# LitGPT's cache refuses a longer prefill.
OUR_CASES = ("llama", "llama3_rope", "qwen3", "gemma2", "falcon_mqa", "falcon_gqa", "phi")
SHORT_PROMPT = [1, 17, 100, 42]


@pytest.fixture(scope="module")
def our_folders(tmp_path_factory) -> dict:
    """{case: (folder, LitGPT's greedy decodes and prompt style on it)} for folders `convert_to_litgpt` wrote."""
    from hf_models import save_hf_model

    from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint

    root = tmp_path_factory.mktemp("ours")
    for case in OUR_CASES:
        save_hf_model(case, root / case)
        convert_hf_checkpoint(root / case)
    jobs = [dict(folder=str(root / case), prompt=SHORT_PROMPT, max_new_tokens=NEW_TOKENS, no_tokenizer=True)
            for case in OUR_CASES]
    return {case: (root / case, found) for case, found in zip(OUR_CASES, run_litgpt(READ_FOLDERS, jobs))}


def our_greedy_without_tokenizer(folder: Path, prompt: list[int]) -> list[int]:
    from litgpt.checkpoint.model_files import load_model_weights, read_model_weights
    from litgpt.generate import generate
    from litgpt.model import GPT

    model = GPT(Config.from_checkpoint(folder)).eval()
    load_model_weights(model, read_model_weights(folder / "lit_model.pth"), str(folder))
    return [int(t) for t in generate(model, prompt, NEW_TOKENS, temperature=0.0, top_k=None, top_p=1.0)]


@pytest.mark.parametrize("case", OUR_CASES)
def test_our_folder_generates_the_same_tokens_in_litgpt(our_folders, case):
    folder, litgpt = our_folders[case]
    ours = our_greedy_without_tokenizer(folder, SHORT_PROMPT)
    assert len(ours) == NEW_TOKENS and ours == litgpt["no_cache_tokens"]
    if case != "gemma2":  # LitGPT's KV cache and soft-capping: see test_litgpt_folder_generates_litgpt_tokens
        assert ours == litgpt["tokens"]


def test_litgpt_generate_command_on_our_training_output(tmp_path):
    """LitGPT's own `litgpt generate` (which refused our model_config.yaml's hf_model_type before) runs on a folder
    as our runs write it, lays the prompt out in the style we recorded and continues it with our greedy tokens."""
    from checkpoint_helpers import write_random_checkpoint

    from litgpt.prompts import PromptStyle
    from litgpt.tokenizer import Tokenizer

    config = Config(name="tiny", block_size=128, vocab_size=4096, padded_vocab_size=4096, n_layer=2, n_embd=32,
                    n_head=4, n_query_groups=2, intermediate_size=48, prompt_style="alpaca")
    folder = write_random_checkpoint(tmp_path / "final", config)
    result = run_litgpt_cli("generate", folder, "--prompt", "Once upon a time", "--max_new_tokens", "8",
                            "--temperature", "0", "--precision", "32-true")
    assert result.returncode == 0, result.stderr[-3000:]
    tokenizer = Tokenizer(folder)
    prompt_ids = [int(t) for t in tokenizer.encode(PromptStyle.from_name("alpaca").apply("Once upon a time"))]
    ours = tokenizer.decode(torch.tensor(our_greedy(folder, prompt_ids, 8)), skip_special_tokens=True)
    assert "### Response:" in result.stdout and ours.strip() and ours.strip() in result.stdout


def test_our_folder_keeps_our_fields_where_litgpt_does_not_look(our_folders):
    folder = our_folders["qwen3"][0]
    written = yaml.safe_load((folder / "model_config.yaml").read_text())
    assert set(written) == set(LITGPT_DEFAULTS)
    config = Config.from_checkpoint(folder)
    assert config.hf_model_type == "qwen3" and config.tie_embeddings and EXTRA_KEY not in config.hf_config
    state = torch.load(folder / "lit_model.pth", weights_only=True)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # LitGPT's head is never tied


def test_every_registered_config_survives_litgpt_fields():
    from litgpt.config import fields_to_litgpt
    from litgpt.configs import configs_by_name

    for name, values in configs_by_name().items():
        config = Config(**values)
        written = yaml.safe_load(yaml.safe_dump(fields_to_litgpt(config)))
        assert set(written) == set(LITGPT_DEFAULTS) and Config.from_dict(written, source=name) == config, name


def test_our_older_folders_still_read(tmp_path):
    """Folders written before model_config.yaml took LitGPT's fields (our field names, hf_model_type, ...)."""
    config = Config.from_name("gemma-2-2b", n_layer=2)
    (tmp_path / "model_config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    assert Config.from_checkpoint(tmp_path) == config


def test_prompt_style_round_trip(tmp_path):
    """Our style is written as LitGPT's prompt_style.yaml (LitGPT's chat uses it); a style LitGPT lacks is not."""
    config = Config(n_layer=1, n_embd=32, n_head=4, intermediate_size=48, prompt_style="chatml")
    config.save(tmp_path / "model_config.yaml")
    assert yaml.safe_load((tmp_path / "prompt_style.yaml").read_text()) == {"class_path": "litgpt.prompts.ChatML"}
    assert Config.from_checkpoint(tmp_path).prompt_style == "chatml"
    Config(n_layer=1, n_embd=32, n_head=4, intermediate_size=48, prompt_style="mistral").save(
        tmp_path / "model_config.yaml")
    assert not (tmp_path / "prompt_style.yaml").exists()
    assert Config.from_checkpoint(tmp_path).prompt_style == "mistral"
    (tmp_path / "prompt_style.yaml").write_text("class_path: litgpt.prompts.Longform\n")
    with pytest.raises(UserError, match="Longform"):
        Config.from_checkpoint(tmp_path)
    # The classes LitGPT writes for the models of its name list read as our style of the same layout.
    for litgpt_class, ours in (("Qwen2_5", "qwen2.5"), ("Qwen3", "chatml"), ("R1Base", "deepseek-r1"),
                               ("CodeLlama", "llama2"), ("Falcon3", "falcon3"), ("Platypus", "platypus")):
        (tmp_path / "prompt_style.yaml").write_text(f"class_path: litgpt.prompts.{litgpt_class}\n")
        assert Config.from_checkpoint(tmp_path).prompt_style == ours


# ---- bad input -------------------------------------------------------------------------------------------------------
def _write_litgpt_config(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    values = {**LITGPT_DEFAULTS, **LITGPT_CASES["llama3"], **changes}
    (folder / "model_config.yaml").write_text(yaml.safe_dump(values))
    return folder


@pytest.mark.parametrize("changes, named", [
    (dict(rope_interleave=True), "rope_interleave=True"),
    (dict(latent_attention={"q_lora_rank": 8}), "latent_attention="),
    (dict(n_shared_expert=1), "n_shared_expert=1"),
    (dict(sliding_window_size=4, sliding_window_indices=[0, 1]), "sliding_window_indices=[0, 1]"),
    (dict(rope_adjustments=dict(factor=4.0, beta_fast=32, beta_slow=1, original_max_seq_len=16)), "YaRN"),
    (dict(something_new=1), "something_new"),
])
def test_litgpt_architecture_we_cannot_run_is_named(tmp_path, changes, named):
    folder = _write_litgpt_config(tmp_path / "bad", **changes)
    with pytest.raises(UserError, match="model_config.yaml") as error:
        Config.from_checkpoint(folder)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_litgpt_folder_whose_weights_do_not_match_its_config(litgpt_folders, tmp_path):
    folder = tmp_path / "mismatch"
    folder.mkdir()
    source = litgpt_folders["qwen3"][0]
    for file in source.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    values = yaml.safe_load((folder / "model_config.yaml").read_text())
    (folder / "model_config.yaml").write_text(yaml.safe_dump({**values, "n_embd": 64}))
    result = litgpt_process(["generate", str(folder), "--device", "cpu"], cwd=os.getcwd())
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "do not match the model config" in result.stderr
    assert (folder / "lit_model.pth").read_bytes() == (source / "lit_model.pth").read_bytes()


# ---- defaults a LitGPT user expects ----------------------------------------------------------------------------------
RECORDS = [{"instruction": f"Name the color number {i}.", "output": f"The answer is color{i}."} for i in range(10)]


def _connected_json(tmp_path, config: Config):
    import json

    from litgpt.data import JSON
    from litgpt.prompts import PromptStyle
    from litgpt.tokenizer import Tokenizer

    (tmp_path / "data.json").write_text(json.dumps(RECORDS))
    data = JSON(json_path=tmp_path / "data.json", val_split_fraction=0.2)
    tokenizer = Tokenizer(TOKENIZER_DIR)
    data.connect(tokenizer, 128, PromptStyle.for_finetuning(config))
    data.prepare()
    return data, tokenizer


def test_instruction_data_on_a_base_model_defaults_to_alpaca(tmp_path):
    data, tokenizer = _connected_json(tmp_path, Config(n_layer=1, n_embd=32, n_head=4, intermediate_size=48))
    assert data.style.name == "alpaca"
    text = tokenizer.decode(data.train_dataset()[0]["input_ids"], skip_special_tokens=True)
    assert "### Instruction:\nName the color number" in text and "### Response:\nThe answer is" in text


def test_instruction_data_on_a_chat_model_keeps_its_style(tmp_path):
    data, _ = _connected_json(tmp_path, Config(n_layer=1, n_embd=32, n_head=4, intermediate_size=48,
                                               prompt_style="llama3"))
    assert data.style.name == "llama3"


def test_validation_sample_prompt_stops_where_the_answer_begins(tmp_path):
    from litgpt.train.trainer import sample_prompt

    data, tokenizer = _connected_json(tmp_path, Config(n_layer=1, n_embd=32, n_head=4, intermediate_size=48))
    sample = data.val_dataset()[0]
    prompt = tokenizer.decode(sample_prompt(sample["input_ids"], sample["labels"]), skip_special_tokens=True)
    assert prompt.endswith("### Response:\n") and "The answer is" not in prompt
    # Unmasked text (pretraining): a prefix, leaving half of the sample to continue.
    ids = torch.arange(10)
    assert torch.equal(sample_prompt(ids, ids + 1), ids[:5])
    assert torch.equal(sample_prompt(torch.arange(40), torch.arange(40)), torch.arange(16))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["finetune_lora", "finetune_full"])
def test_finetune_on_a_litgpt_folder_then_litgpt_reads_final(litgpt_folders, tmp_path, command):
    """One finetuning step on LitGPT's folder (a base model: no prompt_style.yaml): the data is laid out in alpaca, the
    printed sample's prompt stops before the reference answer, and LitGPT's code loads final/ with our tokens."""
    import json

    (tmp_path / "data.json").write_text(json.dumps(RECORDS))
    out = tmp_path / "out"
    result = litgpt_process(
        [command, str(litgpt_folders["qwen3"][0]), "--out_dir", str(out),
         "--data", "JSON", "--data.json_path", str(tmp_path / "data.json"), "--data.val_split_fraction", "0.2",
         "--train.global_batch_size", "1", "--train.micro_batch_size", "1", "--train.max_steps", "1",
         "--eval.max_iters", "1", "--eval.max_new_tokens", "4", "--precision", "32-true"],
        cwd=os.getcwd(), timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    prompt_line = next(line for line in lines if line.startswith("sample prompt: "))
    assert "### Instruction:" in prompt_line and prompt_line.endswith("### Response:\\n'")
    assert "The answer is" not in prompt_line
    assert any(line.startswith("sample: ") for line in lines)
    final = out / "final"
    assert Config.from_checkpoint(final).prompt_style == "alpaca"
    litgpt = run_litgpt(READ_FOLDERS, [dict(folder=str(final), prompt=PROMPT, max_new_tokens=NEW_TOKENS)])[0]
    assert litgpt["prompt_style"] == "Alpaca" and our_greedy(final) == litgpt["tokens"]


@pytest.mark.slow
def test_pretrain_from_a_litgpt_folder(litgpt_folders, tmp_path):
    """`pretrain --initial_checkpoint_dir` on LitGPT's training output ({"model": ...}) starts from its weights:
    one step at a tiny learning rate leaves every weight within 1e-4 of LitGPT's."""
    folder = litgpt_folders["gemma2"][0]
    out = tmp_path / "out"
    result = litgpt_process(
        ["pretrain", "--initial_checkpoint_dir", str(folder), "--out_dir", str(out),
         "--data", "Tiny", "--data.cache_dir", str(tmp_path / "cache"), "--train.max_steps", "1",
         "--train.global_batch_size", "1", "--train.micro_batch_size", "1", "--train.max_seq_length", "16",
         "--eval.max_iters", "1", "--eval.max_new_tokens", "0", "--precision", "32-true", "--optimizer.lr", "1e-6"],
        cwd=os.getcwd(), timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert Config.from_checkpoint(out / "final") == Config.from_checkpoint(folder)
    initial = torch.load(folder / "lit_model.pth", weights_only=True)["model"]
    final = torch.load(out / "final" / "lit_model.pth", weights_only=True)
    assert set(final) == set(initial)
    assert max((final[k] - initial[k]).abs().max().item() for k in initial) < 1e-4

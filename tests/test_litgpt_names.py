"""Every model name LitGPT 0.5.13 registers resolves here (tests/fixtures/litgpt-0.5.13/model_names.txt), to a
config that builds, and works where LitGPT's commands take a name: `litgpt pretrain NAME`, `--model_name NAME`,
`litgpt plan NAME` (`litgpt download NAME`: tests/test_download.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from litgpt.config import Config
from litgpt.configs import configs_by_name, litgpt_names
from litgpt.errors import UserError

FIXTURE = Path(__file__).parent / "fixtures" / "litgpt-0.5.13" / "model_names.txt"
ROWS = [line.split("\t") for line in FIXTURE.read_text().splitlines() if not line.startswith("#")]
LITGPT_REPOS = dict(ROWS)

# The one LitGPT name not registered here: its LongRoPE factor lists (96 numbers of its published config.json, changed
# in a 2024 update) could not be checked from here. `litgpt download microsoft/Phi-3-mini-128k-instruct` still
# downloads it and converts it from its own config.json, LongRoPE included.
PENDING = {"Phi-3-mini-128k-instruct"}
RESOLVING = [name for name, _ in ROWS if name not in PENDING]


def _same_repo(ours: str, litgpt: str) -> bool:
    """Meta renamed its Llama 3.1 repos (the hub redirects the old names, which LitGPT still uses)."""
    return ours == litgpt.replace("meta-llama/Meta-Llama-3.1-", "meta-llama/Llama-3.1-")


def test_fixture_is_litgpts_sorted_list():
    names = [name for name, _ in ROWS]
    assert len(names) == 210 and names == sorted(names) and len(set(names)) == 210
    assert PENDING <= set(names)


def test_every_litgpt_name_resolves():
    """(tests/test_config_registry.py::test_every_litgpt_name_builds_on_meta builds them.)"""
    registry = configs_by_name()
    for name in RESOLVING:
        config = Config.from_name(name)
        assert config.to_dict() == Config(**registry[config.name]).to_dict(), name
        ours = f"{config.hf_config['org']}/{config.hf_config['name']}"
        assert _same_repo(ours, LITGPT_REPOS[name]), (name, ours, LITGPT_REPOS[name])


def test_every_litgpt_name_converts():
    """Each config writes a Hugging Face config.json that reads back as itself: what `litgpt convert_to_litgpt
    --model_name NAME` checks a downloaded checkpoint against (the layout of its family's transformers class)."""
    from litgpt.convert.families.configs import config_from_hf, config_to_hf

    for name in RESOLVING:
        config = Config.from_name(name)
        back = config_from_hf(config_to_hf(config))
        assert back.to_dict() == {**config.to_dict(), "name": back.name, "hf_config": back.hf_config,
                                  "prompt_style": back.prompt_style}, name


def test_pending_names_are_not_registered_yet():
    """Fails as soon as the pending name is registered: delete it from PENDING (and this test with it)."""
    registered = [name for name in sorted(PENDING) if name in configs_by_name()]
    assert not registered, f"{registered} are registered now: delete them from PENDING"
    for name in PENDING:
        with pytest.raises(UserError, match="Unknown model name"):
            Config.from_name(name)


def test_litgpt_spellings():
    """LitGPT's spelling of a name registered here under another one: a LitGPT name, not itself registered, for a
    registered model, and the config is that model's (under its name here)."""
    registry = configs_by_name()
    spellings = litgpt_names()
    assert set(spellings) <= set(LITGPT_REPOS)
    assert not set(spellings) & set(registry)
    assert set(spellings.values()) <= set(registry)
    assert len(spellings) == 19  # Gemma 1/2/3 (-it) and Llama 3
    assert Config.from_name("Gemma-2-2b").name == "gemma-2-2b"
    assert Config.from_name("CodeGemma-7b-it").hf_config == {"org": "google", "name": "codegemma-7b-it"}
    assert Config.from_name("Llama-3-8B-Instruct", n_layer=2).n_layer == 2
    # LitGPT's hub names resolve too; the unpublished Gemma 3 -pt spelling is no LitGPT name.
    assert Config.from_name("deepseek-ai/DeepSeek-R1-Distill-Llama-8B").name == "R1-Distill-Llama-8B"
    with pytest.raises(UserError, match="Unknown model name 'Gemma-3-1b-pt'"):
        Config.from_name("Gemma-3-1b-pt")


def test_families_convert_and_chat_as_published():
    c = Config.from_name
    for name in ("Falcon3-7B-Base", "salamandra-2b", "open_llama_3b", "Platypus2-13B", "FreeWilly2",
                 "R1-Distill-Llama-8B", "Llama-3.1-Nemotron-70B-Instruct-HF", "CodeLlama-70b-hf", "LLaMA-2-7B-32K"):
        assert c(name).hf_model_type == "llama", name
    assert c("Gemma-7b").hf_model_type == "gemma" and not c("Gemma-7b").post_attention_norm
    assert c("Mathstral-7B-v0.1").hf_model_type == "mistral" and c("Mathstral-7B-v0.1").sliding_window_size is None
    assert (c("Mixtral-8x22B-v0.1").hf_model_type, c("Mixtral-8x22B-v0.1").n_expert) == ("mixtral", 8)
    assert c("QwQ-32B").hf_model_type == "qwen2" and c("Qwen3-30B-A3B-Base").hf_model_type == "qwen3_moe"
    assert c("LLaMA-2-7B-32K").rope_scaling == {"type": "linear", "factor": 8.0}
    assert c("R1-Distill-Llama-70B").rope_scaling["type"] == "llama3"
    styles = {
        "Falcon3-1B-Instruct": "falcon3", "Falcon3-1B-Base": "default", "salamandra-7b-instruct": "salamandra",
        "Platypus2-7B": "platypus", "FreeWilly2": "freewilly2", "R1-Distill-Llama-8B": "deepseek-r1",
        "CodeLlama-70b-Instruct-hf": "codellama-70b", "CodeLlama-70b-hf": "default", "Gemma-2b-it": "gemma",
        "CodeGemma-7b-it": "gemma", "Mistral-Large-Instruct-2411": "mistral-v3",
        "Mixtral-8x22B-Instruct-v0.1": "mistral-v3", "Mathstral-7B-v0.1": "mistral-v3",
        "QwQ-32B": "chatml-thinking", "QwQ-32B-Preview": "qwq-preview", "Qwen2.5-Coder-7B-Instruct": "qwen2.5",
        "Qwen2.5-Math-72B-Instruct": "qwen2.5-math", "Qwen2.5-14B-Instruct-1M": "qwen2.5", "Qwen3-4B-Base": "default",
        "Qwen3-4B-Instruct-2507": "chatml", "Qwen3-235B-A22B-Thinking-2507": "chatml-thinking",
        "Llama-3.1-Nemotron-70B-Instruct-HF": "llama3", "Llama-2-7b-chat-hf-function-calling-v2": "llama2",
    }
    assert {name: c(name).prompt_style for name in styles} == styles


def test_pretrain_and_plan_take_a_litgpt_name(capsys):
    """`litgpt pretrain NAME` / `--model_name NAME` resolve the name in `resolve_inputs` (the config and data the
    run uses); `litgpt plan NAME` runs whole, here in-process."""
    from litgpt.__main__ import main
    from litgpt.pretrain import resolve_inputs

    config, data, tokenizer_dir = resolve_inputs("Gemma-2b", None, None, None, None)
    assert (config.name, config.n_layer, config.hf_model_type) == ("gemma-2b", 18, "gemma")
    config, _, _ = resolve_inputs("R1-Distill-Llama-8B", None, None, None, None)
    assert config.hf_config["name"] == "DeepSeek-R1-Distill-Llama-8B"
    main(["plan", "Gemma-2b"])
    out = capsys.readouterr().out
    assert out.startswith("gemma-2b:") and "18 blocks" in out

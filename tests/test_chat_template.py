"""The checkpoint's own chat template (`litgpt.chat_template`): `ChatFormat.prompt_ids` against `transformers`'
`apply_chat_template(tokenize=True)` on the published templates of the registered families, the prompt-style
fallback, errors and the sandbox, and `litgpt chat` and finetuning data laid out with the template.

The published templates are in tests/chat_templates/ (their sources in its README); `PUBLISHED` says which registered
model each stands for. Each is run on a tokenizer built here (every byte a token, the template's special tokens added
as special tokens) that transformers loads with `AutoTokenizer`.

Families (litgpt/configs) whose published tokenizers have no chat template: pythia, phi_legacy (phi-1.5, phi-2), and
llama_community's OpenLLaMA, LLaMA-2-7B-32K, Platypus and FreeWilly2 models (and the base models of most families).
Registered chat models whose published template is not among the fixtures (no copy of it could be checked): OLMo 2
Instruct (olmo2), Salamandra Instruct (salamandra), Qwen2.5-Math, QwQ-32B-Preview and the Qwen3 -2507 models,
Mistral 7B v0.2, Mathstral, Mistral Large and Mixtral 8x22B Instruct, CodeGemma, GLM-4.5 (GLM-4.6's is here), Llama
3.1 Nemotron and the Trelis function-calling Llama 2.
"""

from __future__ import annotations

import io
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch

from litgpt.chat_template import ChatFormat, ChatTemplate
from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.prompts import PromptStyle
from litgpt.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
R1_BOS, R1_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
GEMMA = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>")
MISTRAL = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]")


@dataclass(frozen=True)
class Published:
    """A published template (tests/chat_templates/FILE.jinja) and what its tokenizer and template take."""

    family: str  # the module of litgpt/configs
    repo: str  # a registered model whose tokenizer publishes this template
    bos: Optional[str]
    eos: str
    specials: tuple[str, ...] = ()  # special tokens the template writes that the <|...|> pattern does not find
    system: bool = True  # takes a system message
    tools: bool = False  # lays out tool definitions, tool calls and tool results
    reasoning: bool = False  # shows an assistant's reasoning_content (or thinking)
    kwargs: dict = field(default_factory=dict)  # template variables it reads
    also: tuple[str, ...] = ()  # further scenarios it must lay out


LLAMA2 = dict(bos="<s>", eos="</s>")
LLAMA3 = dict(bos="<|begin_of_text|>", eos="<|eot_id|>")
QWEN = dict(bos=None, eos="<|im_end|>")
THINKING = ("thinking_in_content",)  # earlier replies' <think>...</think> in their content
PUBLISHED = {
    "llama-2-chat": Published("llama", "meta-llama/Llama-2-7b-chat-hf", **LLAMA2),
    "codellama-instruct": Published("llama", "codellama/CodeLlama-34b-Instruct-hf", **LLAMA2),
    "codellama-70b-instruct": Published("llama", "codellama/CodeLlama-70b-Instruct-hf", **LLAMA2, specials=("<step>",)),
    "tinyllama-chat": Published("llama", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", **LLAMA2),
    "llama-3-instruct": Published("llama", "meta-llama/Meta-Llama-3-8B-Instruct", **LLAMA3),
    "llama-3.1-instruct": Published("llama", "meta-llama/Llama-3.1-8B-Instruct", **LLAMA3, tools=True,
                                    kwargs={"date_string": "1 Jan 2025"}),
    "llama-3.2-instruct": Published("llama", "meta-llama/Llama-3.2-3B-Instruct", **LLAMA3, tools=True),
    "mistral-instruct-v0.1": Published("mistral", "mistralai/Mistral-7B-Instruct-v0.1", **LLAMA2, specials=MISTRAL),
    "mixtral-instruct-v0.1": Published("mistral", "mistralai/Mixtral-8x7B-Instruct-v0.1", **LLAMA2, specials=MISTRAL),
    "mistral-instruct-v0.3": Published("mistral", "mistralai/Mistral-7B-Instruct-v0.3", **LLAMA2, specials=MISTRAL,
                                       tools=True),
    "qwen2.5-instruct": Published("qwen", "Qwen/Qwen2.5-3B-Instruct", **QWEN, tools=True),
    "qwq-32b": Published("qwen", "Qwen/QwQ-32B", **QWEN, tools=True, also=THINKING),
    "qwen3": Published("qwen", "Qwen/Qwen3-1.7B", **QWEN, tools=True, reasoning=True,
                       kwargs={"enable_thinking": False}, also=THINKING),
    "phi-3-instruct": Published("phi", "microsoft/Phi-3-mini-4k-instruct", bos="<s>", eos="<|endoftext|>"),
    "phi-3.5-instruct": Published("phi", "microsoft/Phi-3.5-mini-instruct", bos="<s>", eos="<|endoftext|>"),
    # (Phi-4-mini takes its tools as a JSON string in the system message's "tools" field)
    "phi-4-mini-instruct": Published("phi", "microsoft/Phi-4-mini-instruct", bos="<|endoftext|>", eos="<|endoftext|>",
                                     specials=("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"),
                                     also=("system_tools",)),
    "phi-4": Published("phi", "microsoft/phi-4", bos="<|endoftext|>", eos="<|im_end|>"),
    "phi-4-reasoning": Published("phi", "microsoft/Phi-4-reasoning", bos="<|endoftext|>", eos="<|im_end|>"),
    "gemma-it": Published("gemma", "google/gemma-2b-it", bos="<bos>", eos="<eos>", specials=GEMMA, system=False),
    "gemma-2-it": Published("gemma", "google/gemma-2-2b-it", bos="<bos>", eos="<eos>", specials=GEMMA, system=False),
    "gemma-3-it": Published("gemma", "google/gemma-3-1b-it", bos="<bos>", eos="<eos>", specials=GEMMA),
    "smollm2-instruct": Published("smollm", "HuggingFaceTB/SmolLM2-1.7B-Instruct", **QWEN),
    "smollm3": Published("smollm", "HuggingFaceTB/SmolLM3-3B", **QWEN, tools=True, kwargs={"enable_thinking": False}),
    "falcon-instruct": Published("falcon", "tiiuae/falcon-7b-instruct", bos=None, eos="<|endoftext|>"),
    "stablelm-zephyr": Published("stablelm", "stabilityai/stablelm-zephyr-3b", bos="<|endoftext|>",
                                 eos="<|endoftext|>"),
    # (published as allenai/OLMo-7B-Instruct; OLMo-7B-0724-Instruct-hf publishes the same text)
    "olmo-instruct": Published("olmo1", "allenai/OLMo-7B-Instruct-hf", bos=None, eos="<|endoftext|>"),
    "gpt-oss": Published("gpt_oss", "openai/gpt-oss-20b", bos="<|startoftext|>", eos="<|return|>", tools=True,
                         reasoning=True, kwargs={"reasoning_effort": "low"}),
    "glm-4.6": Published("glm", "zai-org/GLM-4.6", bos=None, eos="<|endoftext|>", specials=("[gMASK]", "<sop>"),
                         tools=True, reasoning=True, kwargs={"enable_thinking": False}, also=THINKING),
    "deepseek-r1": Published("deepseek", "deepseek-ai/DeepSeek-R1", bos=R1_BOS, eos=R1_EOS, also=THINKING),
    "deepseek-v3": Published("deepseek", "deepseek-ai/DeepSeek-V3-Base", bos=R1_BOS, eos=R1_EOS),
    "deepseek-v2-lite-chat": Published("deepseek", "deepseek-ai/DeepSeek-V2-Lite-Chat", bos=R1_BOS, eos=R1_EOS),
    "kimi-k2-instruct": Published("deepseek", "moonshotai/Kimi-K2-Instruct", bos=None, eos="<|im_end|>", tools=True),
    "deepseek-r1-distill-llama": Published("llama_community", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", bos=R1_BOS,
                                           eos=R1_EOS, also=THINKING),
    "falcon3-instruct": Published("falcon3", "tiiuae/Falcon3-3B-Instruct", bos=None, eos="<|endoftext|>", tools=True),
}
FAMILIES_WITHOUT_TEMPLATES = {"pythia", "phi_legacy"}
FAMILIES_NOT_COVERED = {"olmo2", "salamandra"}  # their chat models have templates; no checked copy is included

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}
TOOL_CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello. How can I help?"},
         {"role": "user", "content": "Name a color, café-style: \"bleu\"."}]
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
              {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "22 degrees"},
              {"role": "assistant", "content": "It is 22 degrees."},
              {"role": "user", "content": "Thanks!"}]
# name -> (messages, add_generation_prompt, tools, template kwargs)
SCENARIOS = {
    "multi_turn": (TURNS, True, None, {}),
    "with_system": ([SYSTEM] + TURNS, True, None, {}),
    "no_generation_prompt": ([SYSTEM] + TURNS, False, None, {}),
    "training": (TURNS + [{"role": "assistant", "content": "Blue."}], False, None, {}),
    "tools": (TOOL_TURNS, True, [WEATHER_TOOL], {}),
    "tools_content_none": ([{**m, "content": None} if "tool_calls" in m else m for m in TOOL_TURNS], True,
                           [WEATHER_TOOL], {}),  # as OpenAI's API sends it: dropped, as transformers drops it
    "reasoning": ([{"role": "user", "content": "2 + 2?"},
                   {"role": "assistant", "reasoning_content": "Two and two make four.", "content": "4"},
                   {"role": "user", "content": "3 + 3?"},
                   {"role": "assistant", "reasoning_content": "Three and three make six.", "content": "6"}],
                  False, None, {}),
    "thinking_in_content": ([{"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
                             {"role": "user", "content": "Bye"}], True, None, {}),
    "template_kwargs": (TURNS, True, None, None),  # None: the template's own kwargs (Published.kwargs)
    "system_tools": ([{"role": "system", "content": "Use tools.", "tools": json.dumps([WEATHER_TOOL])},
                      {"role": "user", "content": "Weather in Paris?"}], True, None, {}),
}


def required(published: Published) -> set[str]:
    """The scenarios the template must lay out (transformers must not fail on them)."""
    names = {"multi_turn", "training"}
    names |= {"with_system", "no_generation_prompt"} if published.system else set()
    names |= {"tools"} if published.tools else set()
    names |= {"reasoning"} if published.reasoning else set()
    names |= {"template_kwargs"} if published.kwargs else set()
    return names | set(published.also)


def special_tokens(template: str, published: Published) -> list[str]:
    """The special tokens of the tokenizer built for `template`: its <|...|> and <｜...｜> tokens, its BOS and EOS
    and the others `published` names."""
    found = re.findall(r"<\|[^|\s'\"<>]+\|>", template) + re.findall(r"<｜[^｜]+｜>", template)
    tokens = [published.bos, published.eos, *published.specials, *found]
    return list(dict.fromkeys(t for t in tokens if t))


def write_tokenizer_folder(folder: Path, template: str, specials: list[str], bos: Optional[str], eos: str,
                           as_file: bool = False) -> Path:
    """A byte-level tokenizer (every byte one token, no merges) with `specials` as special tokens, and `template` in
    tokenizer_config.json (or chat_template.jinja)."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "model_max_length": 131072}
    if as_file:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def published_folders(tmp_path_factory):
    """name -> (our ChatFormat, transformers' tokenizer), built on first use."""
    from transformers import AutoTokenizer

    built = {}

    def get(name: str):
        if name not in built:
            published = PUBLISHED[name]
            template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
            folder = write_tokenizer_folder(tmp_path_factory.mktemp(name), template,
                                            special_tokens(template, published), published.bos, published.eos,
                                            as_file=name.startswith("q"))  # a few read from chat_template.jinja
            tokenizer = Tokenizer(folder)
            built[name] = ChatFormat.from_checkpoint(folder, tokenizer, None), AutoTokenizer.from_pretrained(folder)
        return built[name]

    return get


def transformers_ids(hf, messages, **kwargs) -> list[int]:
    return hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_prompt_ids_equal_transformers_apply_chat_template(published_folders, name, scenario):
    """Same ids (and text) as transformers, or, where transformers fails on the conversation, a UserError."""
    published = PUBLISHED[name]
    ours, hf = published_folders(name)
    messages, generation_prompt, tools, kwargs = SCENARIOS[scenario]
    kwargs = published.kwargs if kwargs is None else kwargs
    options = dict(add_generation_prompt=generation_prompt, tools=tools, **kwargs)
    try:
        expected_text = hf.apply_chat_template(messages, tokenize=False, **options)
        expected = transformers_ids(hf, messages, **options)
    except Exception as error:  # the template refuses the conversation (e.g. a system message Gemma has no role for)
        assert scenario not in required(published), f"{name} must lay out {scenario}: {error!r}"
        with pytest.raises(UserError, match="chat template"):
            ours.prompt_ids(messages, **options)
        return
    assert ours.prompt_text(messages, **options) == expected_text
    assert ours.prompt_ids(messages, **options) == expected
    if published.eos in expected_text:  # special tokens' text became their ids
        assert ours.tokenizer.token_to_id(published.eos) in expected


def test_the_fixtures_stand_for_registered_models_of_every_family():
    from litgpt.configs import FAMILIES, _registry

    registered = {f"{v['hf_config']['org']}/{v['hf_config']['name']}" for v in _registry().values()}
    for name, published in PUBLISHED.items():
        assert published.repo in registered, name
        assert (TEMPLATES / f"{name}.jinja").is_file()
    assert {path.stem for path in TEMPLATES.glob("*.jinja")} == set(PUBLISHED)
    covered = {p.family for p in PUBLISHED.values()}
    assert covered | FAMILIES_WITHOUT_TEMPLATES | FAMILIES_NOT_COVERED == set(FAMILIES)
    assert not covered & (FAMILIES_WITHOUT_TEMPLATES | FAMILIES_NOT_COVERED)


def test_what_the_templates_cover():
    """Tools, reasoning, extra kwargs and the {% generation %} tag are each exercised by several templates."""
    assert sum(p.tools for p in PUBLISHED.values()) >= 10
    assert sum(p.reasoning for p in PUBLISHED.values()) >= 3
    assert sum("{% generation %}" in (TEMPLATES / f"{n}.jinja").read_text() for n in PUBLISHED) >= 2


def test_tool_use_template_is_chosen_when_tools_are_given(tmp_path):
    folder = write_tokenizer_folder(tmp_path, "", ["<s>"], "<s>", "<s>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "plain:{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "tools:{{ tools | length }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_checkpoint(folder)
    assert template.render([{"role": "user", "content": "x"}]) == "plain:x"
    assert template.render([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL]) == "tools:1"
    config["chat_template"] = [{"name": "rag", "template": "x"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="none \"default\""):
        ChatTemplate.from_checkpoint(folder)


# ---- errors and the sandbox --------------------------------------------------------------------------------------
def chat_format_with(tmp_path, template: str) -> ChatFormat:
    folder = write_tokenizer_folder(tmp_path / "tok", template, ["<s>", "</s>"], "<s>", "</s>", as_file=True)
    return ChatFormat.from_checkpoint(folder, Tokenizer(folder), None)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('Only user and assistant roles are supported!') }}", "Only user and assistant"),
        ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", "TypeError"),
        ("{{ messages[5].content.upper() }}", "cannot lay out"),
        ("{% for m in messages %}", "not a valid Jinja template"),
    ],
    ids=["raise_exception", "type_error", "undefined", "syntax"],
)
def test_template_errors_are_user_errors(tmp_path, template, message):
    chat_format = chat_format_with(tmp_path, template)
    with pytest.raises(UserError, match=message):
        chat_format.prompt_ids([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace(__init__=1) %}",
        "{% set ns = namespace(a=1) %}{% set ns._private = 2 %}",
        "{{ raise_exception.__globals__['json'] }}",
        "{{ dict.__class__ }}{{ dict.fromkeys.__self__.__subclasses__() }}",
    ],
)
def test_the_sandbox_refuses_pythons_internals(tmp_path, template):
    with pytest.raises(UserError, match="chat template"):
        chat_format_with(tmp_path, template).prompt_ids([{"role": "user", "content": "hi"}])


def test_an_internal_attribute_alone_reads_as_nothing(tmp_path):
    """As in transformers: a private attribute read without use is undefined (empty), never the object."""
    chat_format = chat_format_with(tmp_path, "[{{ messages.__class__ }}{{ raise_exception.__globals__ }}]")
    assert chat_format.prompt_text([{"role": "user", "content": "hi"}]) == "[]"


def test_bad_conversations_are_user_errors(tmp_path):
    chat_format = chat_format_with(tmp_path, "{{ messages | length }}")
    for messages in ([], "hello", [["user", "hi"]]):
        with pytest.raises(UserError, match="conversation|Message 0"):
            chat_format.prompt_ids(messages)
    with pytest.raises(UserError, match="Tools must be a list"):
        chat_format.prompt_ids([{"role": "user", "content": "hi"}], tools={"name": "x"})


def test_objects_reach_the_template_as_plain_data(tmp_path):
    """A template sees JSON values only: a str subclass's methods and other objects' attributes stay out of reach."""

    class Sneaky(str):
        def shout(self):
            return "leaked"

    chat_format = chat_format_with(tmp_path, "{{ messages[0].content.shout is defined }}|{{ messages[0].obj }}")
    text = chat_format.prompt_text([{"role": "user", "content": Sneaky("hi"), "obj": object()}])
    assert text == "False|<object>"


# ---- without a template: the prompt style ------------------------------------------------------------------------
def tiny_format(style: str) -> ChatFormat:
    from litgpt.data.tiny import TOKENIZER_DIR

    config = Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, prompt_style=style)
    return ChatFormat.from_checkpoint(TOKENIZER_DIR, Tokenizer(TOKENIZER_DIR), config)


def test_a_folder_without_template_uses_the_prompt_style():
    chat_format = tiny_format("chatml")
    assert chat_format.template is None and chat_format.description == "prompt style 'chatml'"
    messages = [SYSTEM] + TURNS
    text = PromptStyle.from_name("chatml").apply_messages([(m["role"], m["content"]) for m in messages])
    assert chat_format.prompt_ids(messages) == chat_format.tokenizer.encode(text).tolist()
    tokenizer = chat_format.tokenizer
    assert [tokenizer.eos_id] in chat_format.stop_sequences()
    assert PromptStyle.from_name("chatml").stop_tokens(tokenizer)[-1] in chat_format.stop_sequences()
    alpaca = tiny_format("alpaca")
    assert not alpaca.multi_turn and chat_format.multi_turn
    assert alpaca.prompt_text(TURNS) == PromptStyle.from_name("alpaca").apply(TURNS[-1]["content"])
    assert ChatFormat.from_checkpoint(Path(tokenizer.checkpoint_dir), tokenizer, None).description == (
        "prompt style 'default'")


def test_without_a_template_tools_and_other_messages_are_user_errors():
    chat_format = tiny_format("chatml")
    with pytest.raises(UserError, match="has no chat template, so it cannot be given tools"):
        chat_format.prompt_ids(TURNS, tools=[WEATHER_TOOL])
    with pytest.raises(UserError, match="role 'tool'"):
        chat_format.prompt_ids(SCENARIOS["tools"][0])
    with pytest.raises(UserError, match="only text content"):
        chat_format.prompt_ids([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def test_a_template_keeps_the_styles_end_of_turn_among_the_stops(tmp_path):
    """A chat model's config still names its style: its end-of-turn token ends replies, as the tokenizer's EOS."""
    folder = write_tokenizer_folder(tmp_path, "x", ["<|endoftext|>", "<|im_end|>"], None, "<|endoftext|>")
    tokenizer = Tokenizer(folder)
    config = Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, prompt_style="chatml")
    chat_format = ChatFormat.from_checkpoint(folder, tokenizer, config)
    assert chat_format.description == "the chat template of tokenizer_config.json"
    assert chat_format.stop_sequences() == [[tokenizer.token_to_id("<|endoftext|>")],
                                            [tokenizer.token_to_id("<|im_end|>")]]


# ---- litgpt chat and finetuning data -----------------------------------------------------------------------------
def test_litgpt_chat_lays_the_conversation_out_with_the_template(tmp_path, monkeypatch, capsys):
    """`litgpt chat` on a folder whose template (Qwen2.5's, with its default system message) is not its config's
    prompt style: the prompts are transformers' ids of the conversation so far."""
    from transformers import AutoTokenizer

    import litgpt.chat as chat
    from test_chat import write_checkpoint

    folder = write_checkpoint(tmp_path / "qwen", "alpaca", "chatml")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    prompts, replies = [], []
    real_generate = chat.generate

    def recording_generate(model, prompt_ids, *args, **kwargs):
        prompts.append(prompt_ids.tolist())
        replies.append(list(real_generate(model, prompt_ids, *args, **kwargs)))
        return iter(replies[-1])

    monkeypatch.setattr(chat, "generate", recording_generate)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\nWhat do llamas eat?\n!exit\n"))
    chat.main(folder, temperature=0.0, max_new_tokens=4, device="cpu")
    assert "the chat template of tokenizer_config.json" in capsys.readouterr().err
    hf = AutoTokenizer.from_pretrained(folder)
    reply = Tokenizer(folder).decode(replies[0]).strip()
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": reply},
               {"role": "user", "content": "What do llamas eat?"}]
    assert prompts[0] == transformers_ids(hf, history[:1], add_generation_prompt=True)
    assert prompts[1] == transformers_ids(hf, history, add_generation_prompt=True)


def test_finetuning_conversations_are_laid_out_by_the_template(tmp_path):
    """A "messages" record: the ids of the whole conversation as transformers tokenizes it, only the last reply (as
    the template writes it, its end-of-turn included) labelled; instruction records keep the prompt style."""
    from transformers import AutoTokenizer

    from litgpt.data import JSON
    from tokenizer_helpers import make_tokenizer_folder

    folder = make_tokenizer_folder(tmp_path / "chatml", "chatml")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / "qwen3.jinja").read_text()  # Qwen3's: the reply gets an empty <think>
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [SYSTEM] + TURNS + [{"role": "assistant", "content": "Blue, as the sky."}]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps({"messages": messages}))
    (tmp_path / "data" / "val.jsonl").write_text(json.dumps({"instruction": "Hi", "output": "Yo"}))
    tokenizer = Tokenizer(folder)
    data = JSON(tmp_path / "data")
    data.connect(tokenizer, max_seq_length=1000, prompt_style=PromptStyle.from_name("chatml"))
    samples = {True: data.train_dataset()[0], False: data.val_dataset()[0]}
    hf = AutoTokenizer.from_pretrained(folder)
    whole = transformers_ids(hf, messages)
    prompt = transformers_ids(hf, messages[:-1], add_generation_prompt=True)
    assert whole[: len(prompt)] == prompt
    sample = samples[True]
    assert sample["input_ids"].tolist() == whole[:-1]
    assert sample["labels"].tolist() == [-100] * (len(prompt) - 1) + whole[len(prompt):]
    assert hf.decode(whole[len(prompt):]) == "<think>\n\n</think>\n\nBlue, as the sky.<|im_end|>\n"
    instruction = tokenizer.encode(PromptStyle.from_name("chatml").apply("Hi")).tolist()
    assert samples[False]["input_ids"].tolist()[: len(instruction)] == instruction
    # --data.prompt_style chooses the style for conversations too
    styled = JSON(tmp_path / "data", prompt_style="chatml")
    styled.connect(tokenizer, max_seq_length=1000)
    text = PromptStyle.from_name("chatml").apply_messages([(m["role"], m["content"]) for m in messages[:-1]])
    prompt = tokenizer.encode(text).tolist()
    assert styled.train_dataset()[0]["input_ids"].tolist()[: len(prompt)] == prompt


def test_a_conversation_the_template_cannot_lay_out_stops_before_training(tmp_path):
    from litgpt.data.json_data import SFTDataset

    users_only = "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"
    folder = write_tokenizer_folder(tmp_path / "a", users_only, ["</s>"], None, "</s>")
    records = [{"messages": TURNS + [{"role": "assistant", "content": "Blue."}]}]
    with pytest.raises(UserError, match="Conversation 0 .* writes nothing for the last assistant message"):
        SFTDataset(records, Tokenizer(folder), PromptStyle(), chat_template=ChatTemplate.from_checkpoint(folder))
    folder = write_tokenizer_folder(tmp_path / "b", (TEMPLATES / "gemma-it.jinja").read_text(),
                                    ["<bos>", "<eos>", *GEMMA], "<bos>", "<eos>")
    records = [{"messages": [SYSTEM] + records[0]["messages"]}]
    with pytest.raises(UserError, match="Conversation 0 .*System role not supported"):
        SFTDataset(records, Tokenizer(folder), PromptStyle(), chat_template=ChatTemplate.from_checkpoint(folder))

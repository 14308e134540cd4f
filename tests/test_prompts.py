"""Prompt styles: hand-written expected strings, and agreement with `transformers`' chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.prompts import ChatStyle, PromptStyle, prompt_styles

ALL_STYLES = ["default", "alpaca", "chatml", "llama2", "llama3", "mistral", "phi3", "gemma", "tinyllama"]
# The layouts of models LitGPT 0.5.13 also names (their expected strings are at the end of this file).
ALL_STYLES += ["qwen2.5", "qwen2.5-math", "qwq-preview", "chatml-thinking", "deepseek-r1", "falcon3", "salamandra",
               "codellama-70b", "platypus", "freewilly2", "mistral-v3"]
ALL_STYLES += ["harmony"]

# One user message, no system message.
SINGLE_TURN = {
    "default": "Hi there",
    "alpaca": (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nHi there\n\n### Response:\n"
    ),
    "chatml": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "llama2": "[INST] Hi there [/INST]",
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "[INST] Hi there [/INST]",
    "phi3": "<|user|>\nHi there<|end|>\n<|assistant|>\n",
    "gemma": "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "tinyllama": (
        "<|system|>\nYou are a friendly chatbot who always gives helpful, detailed, and polite answers.</s>\n"
        "<|user|>\nHi there</s>\n<|assistant|>\n"
    ),
    "harmony": "<|start|>user<|message|>Hi there<|end|><|start|>assistant",
}

CONVERSATION = [
    ("system", "Be brief."),
    ("user", "Hi"),
    ("assistant", "Hello!"),
    ("user", "Name a color."),
]

MULTI_TURN = {
    "chatml": (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n"
    ),
    "llama2": "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Name a color. [/INST]",
    "llama3": (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a color.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "mistral": "[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Name a color. [/INST]",
    "phi3": (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
        "<|user|>\nName a color.<|end|>\n<|assistant|>\n"
    ),
    "gemma": (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nName a color.<end_of_turn>\n<start_of_turn>model\n"
    ),
    "tinyllama": (
        "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n"
        "<|user|>\nName a color.</s>\n<|assistant|>\n"
    ),
}


def test_every_style_is_registered():
    assert sorted(prompt_styles()) == sorted(ALL_STYLES)


@pytest.mark.parametrize("name", ALL_STYLES)
def test_single_turn(name):
    style = PromptStyle.from_name(name)
    assert style.name == name
    assert style.apply("Hi there") == SINGLE_TURN[name]
    # A one-message conversation is the same prompt.
    assert style.apply_messages([("user", "Hi there")]) == SINGLE_TURN[name]


@pytest.mark.parametrize("name", sorted(MULTI_TURN))
def test_multi_turn(name):
    style = PromptStyle.from_name(name)
    assert style.multi_turn
    assert style.apply_messages(CONVERSATION) == MULTI_TURN[name]
    # dict messages work the same
    as_dicts = [{"role": role, "content": text} for role, text in CONVERSATION]
    assert style.apply_messages(as_dicts) == MULTI_TURN[name]


def test_system_message_in_apply():
    assert PromptStyle.from_name("chatml").apply("Hi", system="Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert PromptStyle.from_name("llama2").apply("Hi", system="S") == "[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST]"


def test_alpaca_with_input():
    text = PromptStyle.from_name("alpaca").apply("Translate.", input="Hallo")
    assert text == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nTranslate.\n\n### Input:\nHallo\n\n### Response:\n"
    )


@pytest.mark.parametrize("name", ["default", "alpaca"])
def test_styles_without_template_use_the_last_message(name):
    style = PromptStyle.from_name(name)
    assert not style.multi_turn
    assert style.apply_messages(CONVERSATION) == style.apply("Name a color.")


def test_unknown_style_lists_known_names():
    with pytest.raises(UserError) as error:
        PromptStyle.from_name("vicuna-ish")
    message = str(error.value)
    assert "vicuna-ish" in message
    for name in ALL_STYLES:
        assert name in message


def test_from_config():
    config = Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, prompt_style="llama3")
    assert PromptStyle.from_config(config).name == "llama3"
    assert PromptStyle.from_config(Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10)).name == "default"


def test_bad_conversations():
    with pytest.raises(UserError, match="role"):
        PromptStyle.from_name("chatml").apply_messages([("robot", "beep")])
    with pytest.raises(UserError, match="user message"):
        PromptStyle.from_name("llama3").apply_messages([("system", "x")])
    with pytest.raises(UserError, match="alternate"):
        PromptStyle.from_name("llama2").apply_messages([("user", "a"), ("user", "b")])


class FakeTokenizer:
    """Maps known special tokens to one id and anything else to one id per character."""

    special = {"<|im_end|>": 7, "<|eot_id|>": 8, "<|end|>": 9}
    stop_ids = [2, 3]
    eos_id = 2

    def encode(self, text, bos=None, eos=False):
        import torch

        return torch.tensor([self.special[text]] if text in self.special else [100 + ord(c) for c in text])


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("default", ([2], [3])),
        ("alpaca", ([2], [3])),
        ("chatml", ([2], [3], [7])),
        ("llama3", ([2], [3], [8])),
        ("phi3", ([2], [3], [9])),
        ("gemma", ([2], [3], [100 + ord(c) for c in "<end_of_turn>"])),  # unknown here: a multi-token stop
        ("llama2", ([2], [3])),
    ],
)
def test_stop_tokens(name, expected):
    assert PromptStyle.from_name(name).stop_tokens(FakeTokenizer()) == expected


def test_every_chat_style_is_a_chat_style():
    for name in ALL_STYLES:
        style = PromptStyle.from_name(name)
        assert isinstance(style, ChatStyle) == style.multi_turn


# ---- agreement with transformers' apply_chat_template ----------------------------------------------------------------
# Published template texts (ChatML as Qwen2 writes it without a default system message; Meta's Llama 3 template).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def hf_tokenizer_with_template(folder, template, bos_token, special_tokens):
    """A tiny tokenizer folder (word-level) whose tokenizer_config.json holds `template`, loaded by transformers."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import AutoTokenizer

    vocab = {"<unk>": 0, bos_token: 1, "</s>": 2}
    for token in special_tokens:
        vocab.setdefault(token, len(vocab))
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize(
    ("name", "template", "bos"),
    [("chatml", CHATML_TEMPLATE, ""), ("llama3", LLAMA3_TEMPLATE, "<|begin_of_text|>")],
    ids=["chatml", "llama3"],
)
@pytest.mark.parametrize(
    "conversation",
    [CONVERSATION, CONVERSATION[1:], [("user", "  Just one.  ")]],
    ids=["with_system", "multi_turn", "one_message"],
)
def test_matches_transformers_chat_template(tmp_path, name, template, bos, conversation):
    hf = hf_tokenizer_with_template(tmp_path / "tok", template, bos or "<s>", ["<|im_start|>", "<|im_end|>"])
    messages = [{"role": role, "content": text} for role, text in conversation]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # litgpt's strings leave the BOS token to the tokenizer.
    assert expected.startswith(bos)
    assert PromptStyle.from_name(name).apply_messages(conversation) == expected[len(bos) :]


def test_chatml_ids_match_transformers(tmp_path):
    """Token for token: litgpt's Tokenizer on the chatml string = transformers' apply_chat_template(tokenize=True)."""
    from transformers import AutoTokenizer

    from litgpt.tokenizer import Tokenizer
    from tokenizer_helpers import make_tokenizer_folder

    folder = make_tokenizer_folder(tmp_path / "chatml", "chatml")  # its tokenizer_config.json holds a ChatML template
    messages = [{"role": role, "content": text} for role, text in CONVERSATION]
    expected = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    text = PromptStyle.from_name("chatml").apply_messages(CONVERSATION)
    assert Tokenizer(folder).encode(text).tolist() == expected


def test_llama2_turn_markers_become_special_ids(tmp_path):
    from litgpt.tokenizer import Tokenizer
    from tokenizer_helpers import make_tokenizer_folder

    tokenizer = Tokenizer(make_tokenizer_folder(tmp_path / "llama", "llama"))
    text = PromptStyle.from_name("llama2").apply_messages([("user", "a"), ("assistant", "b"), ("user", "c")])
    ids = tokenizer.encode(text).tolist()
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    assert ids[0] == bos and ids.count(bos) == 2  # the tokenizer's BOS, then the one opening the second turn
    assert [eos, bos] == ids[ids.index(eos) : ids.index(eos) + 2]



# ---- the layouts of models LitGPT 0.5.13 also names ------------------------------------------------------------------
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
QWQ_SYSTEM = (
    "You are a helpful and harmless assistant. You are Qwen developed by Alibaba. You should think step-by-step."
)
SALAMANDRA_SYSTEM = (
    "I am Salamandra, an AI language model developed at the Barcelona Supercomputing Centre (BSC) by the Language "
    "Technologies Unit. My knowledge base was last updated on August 2023. Today Date: 2024-09-30\n"
    "Soy Salamandra, un modelo lingüístico de IA desarrollado en el Barcelona Supercomputing Centre (BSC) por la "
    "Language Technologies Unit. Mi base de conocimientos se actualizó por última vez en agosto de 2023.\n"
    "Soc Salamandra, un model de llenguatge d'IA desenvolupat al Barcelona Supercomputing Centre (BSC) per la "
    "Language Technologies Unit."
)


def _chatml_with_system(system):
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


SINGLE_TURN.update({
    "qwen2.5": _chatml_with_system(QWEN_SYSTEM),
    "qwen2.5-math": _chatml_with_system(MATH_SYSTEM),
    "qwq-preview": _chatml_with_system(QWQ_SYSTEM),
    "salamandra": _chatml_with_system(SALAMANDRA_SYSTEM),
    "chatml-thinking": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "deepseek-r1": "<｜User｜>Hi there<｜Assistant｜><think>\n",
    "mistral-v3": "[INST] Hi there[/INST]",
    "falcon3": "<|user|>\nHi there\n<|assistant|>\n",
    "codellama-70b": "Source: user\n\n Hi there <step> Source: assistant\nDestination: user\n\n ",
    "platypus": "### Instruction:\n\nHi there\n\n### Response:\n",
    "freewilly2": (
        "### System:\nThis is a system prompt, please behave and help the user.\n\n### User:\nHi there\n\n"
        "### Assistant:\n"
    ),
})

# A reasoning model's earlier reply, thinking included: the templates show only its answer again.
THINKING_CONVERSATION = [
    ("system", "Be brief."),
    ("user", "Hi"),
    ("assistant", "<think>\nA greeting.\n</think>\n\nHello!"),
    ("user", "Name a color."),
]
# (test_multi_turn's cases were collected above; these run in test_multi_turn_of_the_new_styles.)
MULTI_TURN_NEW = {
    "mistral-v3": "[INST] Hi[/INST] Hello!</s>[INST] Be brief.\n\nName a color.[/INST]",
    "qwen2.5": MULTI_TURN["chatml"],  # a system message of the conversation's own replaces the default
    "falcon3": (
        "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!<|endoftext|>\n<|user|>\nName a color.\n"
        "<|assistant|>\n"
    ),
    "codellama-70b": (
        "Source: system\n\n Be brief. <step> Source: user\n\n Hi <step> Source: assistant\n\n Hello! <step> "
        "Source: user\n\n Name a color. <step> Source: assistant\nDestination: user\n\n "
    ),
}


@pytest.mark.parametrize("name", sorted(MULTI_TURN_NEW))
def test_multi_turn_of_the_new_styles(name):
    style = PromptStyle.from_name(name)
    assert style.multi_turn
    assert style.apply_messages(CONVERSATION) == MULTI_TURN_NEW[name]


def test_reasoning_styles_show_earlier_answers_without_thinking():
    assert PromptStyle.from_name("chatml-thinking").apply_messages(THINKING_CONVERSATION) == (
        MULTI_TURN["chatml"] + "<think>\n"
    )
    assert PromptStyle.from_name("deepseek-r1").apply_messages(THINKING_CONVERSATION) == (
        "Be brief.<｜User｜>Hi<｜Assistant｜>\n\nHello!<｜end▁of▁sentence｜><｜User｜>Name a color.<｜Assistant｜><think>\n"
    )


def test_freewilly2_system_message():
    assert PromptStyle.from_name("freewilly2").apply("Hi", system="S") == (
        "### System:\nS\n\n### User:\nHi\n\n### Assistant:\n"
    )


def test_codellama_70b_turns_must_alternate():
    with pytest.raises(UserError, match="alternate"):
        PromptStyle.from_name("codellama-70b").apply_messages([("user", "a"), ("user", "b")])


def published(name: str) -> str:
    """A published template of tests/chat_templates (see test_chat_template.py)."""
    return (Path(__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


# Qwen2.5's template (with SYSTEM for the default system message of the Qwen2.5 variants) and Salamandra's, as in
# their tokenizer_config.json with the branches for tool calls left out (litgpt's prompt styles have no tools); the
# other models' templates are the published files of tests/chat_templates.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n    {{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}\n{%- else %}\n    {{- '<|im_start|>system\\nSYSTEM<|im_end|>\\n' }}\n{%- endif %}\n"
    "{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
SALAMANDRA_TEMPLATE = (
    "{%- if not date_string is defined %}{%- set date_string = \"2024-09-30\" %}{%- endif %}{%- set system_message = "
    "messages[0].content if messages[0].role == \"system\" else SYSTEM -%}{%- if messages[0].role == \"system\" -%}"
    "{%- set messages = messages[1:] -%}{%- endif -%}{{ \"<|im_start|>system\\n\" + system_message + "
    "\"<|im_end|>\\n\" }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_SALAMANDRA_DEFAULT = (
    "\"I am Salamandra, an AI language model developed at the Barcelona Supercomputing Centre (BSC) by the Language "
    "Technologies Unit. My knowledge base was last updated on August 2023. Today Date: \"+ date_string +\"\\nSoy "
    "Salamandra, un modelo lingüístico de IA desarrollado en el Barcelona Supercomputing Centre (BSC) por la Language "
    "Technologies Unit. Mi base de conocimientos se actualizó por última vez en agosto de 2023.\\nSoc Salamandra, un "
    "model de llenguatge d'IA desenvolupat al Barcelona Supercomputing Centre (BSC) per la Language Technologies "
    "Unit.\""
)
# name -> (template, BOS token the template writes itself)
PUBLISHED_TEMPLATES = {
    "qwen2.5": (QWEN25_TEMPLATE.replace("SYSTEM", QWEN_SYSTEM), ""),
    "qwen2.5-math": (QWEN25_TEMPLATE.replace("SYSTEM", MATH_SYSTEM.replace("\\", "\\\\")), ""),
    "qwq-preview": (QWEN25_TEMPLATE.replace("SYSTEM", QWQ_SYSTEM), ""),
    "chatml-thinking": (published("qwq-32b"), ""),
    "deepseek-r1": (published("deepseek-r1"), "<｜begin▁of▁sentence｜>"),
    # Falcon3's eos_token is <|endoftext|> (the test tokenizer's is </s>).
    "falcon3": (published("falcon3-instruct").replace("eos_token", "'<|endoftext|>'"), ""),
    "salamandra": (SALAMANDRA_TEMPLATE.replace("SYSTEM", _SALAMANDRA_DEFAULT), ""),
    "codellama-70b": (published("codellama-70b-instruct"), "<s>"),
    "mistral-v3": (published("mistral-instruct-v0.3"), "<s>"),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_TEMPLATES))
@pytest.mark.parametrize(
    "conversation",
    [CONVERSATION, CONVERSATION[1:], THINKING_CONVERSATION, [("user", "  Just one.  ")]],
    ids=["with_system", "multi_turn", "with_thinking", "one_message"],
)
def test_matches_the_published_chat_template(tmp_path, name, conversation):
    template, bos = PUBLISHED_TEMPLATES[name]
    hf = hf_tokenizer_with_template(tmp_path / "tok", template, bos or "<s>", ["<|im_start|>", "<|im_end|>"])
    messages = [{"role": role, "content": text} for role, text in conversation]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert expected.startswith(bos)
    assert PromptStyle.from_name(name).apply_messages(conversation) == expected[len(bos) :]


def test_harmony_matches_the_published_example():
    """A system message as harmony's developer message, the way gpt-oss' published chat template renders it (with
    the blank line before <|end|> that the template writes after the instructions), and an earlier reply as its
    final channel."""
    expected = (
        "<|start|>developer<|message|># Instructions\n\nAlways respond in riddles\n\n<|end|>"
        "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant"
    )
    style = PromptStyle.from_name("harmony")
    assert style.apply("What is the weather like in SF?", system="Always respond in riddles") == expected
    turns = [("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]
    assert style.apply_messages(turns) == (
        "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
        "<|start|>user<|message|>Bye<|end|><|start|>assistant"
    )
    assert style.end_of_turn == ("<|return|>", "<|call|>")

"""Prompt styles: hand-written expected strings, and agreement with `transformers`' chat templates."""

from __future__ import annotations

import json

import pytest

from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.prompts import ChatStyle, PromptStyle, prompt_styles

ALL_STYLES = ["default", "alpaca", "chatml", "llama2", "llama3", "mistral", "phi3", "gemma", "tinyllama", "harmony"]

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


def test_harmony_matches_the_published_example():
    """A system message as harmony's developer message, the way gpt-oss' published chat template renders it (with
    the blank line before <|end|> that the template writes after the instructions), and an earlier reply as its
    final channel."""
    published = (
        "<|start|>developer<|message|># Instructions\n\nAlways respond in riddles\n\n<|end|>"
        "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant"
    )
    style = PromptStyle.from_name("harmony")
    assert style.apply("What is the weather like in SF?", system="Always respond in riddles") == published
    turns = [("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]
    assert style.apply_messages(turns) == (
        "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
        "<|start|>user<|message|>Bye<|end|><|start|>assistant"
    )
    assert style.end_of_turn == ("<|return|>", "<|call|>")

"""`litgpt chat`: the conversation laid out by the chat template or the prompt style, history kept within the context,
the input loop (tests/test_chat_template.py checks the template's layout against transformers)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import litgpt.chat as chat
from litgpt.config import Config
from litgpt.chat_template import ChatFormat
from litgpt.errors import UserError
from litgpt.model import GPT
from litgpt.prompts import PromptStyle

REPO = Path(__file__).resolve().parents[1]


def write_checkpoint(folder: Path, prompt_style: str, tokenizer_style: str, block_size: int = 128) -> Path:
    from tokenizers import Tokenizer as Backend

    from litgpt.io import save_state_dict
    from tokenizer_helpers import make_tokenizer_folder

    make_tokenizer_folder(folder, tokenizer_style)
    vocab = Backend.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    config = Config(
        n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=vocab, padded_vocab_size=vocab,
        block_size=block_size, prompt_style=prompt_style,
    )
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    save_state_dict(model.state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    return folder


@pytest.fixture(scope="module")
def chatml_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("chat") / "chatml", "chatml", "chatml")


@pytest.fixture(scope="module")
def chat_process(chatml_checkpoint, tmp_path_factory):
    """`litgpt chat` fed two messages and !exit on stdin, started early: it runs while the other tests do."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "litgpt", "chat", str(chatml_checkpoint), "--max_new_tokens", "8", "--device", "cpu"]
    stdin_path = tmp_path_factory.mktemp("chat_stdin") / "stdin.txt"
    stdin_path.write_text("Hello there\nWhat do llamas eat?\n!exit\n")
    with open(stdin_path) as stdin:
        process = subprocess.Popen(
            command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
        )
    yield process
    if process.poll() is None:
        process.kill()
        process.communicate()


def run_chat(monkeypatch, checkpoint: Path, stdin_text: str, **kwargs):
    """Run chat.main in-process on `stdin_text`; return the prompts given to generate() and the replies' ids."""
    prompts, replies = [], []
    real_generate = chat.generate

    def recording_generate(model, prompt_ids, *args, **kw):
        prompts.append(prompt_ids.tolist())
        tokens = list(real_generate(model, prompt_ids, *args, **kw))
        replies.append(tokens)
        return iter(tokens)

    monkeypatch.setattr(chat, "generate", recording_generate)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin_text))
    chat.main(checkpoint, **{"temperature": 0.0, "max_new_tokens": 6, "device": "cpu", **kwargs})
    return prompts, replies


def test_chat_formats_the_conversation(chat_process, chatml_checkpoint, monkeypatch, capsys):
    from litgpt.tokenizer import Tokenizer

    prompts, replies = run_chat(monkeypatch, chatml_checkpoint, "Hello there\nWhat do llamas eat?\n!exit\n")
    tokenizer = Tokenizer(chatml_checkpoint)
    first = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(prompts[0]) == first
    assert prompts[0] == tokenizer.encode(first).tolist()
    # the second turn carries the first exchange
    reply = tokenizer.decode(replies[0]).strip()
    history = [("user", "Hello there"), ("assistant", reply), ("user", "What do llamas eat?")]
    second = PromptStyle.from_name("chatml").apply_messages(history)
    assert prompts[1] == tokenizer.encode(second).tolist()
    out = capsys.readouterr().out
    assert out.count(">> Prompt: ") == 3 and out.count(">> Reply: ") == 2


def test_reset_clears_the_history(chatml_checkpoint, monkeypatch):
    prompts, _ = run_chat(monkeypatch, chatml_checkpoint, "One\nTwo\n!reset\nThree\n")  # ends at EOF
    from litgpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(chatml_checkpoint)
    assert len(prompts) == 3
    assert "One" in tokenizer.decode(prompts[1])
    assert tokenizer.decode(prompts[2]) == "<|im_start|>user\nThree<|im_end|>\n<|im_start|>assistant\n"


def test_style_without_template_sends_single_turns(tmp_path, monkeypatch):
    from litgpt.tokenizer import Tokenizer

    folder = write_checkpoint(tmp_path / "alpaca", "alpaca", "gpt2")
    prompts, _ = run_chat(monkeypatch, folder, "First\nSecond\n!exit\n")
    tokenizer = Tokenizer(folder)
    assert tokenizer.decode(prompts[1]) == PromptStyle.from_name("alpaca").apply("Second")


def test_empty_lines_are_skipped_and_long_messages_refused(chatml_checkpoint, monkeypatch, capsys):
    prompts, _ = run_chat(monkeypatch, chatml_checkpoint, "\n   \n" + "word " * 200 + "\nShort\n!exit\n")
    assert len(prompts) == 1  # the 200-word message does not fit 128 tokens: refused, the loop goes on
    err = capsys.readouterr().err
    assert "context is 128 tokens" in err


def test_multiline_input(chatml_checkpoint, monkeypatch):
    from litgpt.tokenizer import Tokenizer

    prompts, _ = run_chat(monkeypatch, chatml_checkpoint, "line one\nline two\n!submit\n!exit\n", multiline=True)
    assert len(prompts) == 1
    text = Tokenizer(chatml_checkpoint).decode(prompts[0])
    assert "user\nline one\nline two<|im_end|>" in text


class CharTokenizer:
    """One id per character."""

    def encode(self, text, bos=None, eos=False):
        return torch.tensor([ord(c) for c in text])


def test_history_is_trimmed_to_the_context():
    style = PromptStyle.from_name("chatml")
    chat_format = ChatFormat(CharTokenizer(), style)
    turns = [("user", "a" * 20), ("assistant", "b" * 20), ("user", "c" * 20), ("assistant", "d" * 20), ("user", "e")]
    history = [{"role": role, "content": text} for role, text in turns]
    full = len(style.apply_messages(history))
    # everything fits
    ids = chat.encode_conversation(chat_format, list(history), block_size=full + 10, max_new_tokens=10)
    assert len(ids) == full
    # room for the reply only without the oldest exchange
    kept = list(history)
    ids = chat.encode_conversation(chat_format, kept, block_size=full + 9, max_new_tokens=10)
    assert kept == history[2:] and len(ids) == len(style.apply_messages(history[2:]))
    # only the last message fits, with less room than max_new_tokens: still sent
    kept = list(history)
    last = len(style.apply_messages(history[-1:]))
    ids = chat.encode_conversation(chat_format, kept, block_size=last + 3, max_new_tokens=10)
    assert kept == history[-1:] and len(ids) == last
    # not even the last message fits
    assert chat.encode_conversation(chat_format, list(history), block_size=last, max_new_tokens=10) is None


def test_chat_argument_errors(chatml_checkpoint):
    with pytest.raises(UserError, match="temperature"):
        chat.main(chatml_checkpoint, temperature=-1.0, device="cpu")
    with pytest.raises(UserError, match="does not exist"):
        chat.main(chatml_checkpoint / "missing", device="cpu")


def test_chat_cli_two_turns(chat_process):
    out, err = chat_process.communicate(timeout=120)
    assert chat_process.returncode == 0, err
    assert "Traceback" not in err
    assert out.count(">> Reply: ") == 2
    assert "the chat template of tokenizer_config.json" in err  # what lays the conversation out is announced

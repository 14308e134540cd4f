"""`litgpt serve`: OpenAI's API on localhost, checked with the official `openai` client and plain HTTP against
`litgpt.generate.generate` run alone in this process (the reference), including while requests are batched."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from litgpt.config import Config
from litgpt.generate import generate, load_model_and_tokenizer
from litgpt.model import GPT
from litgpt.prompts import PromptStyle
from litgpt.tokenizer import IncrementalDecoder

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 24
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("softcapping", [None, 20.0])  # SDPA's attention, and the written-out one
def test_per_row_positions_match_each_sequence_alone(softcapping):
    """GPT.forward with input_pos (B, T): each row at its own positions in its own cache row, as if alone."""
    torch.manual_seed(0)
    config = Config(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, padded_vocab_size=64,
                    block_size=32, sliding_window_size=5, sliding_window_pattern=2,
                    attention_logit_softcapping=softcapping)
    model = GPT(config)
    model.init_weights()
    sequences = [torch.randint(0, 64, (n,)) for n in (7, 3, 11)]
    expected = [model(s[None])[0, -1] for s in sequences]  # no cache at all
    model.set_kv_cache(batch_size=4, max_seq_length=32)
    prefix = [s[:-1] for s in sequences]
    # Prefill rows of different lengths together, padded on the right: the padding's keys are never attended.
    width = max(len(p) for p in prefix)
    tokens = torch.stack([torch.cat([p, torch.zeros(width - len(p), dtype=torch.long)]) for p in prefix])
    positions = torch.arange(width).expand(3, width)
    model(tokens, input_pos=positions)
    last = torch.stack([s[-1:] for s in sequences])
    logits = model(last, input_pos=torch.tensor([[len(p)] for p in prefix]))[:, -1]
    torch.testing.assert_close(logits, torch.stack(expected), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def make_context_matter(model: GPT) -> None:
    """Scale a freshly initialized model so that its next token depends on the earlier ones (at initialization the
    blocks barely change the residual stream: the current token alone decides, and a wrong KV cache goes unseen) and
    its logits are sharp (greedy choices are not near-ties that rounding could flip)."""
    for name, param in model.named_parameters():
        if ".attn." in name or ".mlp." in name:
            param.mul_(5)
    model.lm_head.weight.mul_(20)


def test_engine_steps_cancel_and_compact_rows():
    """The worker's steps run by hand: a cancelled sequence leaves at the next step and the last row moves into the
    freed one; the others go on exactly as alone."""
    import queue

    from litgpt.serving.engine import BatchingEngine, Sequence

    torch.manual_seed(0)
    config = Config(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, padded_vocab_size=64,
                    block_size=64)
    model = GPT(config)
    model.init_weights()
    make_context_matter(model)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    alone = [list(generate(model, p, 12, temperature=0.0)) for p in prompts]
    engine = BatchingEngine(model, max_batch_size=3)
    events = queue.Queue()
    sequences = [Sequence(p, 12, 0.0, None, 1.0, [], None, events, i) for i, p in enumerate(prompts)]
    for sequence in sequences:
        engine.submit(sequence)
    assert engine.load() == 3 and not engine.active
    engine.admit(block=False)
    engine.decode_step()
    sequences[0].cancelled = True
    engine.decode_step()
    assert engine.active == [sequences[2], sequences[1]]  # row 0 freed, the last row moved into it
    while engine.active:
        engine.decode_step()
    assert engine.load() == 0
    tokens = {0: [], 1: [], 2: []}
    while not events.empty():
        kind, index, value = events.get()
        if kind == "tokens":
            tokens[index] += value
    assert tokens[0] == alone[0][:2] and tokens[1] == alone[1] and tokens[2] == alone[2]


# ---- a server on localhost ---------------------------------------------------------------------------------------
def write_checkpoint(folder: Path) -> Path:
    from tokenizers import Tokenizer as Backend

    from litgpt.io import save_state_dict
    from tokenizer_helpers import make_tokenizer_folder

    make_tokenizer_folder(folder, "chatml")
    vocab = Backend.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    config = Config(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=vocab, padded_vocab_size=vocab,
                    block_size=96, prompt_style="chatml")
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    make_context_matter(model)
    save_state_dict(model.state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    return folder


def start_server(checkpoint: Path, log: Path, *args: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "litgpt", "serve", str(checkpoint), "--port", "0", "--device", "cpu", *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env, cwd=REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        if match:
            return process, int(match.group(1))
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {log.read_text()}")
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the server did not start: {log.read_text()}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny-chatml")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    process, port = start_server(checkpoint, tmp_path_factory.mktemp("serve_log") / "server.log",
                                 "--max_new_tokens", str(MAX_NEW_TOKENS), "--max_batch_size", "8")
    yield port
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy text and token count from `generate` alone, laid out as `litgpt chat` (chat) or `litgpt generate`
    (completion) lay out their prompts."""
    model, tokenizer = load_model_and_tokenizer(checkpoint, device="cpu")
    style = PromptStyle.from_config(model.config)

    def run(prompt: "str | list[int]", chat: bool, max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[str, int, int]:
        text = style.apply_messages([("user", prompt)]) if chat else prompt
        ids = torch.tensor(prompt) if isinstance(prompt, list) else tokenizer.encode(text)
        stops = dict(stop_sequences=style.stop_tokens(tokenizer)) if chat else dict(stop_ids=tokenizer.stop_ids)
        tokens = list(generate(model, ids, max_new_tokens, temperature=0.0, **stops))
        decoder = IncrementalDecoder(tokenizer, prompt_ids=ids)
        return "".join(decoder.step(t) for t in tokens) + decoder.finish(), len(ids), len(tokens)

    return run


def test_chat_and_completions_equal_generate_alone(client, reference):
    text, prompt_tokens, new_tokens = reference("What do llamas eat?", chat=True)
    answer = client.chat.completions.create(model="tiny-chatml", temperature=0,
                                            messages=[{"role": "user", "content": "What do llamas eat?"}])
    assert answer.object == "chat.completion" and answer.model == "tiny-chatml" and answer.id.startswith("chatcmpl-")
    assert answer.choices[0].message.content == text and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == ("length" if new_tokens == MAX_NEW_TOKENS else "stop")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, new_tokens)

    chunks = list(client.chat.completions.create(model="tiny-chatml", temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "What do llamas eat?"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == answer.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == new_tokens and len(chunks) > 3

    text, prompt_tokens, new_tokens = reference("The quick brown fox", chat=False, max_new_tokens=10)
    answer = client.completions.create(model="tiny-chatml", prompt="The quick brown fox", max_tokens=10,
                                       temperature=0)
    assert answer.object == "text_completion" and answer.choices[0].text == text
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, new_tokens)
    chunks = list(client.completions.create(model="tiny-chatml", prompt="The quick brown fox", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_stop_strings_cut_the_text(client, reference):
    text, _, _ = reference("Language models", chat=False)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    expected = text[: text.index(stop)]
    for stream in (False, True):
        answer = client.completions.create(model="tiny-chatml", prompt="Language models", temperature=0,
                                           stop=["never in this text \u2603", stop], stream=stream)
        if stream:
            answer = list(answer)
            assert "".join(c.choices[0].text for c in answer) == expected
            assert answer[-1].choices[0].finish_reason == "stop"
        else:
            assert answer.choices[0].text == expected and answer.choices[0].finish_reason == "stop"


def test_a_prompt_near_the_context_end_stops_where_generate_does(client, reference):
    """A prompt of token ids 4 short of the model's context (96): 4 new tokens at most, as `generate` gives."""
    ids = [(7 * i) % 200 + 10 for i in range(92)]
    text, _, new_tokens = reference(ids, chat=False)
    answer = client.completions.create(model="tiny-chatml", prompt=ids, temperature=0)
    assert answer.choices[0].text == text and answer.usage.completion_tokens == new_tokens <= 4
    assert answer.choices[0].finish_reason == ("length" if new_tokens == 4 else "stop")


def test_sampling_with_a_seed_repeats_and_n_gives_choices(client):
    def ask(**kwargs):
        return client.completions.create(model="tiny-chatml", prompt="Once upon a time", temperature=1.0,
                                         top_p=0.9, **kwargs)

    first, second = ask(seed=7, n=3), ask(seed=7, n=3)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1  # the choices draw from different seeds


def test_concurrent_requests_are_batched_and_each_equals_its_solo_result(server, client, reference):
    prompts = [f"Request {i}: tell me about {word}" for i, word in
               enumerate(["dogs", "rivers", "code", "numbers", "accents", "quotes", "tabs", "Tokyo"])]
    lengths = [MAX_NEW_TOKENS - 2 * i for i in range(8)]  # they finish at different steps
    expected = [reference(p, chat=True, max_new_tokens=n)[0] for p, n in zip(prompts, lengths)]
    results: dict[int, str] = {}
    together = threading.Barrier(8)

    def ask(i):
        together.wait()
        answer = client.chat.completions.create(model="tiny-chatml", temperature=0, max_tokens=lengths[i],
                                                messages=[{"role": "user", "content": prompts[i]}])
        results[i] = answer.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results.get(i) for i in range(8)] == expected
    health = json.loads(http_request(server, "GET", "/health")[1])
    assert health["status"] == "ok" and health["largest_batch"] >= 4  # more than the n=3 of another test


# ---- bad input -----------------------------------------------------------------------------------------------------
def http_request(port: int, method: str, path: str, body: "bytes | None" = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("path, body, status, code", [
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/chat/completions", b'{"model": "tiny-chatml"}', 400, "missing_required_parameter"),
    ("/v1/completions", b'{"model": "tiny-chatml"}', 400, "missing_required_parameter"),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "Hi"}', 404, "model_not_found"),
    ("/v1/completions", b'{"prompt": "Hi", "temperature": "hot"}', 400, "invalid_value"),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 0}', 400, "invalid_value"),
    ("/v1/completions", b'{"prompt": "Hi", "logprobs": 3}', 400, "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "Hi"}]}', 400, "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "invalid_value"),
    ("/v1/completions", json.dumps({"prompt": "word " * 200}).encode(), 400, "context_length_exceeded"),
    ("/v1/embeddings", b'{"input": "Hi"}', 404, "not_found"),
], ids=["malformed-json", "not-an-object", "no-messages", "no-prompt", "unknown-model", "temperature-type",
        "max-tokens-0", "logprobs", "unknown-role", "content-type", "too-long", "unknown-route"])
def test_a_bad_request_gets_a_json_error_and_the_server_keeps_serving(server, path, body, status, code):
    got_status, raw = http_request(server, "POST", path, body)
    error = json.loads(raw)["error"]
    assert (got_status, error["code"]) == (status, code)
    assert error["message"] and error["type"] == "invalid_request_error"
    status, raw = http_request(server, "POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 2


def test_unknown_model_through_the_client_and_the_model_list(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    assert [model.id for model in client.models.list()] == ["tiny-chatml"]


def test_plain_http_stream_is_server_sent_events(server):
    body = json.dumps({"prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}).encode()
    status, raw = http_request(server, "POST", "/v1/completions", body)
    events = raw.decode().split("\n\n")
    assert status == 200 and events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(event[len("data: "):]) for event in events[:-2]]
    assert all(event.startswith("data: ") for event in events[:-1])
    assert all(c["object"] == "text_completion" for c in chunks) and len({c["id"] for c in chunks}) == 1
    status, raw = http_request(server, "POST", "/v1/completions", body.replace(b'"stream": true', b'"stream": false'))
    assert "".join(c["choices"][0]["text"] for c in chunks) == json.loads(raw)["choices"][0]["text"]


def test_a_client_leaving_mid_stream_does_not_disturb_the_server(server):
    import socket

    body = json.dumps({"prompt": "Hello", "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(200).startswith(b"HTTP/1.1 200")  # then leave without reading the rest
    deadline = time.monotonic() + 20
    while json.loads(http_request(server, "GET", "/health")[1])["requests_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(http_request(server, "GET", "/health")[1])["requests_in_flight"] == 0
    status, raw = http_request(server, "POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
    assert status == 200


def test_a_bad_checkpoint_folder_or_port_is_a_user_error(checkpoint, server, tmp_path):
    """UserError: the CLI prints its one line and exits 1 (tests/test_cli.py checks that path for every command)."""
    from litgpt.errors import UserError
    from litgpt.serving.server import main

    with pytest.raises(UserError, match="does not exist"):
        main(tmp_path / "missing", device="cpu")
    with pytest.raises(UserError, match=f"Cannot listen on 127.0.0.1:{server}"):
        main(checkpoint, port=server, device="cpu")


@pytest.mark.slow
def test_completion_equals_the_generate_command(checkpoint, client):
    """The same greedy text as `litgpt generate` prints after the prompt."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "litgpt", "generate", str(checkpoint), "--prompt", "Quotes like",
                             "--temperature", "0", "--max_new_tokens", "12", "--device", "cpu"],
                            capture_output=True, text=True, env=env, timeout=120, check=True)
    answer = client.completions.create(model="tiny-chatml", prompt="Quotes like", max_tokens=12, temperature=0)
    assert result.stdout == "Quotes like" + answer.choices[0].text + "\n"

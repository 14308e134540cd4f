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
from serving_helpers import run_engine

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


TINY = dict(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, padded_vocab_size=64, block_size=64)
LATENT = dict(n_layer=2, n_embd=48, n_head=4, n_query_groups=4, head_size=20, intermediate_size=64, kv_lora_rank=16, q_lora_rank=12,
              qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, rope_interleaved=True, vocab_size=64,
              padded_vocab_size=64, block_size=64)
PROMPTS = [[1, 2, 3], list(range(4, 30)), [9, 10], list(range(30, 50))]


def tiny_model(**changes) -> GPT:
    torch.manual_seed(0)
    model = GPT(Config(**{**TINY, **changes}))
    model.init_weights()
    make_context_matter(model)
    return model


@pytest.mark.parametrize("model_kind", ["grouped", "latent", "sliding-softcapped"])
@pytest.mark.parametrize("setting", [
    dict(),  # every prompt prefilled in one padded pass
    dict(prefill_tokens=8),  # long prompts in chunks of 8 tokens, over several passes
    dict(pool_tokens=44, max_seq_length=40, prefill_tokens=8),  # a pool too small for all: sequences are preempted
], ids=["batched-prefill", "chunked-prefill", "preempted"])
def test_paged_engine_tokens_equal_generate_alone(model_kind, setting):
    changes = {"grouped": {}, "latent": LATENT, "sliding-softcapped": dict(
        sliding_window_size=6, sliding_window_pattern=2, attention_logit_softcapping=20.0)}[model_kind]
    model = tiny_model(**changes)
    alone = [list(generate(model, p, 12, temperature=0.0)) for p in PROMPTS]
    tokens, engine = run_engine(model, PROMPTS, 12, max_batch_size=3, **setting)
    assert tokens == alone
    assert (engine.preemptions > 0) == ("pool_tokens" in setting)
    assert len(engine.pool.free) == engine.plan.num_blocks - 1  # every block back in the pool


@pytest.mark.parametrize("mode", ["ao.nf4", "bnb.nf4"])
def test_quantized_weights_serve_as_generate_runs_them(tmp_path, mode):
    """`--quantize`: the model as `litgpt generate --quantize` loads it; the engine's tokens equal generate's."""
    pytest.importorskip("torchao" if mode.startswith("ao") else "bitsandbytes")
    folder = write_checkpoint(tmp_path / "tiny")
    model, tokenizer = load_model_and_tokenizer(folder, precision="bf16-true", device="cpu", quantize=mode)
    prompts = [tokenizer.encode(p).tolist() for p in ("The llama", "Hello", "Quotes like")]
    alone = [list(generate(model, p, 10, temperature=0.0)) for p in prompts]
    assert run_engine(model, prompts, 10, max_batch_size=3)[0] == alone


@pytest.mark.slow
def test_a_compiled_decoding_step_gives_the_same_tokens():
    from litgpt.serving.server import compile_model

    alone = [list(generate(tiny_model(), p, 12, temperature=0.0)) for p in PROMPTS]
    tokens, engine = run_engine(compile_model(tiny_model()), PROMPTS, 12, max_batch_size=3, prefill_tokens=8)
    assert tokens == alone
    engine.warm_up()  # what the server runs before serving with --compile: throwaway sequences, nothing kept
    assert engine.load() == 0 and len(engine.pool.free) == engine.plan.num_blocks - 1 and engine.largest_batch == 0


def test_a_cancelled_sequence_leaves_before_the_next_pass_and_frees_its_blocks():
    import queue

    from litgpt.serving.engine import BatchingEngine, Sequence
    from litgpt.serving.paged_cache import CacheShape, plan_cache

    model = tiny_model()
    alone = [list(generate(model, p, 12, temperature=0.0)) for p in PROMPTS[:3]]
    plan = plan_cache(CacheShape.of(model, torch.float32), 64, 4, 3, None, None, 0.5, 2**30)
    engine = BatchingEngine(model, 3, plan)
    events = queue.Queue()
    sequences = [Sequence(p, 12, 0.0, None, 1.0, [], None, events, i) for i, p in enumerate(PROMPTS[:3])]
    for sequence in sequences:
        engine.submit(sequence)
    engine.step()  # prefill all three, then a decoding pass of three
    assert engine.decoding == 3 and engine.load() == 3
    held = len(sequences[1].blocks)
    free = len(engine.pool.free)
    sequences[1].cancelled = True
    engine.step()
    assert engine.decoding == 2 and engine.active == [sequences[0], sequences[2]]
    assert len(engine.pool.free) >= free + held - 2  # its blocks are back (the others may have taken one each)
    while engine.load():
        engine.step()
    tokens = {0: [], 1: [], 2: []}
    while not events.empty():
        kind, index, value = events.get()
        if kind == "tokens":
            tokens[index] += value
    assert tokens[0] == alone[0] and tokens[2] == alone[2] and tokens[1] == alone[1][:2]


def test_the_cache_is_sized_by_the_budget_not_by_the_context():
    """Per token: 2 layers x (keys + values) x 2 groups x head size 8 x 4 bytes = 256 bytes (by hand)."""
    from litgpt.errors import UserError
    from litgpt.serving.paged_cache import CacheShape, plan_cache

    model = tiny_model(block_size=131072)
    shape = CacheShape.of(model, torch.float32)
    assert shape.bytes_per_token == 2 * 2 * 2 * 8 * 4
    plan = plan_cache(shape, 131072, 16, 16, None, 1 / 1024, 0.5, 2**40)  # 1 MiB
    assert plan.tokens == 2**20 // 256 // 16 * 16 == 4096 and plan.max_seq_length == 4096
    small = plan_cache(shape, 131072, 16, 2, 100, None, 0.5, 2**40)  # what 2 sequences of 100 need, not more
    assert small.num_blocks - 1 == 2 * 7 and small.max_seq_length == 100
    free = plan_cache(shape, 131072, 16, 16, None, None, 0.25, 2**22)  # a quarter of 4 MiB free
    assert free.tokens == 4096
    with pytest.raises(UserError, match="fewer than one sequence of 8192"):
        plan_cache(shape, 131072, 16, 16, 8192, 1 / 1024, 0.5, 2**40)
    with pytest.raises(UserError, match="max_seq_length must be in"):
        plan_cache(shape, 64, 16, 16, 65, None, 0.5, 2**40)
    with pytest.raises(UserError, match="kv_cache_fraction"):
        plan_cache(shape, 64, 16, 16, None, None, 1.5, 2**40)


# ---- a server on localhost ---------------------------------------------------------------------------------------
def write_checkpoint(folder: Path, never_stops: bool = False, **changes) -> Path:
    """A tiny model with the chatml test tokenizer; `never_stops`: its head's bias rules out the end-of-sequence
    tokens, so that it writes until its token budget or the context ends."""
    from tokenizers import Tokenizer as Backend

    from litgpt.io import save_state_dict
    from tokenizer_helpers import make_tokenizer_folder

    make_tokenizer_folder(folder, "chatml")  # its tokenizer_config.json holds a ChatML chat template
    vocab = Backend.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    config = Config(**{**dict(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=vocab,
                              padded_vocab_size=vocab, block_size=96, prompt_style="chatml",
                              lm_head_bias=never_stops), **changes})
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    make_context_matter(model)
    if never_stops:
        from litgpt.tokenizer import Tokenizer

        with torch.no_grad():
            model.lm_head.bias[list(Tokenizer(folder).stop_ids)] = -1e4
    save_state_dict(model.state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    return folder


def start_server(checkpoint: Path, log: Path, *args: str, env: "dict | None" = None) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           **(env or {})}
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


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny-chatml")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    process, port = start_server(checkpoint, tmp_path_factory.mktemp("serve_log") / "server.log",
                                 "--max_new_tokens", str(MAX_NEW_TOKENS), "--max_batch_size", "8", "--precision", "32-true",
                                 "--kv_block_size", "8", "--prefill_tokens", "64")
    yield port
    stop(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy text and token counts from `generate` alone: chat prompts laid out by transformers'
    `apply_chat_template` from the checkpoint's tokenizer files, completions as `litgpt generate` encodes them."""
    from transformers import AutoTokenizer

    model, tokenizer = load_model_and_tokenizer(checkpoint, precision="32-true", device="cpu")
    hf = AutoTokenizer.from_pretrained(str(checkpoint))

    def run(prompt: "str | list[int]", chat: bool, max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[str, int, int]:
        if chat:
            ids = hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True)
            ids = torch.tensor(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = torch.tensor(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
        tokens = list(generate(model, ids, max_new_tokens, temperature=0.0, stop_ids=tokenizer.stop_ids))
        decoder = IncrementalDecoder(tokenizer, prompt_ids=ids)
        return "".join(decoder.step(t) for t in tokens) + decoder.finish(), len(ids), len(tokens)

    return run


def test_chat_and_completions_equal_generate_alone(client, reference):
    text, prompt_tokens, new_tokens = reference("What do llamas eat?", chat=True)
    answer = client.chat.completions.create(model="tiny-chatml", temperature=0,
                                            messages=[{"role": "user", "content": "What do llamas eat?"}])
    assert answer.object == "chat.completion" and answer.model == "tiny-chatml" and answer.id.startswith("chatcmpl-")
    assert answer.choices[0].message.content == text
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, new_tokens)
    text, prompt_tokens, new_tokens = reference("The llama", chat=False)
    answer = client.completions.create(model="tiny-chatml", prompt="The llama", temperature=0)
    assert answer.choices[0].text == text and answer.usage.completion_tokens == new_tokens
    streamed = client.completions.create(model="tiny-chatml", prompt="The llama", temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == new_tokens
    ids = [5, 17, 42, 99]  # a prompt of token ids
    answer = client.completions.create(model="tiny-chatml", prompt=ids, temperature=0, max_tokens=8)
    assert answer.choices[0].text == reference(ids, chat=False, max_new_tokens=8)[0]


def test_stop_strings_cut_the_text(client, reference):
    text, _, _ = reference("The llama", chat=False)
    stop = text[5:8]
    answer = client.completions.create(model="tiny-chatml", prompt="The llama", temperature=0, stop=[stop])
    assert answer.choices[0].text == text[: text.index(stop)] and answer.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny-chatml", prompt="The llama", temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == text[: text.index(stop)]


def test_a_prompt_near_the_context_end_stops_where_generate_does(client, reference):
    ids = list(range(10, 10 + 90))  # 90 of the 96 positions
    text, _, new_tokens = reference(ids, chat=False)
    answer = client.completions.create(model="tiny-chatml", prompt=ids, temperature=0)
    assert answer.choices[0].text == text and answer.usage.completion_tokens == new_tokens <= 6
    assert answer.choices[0].finish_reason in ("length", "stop")


def test_sampling_with_a_seed_repeats_and_n_gives_choices(client):
    def ask(seed):
        return client.completions.create(model="tiny-chatml", prompt="Hello", temperature=1.0, seed=seed, n=3,
                                          max_tokens=10)

    first, again = ask(7), ask(7)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len({c.text for c in first.choices}) > 1


def test_64_concurrent_clients_each_get_their_solo_result(server, client, reference):
    """64 clients of the official `openai` client at once (8 batch rows: most wait, all are served), chat and
    completions, each answer equal to `generate` alone on that prompt."""
    prompts = [f"Story {i}: the" for i in range(64)]
    expected = [reference(p, chat=i % 2 == 0)[0] for i, p in enumerate(prompts)]
    answers = [None] * 64

    def ask(i):
        if i % 2 == 0:
            answers[i] = client.chat.completions.create(model="tiny-chatml", temperature=0, messages=[
                {"role": "user", "content": prompts[i]}]).choices[0].message.content
        else:
            answers[i] = client.completions.create(model="tiny-chatml", prompt=prompts[i], temperature=0).choices[
                0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == expected
    health = json.loads(http_request(server, "GET", "/health")[1])
    assert health["status"] == "ok" and health["largest_batch"] == 8


# ---- limits and bad input ----------------------------------------------------------------------------------------
def http_request(port: int, method: str, path: str, body: "bytes | None" = None,
                 headers: "dict | None" = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
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
    ("/v1/completions", b'{"prompt": "Hi", "n": 9}', 400, "invalid_value"),
    ("/v1/completions", b'{"prompt": "Hi", "logprobs": 3}', 400, "invalid_value"),
    ("/v1/completions", b'{"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}', 400, "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "Hi"}]}', 400, "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "invalid_value"),
    ("/v1/completions", json.dumps({"prompt": "word " * 200}).encode(), 400, "context_length_exceeded"),
    ("/v1/embeddings", b'{"input": "Hi"}', 404, "not_found"),
], ids=["malformed-json", "not-an-object", "no-messages", "no-prompt", "unknown-model", "temperature-type",
        "max-tokens-0", "n-over-batch", "logprobs", "five-stops", "unknown-role", "content-type", "too-long",
        "unknown-route"])
def test_a_bad_request_gets_a_json_error_and_the_server_keeps_serving(server, path, body, status, code):
    got_status, raw = http_request(server, "POST", path, body)
    error = json.loads(raw)["error"]
    assert (got_status, error["code"]) == (status, code)
    assert error["message"] and error["type"] == "invalid_request_error"
    status, raw = http_request(server, "POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 2


def test_max_tokens_is_capped_and_a_body_over_the_limit_is_refused(server):
    status, raw = http_request(server, "POST", "/v1/completions",
                               b'{"prompt": "Hi", "max_tokens": 100000, "temperature": 0}')
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] <= MAX_NEW_TOKENS
    status, raw = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                       b"\r\nContent-Length: 9000000\r\n\r\n{")
    assert status == 413 and json.loads(raw)["error"]["code"] == "too_large"


def raw_exchange(port: int, data: bytes) -> tuple[int, bytes]:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        head, _, body = received.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
        while len(body) < length:
            body += sock.recv(65536)
        return int(head.split()[1]), body


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


def test_a_bad_checkpoint_folder_or_port_is_a_user_error(checkpoint, server, tmp_path):
    """UserError: the CLI prints its one line and exits 1 (tests/test_cli.py checks that path for every command)."""
    from litgpt.errors import UserError
    from litgpt.serving.server import main

    with pytest.raises(UserError, match="does not exist"):
        main(tmp_path / "missing", device="cpu")
    with pytest.raises(UserError, match=f"Cannot listen on 127.0.0.1:{server}"):
        main(checkpoint, port=server, device="cpu")
    with pytest.raises(UserError, match="max_seq_length must be in"):
        main(checkpoint, port=0, device="cpu", max_seq_length=1000)


# ---- a guarded server: API key, timeouts, a waiting bound, a long-context model in a small cache -----------------
API_KEY = "test-key-1234"
GUARDED_TIMEOUT = 6


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A slower model whose context (8192) is far longer than its cache budget (1024 tokens), two rows, one waiting
    sequence at most, short timeouts; the API key comes from LITGPT_API_KEY."""
    folder = write_checkpoint(tmp_path_factory.mktemp("guarded") / "run" / "final", never_stops=True, n_layer=8,
                              n_embd=512, block_size=8192)
    log = tmp_path_factory.mktemp("guarded_log") / "server.log"
    # per token: 8 layers x (keys + values) x 2 groups x head size 128 x 4 bytes = 16 KiB; 16 MiB hold 1024
    process, port = start_server(folder, log, "--precision", "32-true", "--kv_cache_gb", str(16 / 1024),
                                 "--max_batch_size", "2", "--max_waiting", "1", "--max_new_tokens", "2000",
                                 "--read_timeout", "2", "--request_timeout", str(GUARDED_TIMEOUT),
                                 env={"LITGPT_API_KEY": API_KEY})
    yield port, log
    stop(process)


def key(value: str = API_KEY) -> dict:
    return {"Authorization": f"Bearer {value}"}


def health(port: int) -> dict:
    return json.loads(http_request(port, "GET", "/health")[1])


def test_every_route_but_health_needs_the_api_key(guarded):
    port, _ = guarded
    assert http_request(port, "GET", "/health")[0] == 200
    for headers in ({}, key("wrong"), {"Authorization": API_KEY}):
        status, raw = http_request(port, "GET", "/v1/models", headers=headers)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
        status, _ = http_request(port, "POST", "/v1/completions", b'{"prompt": "Hi"}', headers=headers)
        assert status == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["run/final"]  # a run's final folder, named with its run
    answer = client.completions.create(model="run/final", prompt="Hi", max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens == 3


def test_a_long_context_model_starts_within_its_cache_budget(guarded):
    port, log = guarded
    assert "= 1024 tokens" in log.read_text() and "sequences of up to 1024 tokens" in log.read_text()
    status, raw = http_request(port, "POST", "/v1/completions", json.dumps({"prompt": [7] * 1024}).encode(), key())
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
    status, raw = http_request(port, "POST", "/v1/completions",
                               json.dumps({"prompt": [7] * 1000, "max_tokens": 100, "temperature": 0}).encode(), key())
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 24  # the cache's end: 1024 tokens


def long_request(port: int, stream: bool):
    """A raw connection with a request that runs for seconds (up to 2000 new tokens), left unread."""
    import socket

    body = json.dumps({"prompt": "The llama", "max_tokens": 1000, "temperature": 0, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                 b"Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (API_KEY.encode(), len(body), body))
    return sock


def wait_for(port: int, condition, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while not condition(state := health(port)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return state


def test_a_client_that_leaves_frees_its_sequence_and_the_batch_shrinks(guarded):
    port, _ = guarded
    streamed, plain = long_request(port, stream=True), long_request(port, stream=False)
    assert wait_for(port, lambda h: h["sequences_decoding"] == 2)["sequences_decoding"] == 2
    plain.close()  # a non-streamed request's client leaves
    assert wait_for(port, lambda h: h["sequences_decoding"] < 2, 2)["sequences_decoding"] == 1
    streamed.close()  # and a streamed one's
    state = wait_for(port, lambda h: h["sequences_in_flight"] == 0, 2)
    assert state["sequences_in_flight"] == 0 and state["free_kv_tokens"] == state["kv_tokens"]


def test_waiting_requests_are_bounded_with_429(guarded):
    port, _ = guarded
    running = [long_request(port, stream=False) for _ in range(3)]  # two rows, then one waiting
    try:
        state = wait_for(port, lambda h: h["sequences_waiting"] == 1 and h["sequences_decoding"] == 2)
        assert state["sequences_waiting"] == 1 and state["sequences_decoding"] == 2
        status, raw = http_request(port, "POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}', key())
        assert status == 429 and json.loads(raw)["error"]["code"] == "too_many_requests"
    finally:
        for sock in running:
            sock.close()
    wait_for(port, lambda h: h["sequences_in_flight"] == 0)


def test_a_request_past_its_time_ends_with_408(guarded):
    port, _ = guarded
    started = time.monotonic()
    body = json.dumps({"prompt": "The llama", "max_tokens": 2000, "temperature": 0}).encode()
    status, raw = http_request(port, "POST", "/v1/completions", body, key())
    assert status == 408 and json.loads(raw)["error"]["code"] == "request_timeout"
    assert GUARDED_TIMEOUT <= time.monotonic() - started < GUARDED_TIMEOUT + 5
    assert wait_for(port, lambda h: h["sequences_in_flight"] == 0)["sequences_in_flight"] == 0


def test_a_slow_client_does_not_delay_the_others_and_times_out(guarded):
    """A body sent a byte every 0.25 s: requests beside it are answered at once; it gets 408 after --read_timeout."""
    import socket

    port, _ = guarded
    with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                     b"Bearer %s\r\nContent-Length: 100\r\n\r\n" % API_KEY.encode())
        for i in range(4):
            slow.sendall(b" ")
            started = time.monotonic()
            status, _ = http_request(port, "POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}', key())
            assert status == 200 and time.monotonic() - started < 1.5
            time.sleep(0.25)
        slow.settimeout(10)
        head = slow.recv(65536)
    assert head.startswith(b"HTTP/1.1 408")


def test_an_engine_that_stops_fails_its_requests_and_health(tmp_path, checkpoint):
    """The engine's worker dies at its second decoding pass (a failpoint): the request in flight gets a 500 that says
    only "internal error" (the traceback is in the server's log), /health turns 503, new requests 503."""
    log = tmp_path / "server.log"
    process, port = start_server(checkpoint, log, env={"LITGPT_FAILPOINTS_ARMED": "1",
                                                       "LITGPT_FAILPOINT": "serve.decode@2=raise"})
    try:
        status, raw = http_request(port, "POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 5}')
        assert status == 500 and json.loads(raw)["error"] == {"message": "internal error", "type": "server_error",
                                                              "code": "internal_error", "param": None}
        status, raw = http_request(port, "GET", "/health")
        assert status == 503 and json.loads(raw)["status"] == "unavailable"
        status, raw = http_request(port, "POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 5}')
        assert status == 503 and json.loads(raw)["error"]["code"] == "unavailable"
    finally:
        stop(process)
    assert "Traceback" in log.read_text() and "failpoint serve.decode" in log.read_text()


@pytest.mark.slow
def test_completion_equals_the_generate_command(checkpoint, client):
    """The same greedy text as `litgpt generate` prints after the prompt."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "litgpt", "generate", str(checkpoint), "--prompt", "Quotes like",
                             "--temperature", "0", "--max_new_tokens", "12", "--device", "cpu"],
                            capture_output=True, text=True, env=env, timeout=120, check=True)
    answer = client.completions.create(model="tiny-chatml", prompt="Quotes like", max_tokens=12, temperature=0)
    assert result.stdout == "Quotes like" + answer.choices[0].text + "\n"

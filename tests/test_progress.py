"""Progress of long operations: a tqdm bar on a terminal, a line every 10 % in a log file, nothing on other ranks.

The conversions, the token cache build, the routing calibration and the perplexity run here for real, on tiny models,
with stderr captured (not a terminal); the counts in the lines are checked against what the operations produced.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from hf_models import save_hf_model
from tokenizer_helpers import make_tokenizer_folder

from litgpt import progress as progress_module
from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint
from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint
from litgpt.data import token_cache
from litgpt.data.token_cache import Corpus, ensure_token_cache
from litgpt.io import load_state_dict
from litgpt.progress import Progress, progress
from litgpt.tokenizer import Tokenizer

LINE = re.compile(r"^(?P<what>[^:]+): (?P<percent>\d+)% \((?P<count>\d+)/(?P<total>\d+) (?P<unit>\w+)\), elapsed \S+")


def percent_lines(text: str, what: str) -> list[tuple[int, int, int]]:
    """(percent, count, total) of every progress line of `what` in `text`."""
    found = [LINE.match(line) for line in text.splitlines()]
    return [(int(m["percent"]), int(m["count"]), int(m["total"])) for m in found if m and m["what"] == what]


def assert_first_crossings(lines: list[tuple[int, int, int]], step: int = 1) -> None:
    """Each line is printed at the first count (advancing by `step`) that reaches its multiple of 10 %."""
    assert [p for p, _, _ in lines] == list(range(10, 101, 10))
    for percent, count, total in lines:
        assert count * 100 >= percent * total > (count - step) * 100


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# ---- the helper itself -----------------------------------------------------------------------------------------------
def test_lines_every_ten_percent_with_eta_then_nothing_after_close():
    stream = io.StringIO()
    with Progress(25, "Working", unit="item", file=stream) as shown:
        for _ in range(25):
            shown.update(1)
    lines = percent_lines(stream.getvalue(), "Working")
    assert_first_crossings(lines)
    assert lines[-1] == (100, 25, 25)
    text = stream.getvalue().splitlines()
    assert all("ETA" in line for line in text[:-1]) and "ETA" not in text[-1] and "\r" not in stream.getvalue()


def test_a_jump_prints_one_line_and_resumed_work_starts_past_zero():
    stream = io.StringIO()
    with Progress(100, "Jumping", file=stream, initial=35) as shown:
        shown.update(40)
        shown.update(25)
    assert percent_lines(stream.getvalue(), "Jumping") == [(70, 75, 100), (100, 100, 100)]


def test_unknown_total_prints_counts_in_time_and_a_last_line(monkeypatch):
    monkeypatch.setattr(progress_module, "LINE_EVERY_SECONDS", 0.0)
    stream = io.StringIO()
    with Progress(None, "Streaming", unit="doc", file=stream) as shown:
        shown.update(3)
        shown.update(2)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("Streaming: 3 doc (") and lines[1].startswith("Streaming: 5 doc (")
    assert lines[-1].startswith("Streaming: 5 doc in ")


def test_a_terminal_gets_a_tqdm_bar_and_no_lines():
    stream = Terminal()
    with Progress(10, "Barred", unit="item", file=stream) as shown:
        shown.update(10)
    text = stream.getvalue()
    assert "\r" in text and "10/10" in text and percent_lines(text, "Barred") == []


@pytest.mark.parametrize("enabled, rank", [(False, "0"), (True, "1")])
def test_disabled_or_not_rank_zero_shows_nothing(monkeypatch, enabled, rank):
    monkeypatch.setenv("RANK", rank)
    for stream in (io.StringIO(), Terminal()):
        with Progress(4, "Quiet", file=stream, enabled=enabled) as shown:
            shown.update(4)
        assert stream.getvalue() == ""


def test_progress_over_an_iterable_takes_its_length(capsys):
    assert list(progress(range(20), "Iterating")) == list(range(20))
    assert_first_crossings(percent_lines(capsys.readouterr().err, "Iterating"))


# ---- where it is used ------------------------------------------------------------------------------------------------
def test_conversion_both_ways_reports_every_tensor(tmp_path, capsys):
    from safetensors import safe_open

    save_hf_model("llama", tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf")
    converted = len(load_state_dict(tmp_path / "hf" / "lit_model.pth"))
    lines = percent_lines(capsys.readouterr().err, "Converting weights")
    assert converted >= 10 and {total for _, _, total in lines} == {converted}
    assert_first_crossings(lines)

    convert_lit_checkpoint(tmp_path / "hf", tmp_path / "back")
    lines = percent_lines(capsys.readouterr().err, "Converting weights")
    with safe_open(str(tmp_path / "back" / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) >= converted  # q, k, v come from one fused tensor
    # Every litgpt tensor is counted once; a fused group counts all of its tensors at once.
    assert lines[-1] == (100, converted, converted)
    assert [p for p, _, _ in lines] == sorted(set(p for p, _, _ in lines))
    assert all(count * 100 >= percent * total for percent, count, total in lines)


def test_token_cache_build_reports_documents(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(token_cache, "ENCODE_BATCH", 4)  # a batch of 4 is 10 % of these 40 documents
    tokenizer = Tokenizer(make_tokenizer_folder(tmp_path / "tokenizer", "llama"))
    # The blank documents at the end are read, not tokenized: they count for the last 10 %.
    documents = [f"Story {i} about a fox." for i in range(36)] + ["   "] * 4
    source = tmp_path / "source.txt"
    source.write_text("x")
    cache = ensure_token_cache(Corpus("stories", [source], lambda: documents), tokenizer, tmp_path / "cache")
    lines = percent_lines(capsys.readouterr().err, "Tokenizing stories")
    assert {total for _, _, total in lines} == {len(documents)}
    assert_first_crossings(lines, step=4)
    assert cache.meta()["documents"] == sum(1 for d in documents if d.strip())

    # A stream (no length) is counted, with a last line of its total.
    monkeypatch.setattr(progress_module, "LINE_EVERY_SECONDS", 0.0)
    ensure_token_cache(Corpus("stream", [source], lambda: iter(documents)), tokenizer, tmp_path / "cache")
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"Tokenizing stream: {len(documents)} doc in ")


def test_calibration_reports_batches(capsys):
    from test_compress_moe import LENGTHS, TOKENS, routed_model

    from litgpt.compress_moe import collect_routing

    routing = collect_routing(routed_model(True), [(TOKENS, LENGTHS)] * 10)
    assert routing.num_samples == 10 * len(LENGTHS)
    assert_first_crossings(percent_lines(capsys.readouterr().err, "Calibrating the routing"))


def test_perplexity_windows_and_disable_tqdm(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from test_evaluate import requests
    from test_generate import write_lit_checkpoint

    from litgpt.evaluation.harness import HarnessModel
    from litgpt.generate import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(write_lit_checkpoint(tmp_path / "tiny", "llama", block_size=16),
                                                precision="32-true", device="cpu")
    lm = HarnessModel(model, tokenizer, batch_size=3, max_length=16)
    tokens = list(range(3, 3 + 150))
    with torch.inference_mode():
        scores = lm.rolling_scores(tokens, stride=8)
    lines = percent_lines(capsys.readouterr().err, "Scoring windows")
    assert {total for _, _, total in lines} == {len(scores)} and lines[-1][1] == len(scores)
    assert [p for p, _, _ in lines] == sorted(set(p for p, _, _ in lines))

    pairs = [("The sky is", " blue")] * 5
    lm.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)
    assert percent_lines(capsys.readouterr().err, "Loglikelihoods") == []
    lm.loglikelihood(requests("loglikelihood", pairs))
    assert percent_lines(capsys.readouterr().err, "Loglikelihoods")[-1] == (100, 5, 5)

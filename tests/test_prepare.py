"""`litgpt prepare`: text, JSONL and Parquet tokenized in parallel into litdata's optimized format, read back by
litdata's own StreamingDataset; continued after a kill; bad input in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from streaming_helpers import stories, tokenizer

from litgpt.__main__ import main as cli_main
from litgpt.data.tiny import TOKENIZER_DIR

pytest.importorskip("litdata")
ROOT = Path(__file__).resolve().parents[1]


def write_corpus(folder: Path, texts: int = 4, records: int = 30, rows: int = 40) -> list[str]:
    """Text files, a JSONL file and a Parquet file (two row groups) of stories; returns the documents in the order
    `litgpt prepare` reads them (files sorted by path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pool = stories()
    folder.mkdir(parents=True)
    by_file = {}
    for i in range(texts):
        (folder / f"t{i:03d}.txt").write_text(pool[i])
        by_file[f"t{i:03d}.txt"] = [pool[i]]
    if records:
        jsonl = pool[texts:texts + records]
        lines = [json.dumps({"id": i, "text": text}) + "\n" for i, text in enumerate(jsonl)]
        (folder / "j.jsonl").write_text("".join(lines))
        by_file["j.jsonl"] = jsonl
    if rows:
        parquet = pool[texts + records:texts + records + rows]
        pq.write_table(pa.table({"text": parquet}), folder / "p.parquet", row_group_size=max(1, rows // 2))
        by_file["p.parquet"] = parquet
    return [doc for name in sorted(by_file) for doc in by_file[name]]


def expected_ids(documents: list[str]) -> list[int]:
    return torch.cat([tokenizer().encode(doc, eos=True) for doc in documents]).tolist()


def litdata_tokens(folder: Path) -> list[int]:
    """Every token id of the folder, read by litdata's own reader (blocks of one token, in stored order)."""
    from litdata import StreamingDataset, TokensLoader

    dataset = StreamingDataset(str(folder), item_loader=TokensLoader(block_size=1), shuffle=False)
    return [int(dataset[i][0]) for i in range(len(dataset))]


def prepare(*args) -> subprocess.CompletedProcess:
    """`python -m litgpt prepare ARGS` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "litgpt", "prepare", *map(str, args)], cwd=ROOT, text=True,
                          capture_output=True, timeout=300)


def test_prepare_writes_what_litdatas_reader_reads(tmp_path, capfd):
    documents = write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    command = ["prepare", "--input_dir", str(tmp_path / "in"), "--output_dir", str(out), "--tokenizer_dir",
               str(TOKENIZER_DIR)]
    cli_main([*command, "--num_workers", "2", "--chunk_bytes", "8KB"])
    printed = capfd.readouterr()
    assert "Progress" in printed.err  # litdata's progress bar
    expected = expected_ids(documents)
    assert f"Prepared {out}: {len(expected):,} tokens." in printed.out
    # Two workers each write their share of the parts: the same tokens, in the order of each worker's chunks.
    assert sorted(litdata_tokens(out)) == sorted(expected)
    assert json.loads((out / "litgpt_tokenizer.json").read_text()) == {"vocab_size": 4096, "bos_id": 0, "eos_id": 1}
    cli_main(command)
    assert "is prepared already" in capfd.readouterr().out


@pytest.mark.slow
def test_prepare_killed_halfway_goes_on_to_the_same_folder(tmp_path):
    documents = write_corpus(tmp_path / "in", texts=150, records=0, rows=0)
    args = ["--input_dir", tmp_path / "in", "--output_dir", tmp_path / "out", "--tokenizer_dir", TOKENIZER_DIR,
            "--num_workers", "1", "--chunk_bytes", "2KB"]
    process = subprocess.Popen([sys.executable, "-m", "litgpt", "prepare", *map(str, args)], cwd=ROOT,
                               start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "out" / ".checkpoints" / "checkpoint-0.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            done = json.loads(checkpoint.read_text())["inputs_done"]
        except (OSError, ValueError, KeyError):
            done = 0
        if done >= 20:
            break
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert 20 <= done < 150 and not (tmp_path / "out" / "index.json").exists(), done
    result = prepare(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Continuing the interrupted run" in result.stdout
    assert litdata_tokens(tmp_path / "out") == expected_ids(documents)  # one worker: exactly the files' order


def test_a_text_field_that_does_not_exist_is_one_line(tmp_path, capsys):
    write_corpus(tmp_path / "in", texts=1, records=2, rows=2)
    with pytest.raises(SystemExit) as info:
        cli_main(["prepare", "--input_dir", str(tmp_path / "in"), "--output_dir", str(tmp_path / "out"),
                  "--tokenizer_dir", str(TOKENIZER_DIR), "--text_field", "body"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.count("\n") == 1
    assert f"'{tmp_path / 'in' / 'j.jsonl'}' has no field 'body' (its fields: id, text)" in err
    assert not (tmp_path / "out").exists()


def test_an_output_folder_of_another_tokenizer_is_refused_and_kept(tmp_path, capsys):
    write_corpus(tmp_path / "in", texts=1, records=0, rows=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "index.json").write_text(json.dumps({"chunks": [], "config": {}}))
    record = json.dumps({"vocab_size": 32000, "bos_id": 0, "eos_id": 1})
    (out / "litgpt_tokenizer.json").write_text(record)
    with pytest.raises(SystemExit) as info:
        cli_main(["prepare", "--input_dir", str(tmp_path / "in"), "--output_dir", str(out), "--tokenizer_dir",
                  str(TOKENIZER_DIR)])
    err = capsys.readouterr().err
    assert info.value.code == 1 and "was tokenized with another tokenizer (vocab_size 32000 there, 4096 here):" in err
    assert (out / "litgpt_tokenizer.json").read_text() == record

"""The experiment trackers (--logger_name, --logger.*): a tiny `litgpt pretrain` through the CLI for each, its records
read back with the tracker's own reader (the CSV file, TensorBoard's EventAccumulator, W&B's record protobuf of the
offline run file, MLflow's client): the command's arguments, every metric of every log line and metrics.json.
Bad settings stop the command with one line."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from litgpt.__main__ import main as cli_main
from litgpt.args import LoggerArgs
from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR
from litgpt.errors import UserError
from litgpt.loggers import build_logger

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 3
# What every log line holds (train/metrics.py's LogWindow).
LOG_LINE = {"loss", "lr", "tokens", "epoch", "tokens_per_sec", "peak_memory_mb"}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """A YAML recipe of a tiny pretraining run (a few seconds) on a folder of the bundled stories."""
    root = tmp_path_factory.mktemp("recipe")
    (root / "stories").mkdir()
    for i, story in enumerate((TINY_DIR / "train.txt").read_text().split("\n\n")[:40]):
        (root / "stories" / f"{i:02d}.txt").write_text(story)
    config = {
        "model_config": dict(name="logged", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=1,
                             n_embd=32, n_head=2, n_query_groups=1, intermediate_size=64),
        "data": {"class_path": "litgpt.data.TextFiles",
                 "init_args": {"train_data_path": str(root / "stories"), "cache_dir": str(root / "cache")}},
        "tokenizer_dir": str(TOKENIZER_DIR),
        "train": dict(global_batch_size=2, micro_batch_size=2, max_steps=STEPS, max_seq_length=32, lr_warmup_steps=1,
                      log_interval=1, save_interval=None),
        "eval": dict(interval=1000, max_iters=1),
        "devices": 1, "precision": "32-true", "compiler": "none",
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(config))
    return root / "recipe.yaml"


def pretrain(recipe: Path, out_dir: Path, *flags: str) -> dict:
    """Run `litgpt pretrain` in this process; returns the run's metrics.json."""
    cli_main(["pretrain", "--config", str(recipe), "--out_dir", str(out_dir), "--seed", "3", *flags])
    return json.loads((out_dir / "metrics.json").read_text())


def assert_logged(history: dict[str, dict[int, float]], metrics: dict) -> None:
    """`history` (metric -> step -> value, as a tracker gave them back) has every log line's metrics at every step
    and each number of metrics.json, as run/*, at the last."""
    for name in LOG_LINE:
        assert sorted(history[name]) == list(range(1, STEPS + 1)), name
    numbers = {name: value for name, value in metrics.items() if isinstance(value, (int, float))}
    assert {"steps", "tokens", "val_loss", "tokens_per_sec"} <= set(numbers)
    for name, value in numbers.items():
        assert history[f"run/{name}"] == {STEPS: pytest.approx(value, rel=1e-6)}, name


def test_csv_logs_arguments_every_step_and_the_final_metrics(recipe, tmp_path):
    metrics = pretrain(recipe, tmp_path / "out", "--logger_name", "csv", "--logger.name", "mine")
    folder = tmp_path / "out" / "logs" / "mine" / "version_0"
    history: dict[str, dict[int, float]] = {}
    with open(folder / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name != "step" and value != "":
                    history.setdefault(name, {})[int(row["step"])] = float(value)
    assert_logged(history, metrics)
    hparams = yaml.safe_load((folder / "hparams.yaml").read_text())
    assert hparams["train"]["max_steps"] == STEPS and hparams["seed"] == 3
    assert hparams["logger"]["init_args"]["name"] == "mine"


def test_tensorboard_records_read_back_with_its_event_accumulator(recipe, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = pretrain(recipe, tmp_path / "out", "--logger_name", "tensorboard")
    folder = tmp_path / "out" / "logs" / "pretrain-logged" / "version_0"
    events = EventAccumulator(str(folder))
    events.Reload()
    history = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert_logged(history, metrics)
    assert yaml.safe_load((folder / "hparams.yaml").read_text())["train"]["max_steps"] == STEPS


def wandb_records(run_file: Path) -> list:
    """The records of a W&B run file (`run-ID.wandb`), decoded with wandb's own `Record` protobuf. The file is a
    7-byte header, then LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte header (CRC, length, type:
    1 whole, 2 first, 3 middle, 4 last) and its bytes; a block's tail too short for a header is padding."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, position, pending, records = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def key(item) -> str:
    """A W&B config, history or summary item's name (newer wandb versions give it as the parts of a nested key)."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_holds_arguments_every_step_and_the_final_metrics(recipe, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    metrics = pretrain(recipe, tmp_path / "out", "--logger_name", "wandb", "--logger.project", "tiny",
                       "--logger.name", "first", "--logger.group", "g", "--logger.tags", "[a, b]")
    run_files = list((tmp_path / "out" / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    records = wandb_records(run_files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name, run.run_group, list(run.tags)) == ("tiny", "first", "g", ["a", "b"])
    config = {key(item): json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for item in r.config.update}
    assert config["train"]["max_steps"] == STEPS and config["seed"] == 3
    history: dict[str, dict[int, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {key(item): json.loads(item.value_json) for item in r.history.item}
            for name, value in row.items():
                history.setdefault(name, {})[row["trainer/global_step"]] = value
    assert_logged(history, metrics)
    summary = {key(item): json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for item in r.summary.update}
    assert summary["run/precision"] == metrics["precision"] == "32-true"  # metrics.json's text values too


@pytest.mark.parametrize("where", ["out_dir", "MLFLOW_TRACKING_URI"])
def test_mlflow_run_holds_arguments_every_step_and_the_final_metrics(where, recipe, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    if where == "MLFLOW_TRACKING_URI":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.chdir(tmp_path)  # such a store keeps artifacts in ./mlruns, as MLflow's default artifact root
    else:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        uri = f"sqlite:///{tmp_path / 'out' / 'mlruns' / 'mlflow.db'}"
    metrics = pretrain(recipe, tmp_path / "out", "--logger_name", "mlflow", "--logger.project", "tiny",
                       "--logger.name", "first", "--logger.tags", "[a]")
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.run_name == "first" and run.data.tags["a"] == ""
    assert run.data.params["train/max_steps"] == str(STEPS) and run.data.params["seed"] == "3"
    history = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
               for name in run.data.metrics}
    assert_logged(history, metrics)
    assert json.loads(Path(client.download_artifacts(run.info.run_id, "metrics.json", str(tmp_path))).read_text()) \
        == metrics


# ---- bad settings: one line, exit code 1 -----------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--logger_name", "nosuch"], 'Parser key "logger_name"'),
    (["--logger_name", "csv", "--logger.project", "p"],
     "--logger.project is not a setting of the csv logger: it takes --logger.name."),
    (["--logger_name", "mlflow", "--logger.entity", "team"],
     "--logger.entity is not a setting of the mlflow logger: it takes --logger.project, --logger.name, "
     "--logger.tags."),
    (["--logger_name", "wandb", "--logger.tags", "{a: 1}"], 'Parser key "logger.tags"'),
])
def test_bad_logger_settings_stop_the_command_in_one_line(flags, message, recipe, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--config", str(recipe), "--out_dir", str(tmp_path / "out"), *flags])
    assert info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_bad_settings_from_python_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="not one of csv, tensorboard, wandb, mlflow"):
        build_logger("nosuch", tmp_path, "run")
    with pytest.raises(UserError, match="--logger.tags 'a' must be a list of non-empty strings"):
        build_logger("wandb", tmp_path, "run", LoggerArgs(tags="a"))
    with pytest.raises(UserError, match="--logger.name 3 must be a non-empty string"):
        build_logger("csv", tmp_path, "run", LoggerArgs(name=3))


@pytest.mark.parametrize("tracker, package", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_tracker_names_the_pip_command(tracker, package, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
    with pytest.raises(UserError, match=f"needs .*: pip install {package}$"):
        build_logger(tracker, tmp_path, "run")


def test_wandb_without_a_login_stops_in_one_line(recipe, tmp_path):
    """Online W&B (the default) with no API key: one line that says how to log in or go offline. In a process of its
    own: wandb keeps the first run's settings (its mode) for the whole process."""
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env.update(WANDB_DIR=str(tmp_path / "wandb_dir"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
               NETRC=str(tmp_path / "no_netrc"), WANDB_SILENT="true")  # no stored login either
    done = subprocess.run([sys.executable, "-m", "litgpt", "pretrain", "--config", str(recipe), "--out_dir",
                           str(tmp_path / "out"), "--logger_name", "wandb"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "W&B could not start the run" in last and "WANDB_MODE=offline" in last and "Traceback" not in done.stderr

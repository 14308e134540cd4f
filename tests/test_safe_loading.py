"""Files from elsewhere never run code: planted pickles are refused through the real CLI, and Hugging Face weights
are read from safetensors whenever a folder has them."""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_helpers import write_random_checkpoint
from hf_models import save_hf_model

from litgpt.checkpoint.store import MANIFEST_FILE, read_manifest, TRAINING_STATE_FILE, write_manifest
from litgpt.io import load_state_dict
from litgpt.config import Config
from litgpt.data.tiny import TINY_DIR

ROOT = Path(__file__).resolve().parents[1]


class RunsCode:
    """Unpickling this runs a shell command that creates `marker`: a stand-in for what a malicious file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant(path: Path, marker: Path, tensors: dict | None = None) -> None:
    """Save `tensors` (or nothing) with a code-running object among them, as torch.save writes a checkpoint."""
    torch.save({**(tensors or {}), "payload": RunsCode(marker)}, path)


def litgpt(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "litgpt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def assert_refused(result: subprocess.CompletedProcess, marker: Path, file_name: str) -> None:
    """Exit code 1, one error line naming the file and saying it could not be loaded safely, no traceback, no marker."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, result.stderr
    assert "Could not load" in errors[0] and "safely" in errors[0] and file_name in errors[0], errors[0]
    assert not marker.exists(), "the planted pickle ran"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    config = Config(name="safe-loading", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=1, n_embd=32,
                    n_head=2, intermediate_size=64, prompt_style="alpaca")
    return write_random_checkpoint(tmp_path_factory.mktemp("base") / "ckpt", config)


def test_the_planted_pickle_runs_code_when_loaded_unsafely(tmp_path):
    """The control: without weights_only the plant does what it says, so its absence below means something."""
    marker = tmp_path / "marker"
    plant(tmp_path / "evil.pth", marker)
    torch.load(tmp_path / "evil.pth", weights_only=False)
    assert marker.exists()


def test_lit_model_pth_is_refused_by_generate(tmp_path, base):
    folder, marker = tmp_path / "ckpt", tmp_path / "marker"
    shutil.copytree(base, folder)
    plant(folder / "lit_model.pth", marker, dict(load_state_dict(base / "lit_model.pth")))
    assert_refused(litgpt("generate", folder, "--prompt", "Once", "--max_new_tokens", "2"), marker, "lit_model.pth")


def test_training_state_of_a_resumed_checkpoint_is_refused(tmp_path, base):
    """A real run's step checkpoint whose training_state.pth is replaced, its manifest rewritten to match (whoever
    planted the file can write the manifest too): `--resume` verifies the manifest, then must not unpickle."""
    data = tmp_path / "data.json"
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:8]
    data.write_text(json.dumps([{"instruction": "Go on.", "output": story[:60]} for story in stories]))
    run = ["finetune_full", base, "--out_dir", tmp_path / "out", "--data", "JSON", "--data.json_path", data,
           "--data.val_split_fraction", "0.25", "--train.global_batch_size", "1", "--train.micro_batch_size", "1",
           "--train.save_interval", "1", "--eval.max_iters", "1", "--eval.final_validation", "false"]
    first = litgpt(*run, "--train.max_steps", "1")
    assert first.returncode == 0, first.stderr
    step, marker = tmp_path / "out" / "step-000001", tmp_path / "marker"
    saved = torch.load(step / TRAINING_STATE_FILE, weights_only=True)
    plant(step / TRAINING_STATE_FILE, marker, saved)
    write_manifest(step, {key: value for key, value in read_manifest(step).items() if key != "files"})
    assert (step / MANIFEST_FILE).is_file()
    weights = (step / "lit_model.pth").read_bytes()

    assert_refused(litgpt(*run, "--train.max_steps", "2", "--resume", step), marker, TRAINING_STATE_FILE)
    assert_refused(litgpt(*run, "--train.max_steps", "2", "--resume", "auto"), marker, TRAINING_STATE_FILE)
    assert (step / "lit_model.pth").read_bytes() == weights and not (tmp_path / "out" / "step-000002").exists()


def test_pytorch_model_bin_is_refused_by_convert_to_litgpt(tmp_path):
    folder, marker = tmp_path / "hf", tmp_path / "marker"
    hf = save_hf_model("llama", folder)
    (folder / "model.safetensors").unlink()  # .bin is read only when there is no safetensors file
    plant(folder / "pytorch_model.bin", marker, hf.state_dict())
    assert_refused(litgpt("convert_to_litgpt", folder), marker, "pytorch_model.bin")
    assert not (folder / "lit_model.pth").exists()


def test_lora_adapters_are_refused_by_merge_lora(tmp_path, base):
    run, marker = tmp_path / "run", tmp_path / "marker"
    run.mkdir()
    plant(run / "lit_model.pth.lora", marker)
    hparams = {"checkpoint_dir": str(base), "lora_r": 4, "lora_alpha": 8}
    (run / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))
    assert_refused(litgpt("merge_lora", run), marker, "lit_model.pth.lora")
    assert not (run / "lit_model.pth").exists()


def test_sharded_checkpoint_metadata_is_refused_by_consolidate(tmp_path, base):
    """torch.distributed.checkpoint unpickles its .metadata file with plain pickle; litgpt checks it first."""
    import torch.distributed.checkpoint as dcp

    weights = dict(load_state_dict(base / "lit_model.pth"))
    good, bad, marker = tmp_path / "good", tmp_path / "bad", tmp_path / "marker"
    dcp.save({"model": weights}, checkpoint_id=good / "sharded", no_dist=True)
    result = litgpt("consolidate", good)  # a genuine sharded checkpoint still consolidates
    assert result.returncode == 0, result.stderr
    for key, tensor in load_state_dict(good / "lit_model.pth").items():
        torch.testing.assert_close(tensor, weights[key], rtol=0, atol=0)

    shutil.copytree(good, bad)
    (bad / "lit_model.pth").unlink()
    with open(bad / "sharded" / ".metadata", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    assert_refused(litgpt("consolidate", bad), marker, ".metadata")
    assert not (bad / "lit_model.pth").exists()


def test_every_checkpoint_io_refuses_planted_sharded_metadata(tmp_path):
    """The core's sharded reader (FSDP2) and the Thunder extension's read a sharded checkpoint's .metadata through the
    same restricted unpickler before torch.distributed.checkpoint would unpickle it."""
    import torch.distributed as dist

    from extensions.thunder.strategies import ThunderShards
    from litgpt.checkpoint.fsdp_io import FSDPCheckpointIO
    from litgpt.errors import UserError

    marker, folder = tmp_path / "marker", tmp_path / "step-000001"
    (folder / "sharded").mkdir(parents=True)
    with open(folder / "sharded" / ".metadata", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shapes = {name: param.shape for name, param in model.named_parameters()}
        for io in (FSDPCheckpointIO(), ThunderShards(model, shapes, "ZERO3", "sharded", {}, sharded=True)):
            with pytest.raises(UserError, match=r"Could not load .*\.metadata.* safely"):
                io.load_sharded(folder, model, optimizer, lambda key: True)
            assert not marker.exists(), f"the planted pickle ran in {type(io).__name__}"
    finally:
        dist.destroy_process_group()


def test_safetensors_are_read_when_a_planted_bin_sits_beside_them(tmp_path):
    """A folder with both formats converts from model.safetensors; the planted .bin is never opened."""
    from test_convert import load_lit, max_logit_diff

    folder, marker = tmp_path / "hf", tmp_path / "marker"
    hf = save_hf_model("llama", folder)
    plant(folder / "pytorch_model.bin", marker, hf.state_dict())
    result = litgpt("convert_to_litgpt", folder)
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    assert max_logit_diff(load_lit(folder), hf) <= 1e-4


def test_download_takes_only_safetensors_when_the_repo_has_both(tmp_path, monkeypatch):
    """From a Hugging Face cache whose repo holds model.safetensors and a planted pytorch_model.bin, `litgpt download`
    copies and converts the safetensors alone."""
    from test_download import COMMIT, _add_to_cache
    from tokenizer_helpers import make_tokenizer_folder

    source, marker = tmp_path / "source", tmp_path / "marker"
    make_tokenizer_folder(source, "gpt2")
    hf = save_hf_model("llama", source)
    plant(source / "pytorch_model.bin", marker, hf.state_dict())
    snapshot = _add_to_cache(tmp_path / "hf_home" / "hub", "org/both", source)
    assert snapshot.name == COMMIT and (snapshot / "pytorch_model.bin").is_file()
    result = subprocess.run(
        [sys.executable, "-m", "litgpt", "download", "org/both", "--checkpoint_dir", tmp_path / "checkpoints"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_CACHE": str(tmp_path / "hf_home" / "hub"),
             "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "checkpoints" / "org" / "both"
    assert (folder / "model.safetensors").is_file() and not (folder / "pytorch_model.bin").exists()
    assert not marker.exists()
    from test_convert import load_lit, max_logit_diff

    assert max_logit_diff(load_lit(folder), hf) <= 1e-4


def test_no_code_of_a_downloaded_repo_is_ever_run():
    """The library never asks transformers to trust a repo's code, nor imports a file from a model folder."""
    sources = sorted((ROOT / "litgpt").rglob("*.py"))
    offenders = [str(path) for path in sources if "trust_remote_code=True" in path.read_text()]
    assert not offenders
    loads = [
        (str(path.relative_to(ROOT)), line.strip())
        for path in sources
        for line in path.read_text().splitlines()
        if "torch.load(" in line and "weights_only=True" not in line
    ]
    assert not loads, loads

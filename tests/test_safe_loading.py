"""Files from elsewhere never run code: planted pickles are refused through the real CLI, and Hugging Face weights
are read from safetensors whenever a folder has them."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
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
from litgpt_forkserver import run_litgpt

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


def plant(path, marker: Path, tensors: dict | None = None) -> None:
    """Save `tensors` (or nothing) with a code-running object among them, as torch.save writes a checkpoint, to a
    path or a file object."""
    torch.save({**(tensors or {}), "payload": RunsCode(marker)}, path)


def litgpt(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m litgpt ARGS`, a process of its own forked from one that has imported torch and Lightning."""
    return run_litgpt(args, cwd=cwd, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def assert_refused(result: subprocess.CompletedProcess, marker: Path, file_name: str) -> None:
    """Exit code 1, one error line naming the file and saying it could not be loaded safely, no traceback, no marker."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, result.stderr
    assert "Could not load" in errors[0] and "safely" in errors[0] and file_name in errors[0], errors[0]
    assert not marker.exists(), "the planted pickle ran"


def base_checkpoint(root: Path) -> Path:
    """A tiny random model's checkpoint folder in `root`."""
    config = Config(name="safe-loading", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=1, n_embd=32,
                    n_head=2, intermediate_size=64, prompt_style="alpaca")
    return write_random_checkpoint(root / "ckpt", config)


def finetune_command(root: Path, base: Path) -> list:
    """The command line of a one-process finetune_full of `base` on a few stories, saving a checkpoint every step."""
    data = root / "data.json"
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:8]
    data.write_text(json.dumps([{"instruction": "Go on.", "output": story[:60]} for story in stories]))
    return ["finetune_full", base, "--data", "JSON", "--data.json_path", data, "--data.val_split_fraction", "0.25",
            "--data.prompt_style", "default", "--train.global_batch_size", "1", "--train.micro_batch_size", "1",
            "--train.save_interval", "1", "--eval.max_iters", "1", "--eval.final_validation", "false"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return base_checkpoint(tmp_path_factory.mktemp("base"))


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


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory, base) -> list:
    return finetune_command(tmp_path_factory.mktemp("finetune"), base)


def test_training_state_of_a_resumed_checkpoint_is_refused(tmp_path, finetune_run):
    """A real run's step checkpoint whose training_state.pth is replaced, its manifest rewritten to match (whoever
    planted the file can write the manifest too): `--resume` verifies the manifest, then must not unpickle."""
    run = [*finetune_run, "--out_dir", tmp_path / "out"]
    first = litgpt(*run, "--train.max_steps", "1")
    assert first.returncode == 0, first.stderr
    step, marker = tmp_path / "out" / "step-000001", tmp_path / "marker"
    saved = torch.load(step / TRAINING_STATE_FILE, weights_only=True)
    plant(step / TRAINING_STATE_FILE, marker, saved)
    rewrite_manifest(step)
    weights = (step / "lit_model.pth").read_bytes()

    assert_refused(litgpt(*run, "--train.max_steps", "2", "--resume", step), marker, TRAINING_STATE_FILE)
    assert_refused(litgpt(*run, "--train.max_steps", "2", "--resume", "auto"), marker, TRAINING_STATE_FILE)
    assert (step / "lit_model.pth").read_bytes() == weights and not (tmp_path / "out" / "step-000002").exists()


def rewrite_manifest(step: Path) -> None:
    """Hash the step folder's files anew, as whoever planted a file there can."""
    write_manifest(step, {key: value for key, value in read_manifest(step).items() if key != "files"})
    assert (step / MANIFEST_FILE).is_file()


@pytest.fixture(scope="module")
def sharded_step(tmp_path_factory, finetune_run) -> Path:
    """Step 1 of a one-process run, rewritten as a sharded checkpoint (DCP's format, which only multi-process runs
    write) by the core's own writer: resuming it on one process reads it as it reads any world size's."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, StateDictOptions

    from litgpt.checkpoint.fsdp_io import FSDPCheckpointIO
    from litgpt.model import GPT

    out_dir = tmp_path_factory.mktemp("sharded") / "out"
    result = litgpt(*finetune_run, "--out_dir", out_dir, "--train.max_steps", "1")
    assert result.returncode == 0, result.stderr
    step = out_dir / "step-000001"
    model = GPT(Config.from_file(step / "model_config.yaml"))
    model.load_state_dict(load_state_dict(step / "lit_model.pth"))
    optimizer = torch.optim.AdamW(model.parameters())
    training_state = torch.load(step / TRAINING_STATE_FILE, weights_only=True)
    set_optimizer_state_dict(model, optimizer, training_state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    FSDPCheckpointIO().save_sharded(step, model, optimizer, lambda key: True)
    (step / "lit_model.pth").unlink()
    torch.save({**training_state, "optimizer": None, "state_dict_type": "sharded"}, step / TRAINING_STATE_FILE)
    info = {key: value for key, value in read_manifest(step).items() if key != "files"}
    write_manifest(step, {**info, "state_dict_type": "sharded"})
    return step


def plant_in_sharded(sharded: Path, marker: Path, place: str, tensor: str = "model.transformer.wte.weight") -> str:
    """Plant a code-running pickle in a sharded checkpoint folder; returns the name of the file it is in.

    `.metadata`: the metadata itself. `bytes item`: appended to a .distcp file, the metadata of a bytes item (the
    optimizer's learning rate, a pickled float) pointed at it. `pointed file`: a new file beside the others, a tensor
    item's metadata pointed at it. `outside`: a tensor item's metadata pointed at a file in another folder.
    """
    from litgpt.io import read_sharded_metadata

    if place == ".metadata":
        with open(sharded / ".metadata", "wb") as f:
            pickle.dump(RunsCode(marker), f)
        return ".metadata"
    metadata = read_sharded_metadata(sharded)
    bytes_keys = {key.fqn for key in metadata.storage_data if key.offset is None}
    fqn = "optimizer.param_groups.0.lr" if place == "bytes item" else tensor
    assert (fqn in bytes_keys) == (place == "bytes item"), sorted(bytes_keys)
    (key,) = [key for key in metadata.storage_data if key.fqn == fqn]
    payload = io.BytesIO()
    plant(payload, marker)
    info = metadata.storage_data[key]
    if place == "bytes item":
        target = sharded / info.relative_path
        offset = target.stat().st_size
    else:
        target = sharded / "extra.distcp" if place == "pointed file" else sharded.parent.parent / "outside.distcp"
        offset = 0
    with open(target, "ab") as f:
        f.write(payload.getvalue())
    relative = target.name if place != "outside" else f"../../{target.name}"
    metadata.storage_data[key] = dataclasses.replace(info, relative_path=relative, offset=offset,
                                                     length=len(payload.getvalue()))
    with open(sharded / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return ".metadata" if place == "outside" else target.name


# One planted file by default; the other places (a resumed run each) with the whole suite (CI).
@pytest.mark.parametrize("place", [".metadata", *(pytest.param(place, marks=pytest.mark.slow)
                                                  for place in ("bytes item", "pointed file", "outside"))])
def test_planted_sharded_checkpoint_is_refused_at_resume(place, tmp_path, sharded_step, finetune_run):
    """Every file DCP reads at `--resume` of a sharded checkpoint is read weights-only, with the manifest rewritten
    to match the planted files."""
    step, marker = tmp_path / "out" / "step-000001", tmp_path / "marker"
    shutil.copytree(sharded_step.parent, tmp_path / "out")
    name = plant_in_sharded(step / "sharded", marker, place)
    rewrite_manifest(step)
    run = [*finetune_run, "--out_dir", tmp_path / "out", "--fsdp.state_dict_type", "sharded"]
    assert_refused(litgpt(*run, "--train.max_steps", "2", "--resume", step), marker, name)
    assert not (tmp_path / "out" / "step-000002").exists()


@pytest.mark.parametrize("place", ["pointed file", "outside"])
def test_planted_sharded_checkpoint_is_refused_by_consolidate(place, tmp_path, sharded_step):
    """`consolidate` reads the model's tensor items only: a planted file behind one of them is refused too."""
    step, marker = tmp_path / "out" / "step-000001", tmp_path / "marker"
    shutil.copytree(sharded_step.parent, tmp_path / "out")
    name = plant_in_sharded(step / "sharded", marker, place)
    assert_refused(litgpt("consolidate", step), marker, name)
    assert not (step / "lit_model.pth").exists()


@pytest.mark.slow
def test_a_genuine_sharded_checkpoint_resumes_weights_only(tmp_path, sharded_step, finetune_run):
    """The control for the refusals above: the same checkpoint, untouched, resumes (its bytes items, the optimizer's
    param_groups, hold nothing that weights-only loading refuses) and continues as an uninterrupted run does."""
    shutil.copytree(sharded_step.parent, tmp_path / "out")
    run = [*finetune_run, "--out_dir", tmp_path / "out", "--fsdp.state_dict_type", "sharded", "--train.max_steps", "2"]
    resumed = litgpt(*run, "--resume", tmp_path / "out" / "step-000001")
    assert resumed.returncode == 0, resumed.stderr
    assert "nothing was learned" not in resumed.stdout + resumed.stderr
    straight = litgpt(*[a if a != tmp_path / "out" else tmp_path / "straight" for a in run])
    assert straight.returncode == 0, straight.stderr
    ours, theirs = (load_state_dict(folder / "final" / "lit_model.pth") for folder in (tmp_path / "out",
                                                                                       tmp_path / "straight"))
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6, msg=key)


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


@pytest.mark.parametrize("place", [".metadata", "bytes item", "outside"])
def test_every_checkpoint_io_refuses_a_planted_sharded_checkpoint(place, tmp_path):
    """The core's sharded reader (FSDP2) and the Thunder extension's, each on a checkpoint it wrote itself, refuse a
    planted .metadata, a planted bytes item (the optimizer's param_groups) and metadata pointing outside the folder,
    and load the untouched checkpoint."""
    import torch.distributed as dist

    from extensions.thunder.strategies import ThunderShards
    from litgpt.checkpoint.fsdp_io import FSDPCheckpointIO
    from litgpt.errors import UserError

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shapes = {name: param.shape for name, param in model.named_parameters()}
        for io_ in (FSDPCheckpointIO(), ThunderShards(model, shapes, "ZERO3", "sharded", {}, sharded=True)):
            good, bad = tmp_path / type(io_).__name__ / "good", tmp_path / type(io_).__name__ / "bad"
            io_.save_sharded(good, model, optimizer, lambda key: True)
            shutil.copytree(good, bad)
            marker = tmp_path / f"marker-{type(io_).__name__}"
            name = plant_in_sharded(bad / "sharded", marker, place, tensor="model.weight")
            with pytest.raises(UserError, match=rf"Could not load .*{re.escape(name)}.* safely"):
                io_.load_sharded(bad, model, optimizer, lambda key: True)
            assert not marker.exists(), f"the planted pickle ran in {type(io_).__name__}"
            io_.load_sharded(good, model, optimizer, lambda key: True)  # the control: the genuine one loads
            assert optimizer.param_groups[0]["lr"] == 0.1
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
    """A cheap static check beside the tests above: the library never asks transformers to trust a repo's code,
    every torch.load is weights-only, and torch.distributed.checkpoint is read only through litgpt's reader."""
    sources = sorted([*(ROOT / "litgpt").rglob("*.py"), *(ROOT / "extensions").rglob("*.py")])
    texts = {str(path.relative_to(ROOT)): path.read_text() for path in sources}
    assert not [name for name, text in texts.items() if "trust_remote_code=True" in text]
    loads = [(name, line.strip()) for name, text in texts.items() for line in text.splitlines()
             if "torch.load(" in line and "weights_only=True" not in line]
    assert not loads, loads
    unsafe_reads = [(name, call) for name, text in texts.items() for call in ("dcp.load(", "FileSystemReader(",
                                                                              "pickle.load(", "pickle.loads(")
                    if call in text and name != "litgpt/checkpoint/sharded_reader.py"]
    assert not unsafe_reads, unsafe_reads

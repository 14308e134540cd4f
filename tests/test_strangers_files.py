"""Files from elsewhere name only files in their own folder and import only installed code: a weight index, a run's
manifest and a tokenizer config that point outside, and class paths in a --config YAML or on the command line that
name a module lying in the working directory, are each refused in one line with exit code 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_helpers import write_random_checkpoint
from hf_models import save_hf_model
from litgpt_forkserver import run_litgpt

from litgpt.checkpoint.store import MANIFEST_FILE, TRAINING_STATE_FILE, write_manifest
from litgpt.class_paths import check_class_paths, may_import
from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.io import file_sha256
from litgpt.safe_paths import inside

ROOT = Path(__file__).resolve().parents[1]
INDEX_FILE = "model.safetensors.index.json"


def litgpt(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return run_litgpt(args, cwd=cwd, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def assert_one_line_refusal(result: subprocess.CompletedProcess, *named: str) -> str:
    """Exit code 1, no traceback, exactly one error line, and it names each of `named`."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, result.stderr
    for name in named:
        assert name in errors[0], errors[0]
    return errors[0]


def outside_names(folder: Path, outside_file: Path) -> dict[str, str]:
    """The three ways out of `folder` towards `outside_file`, each as the name a file would list: a `..` path, an
    absolute path, and a symlink planted in the folder that leads out."""
    (folder / "link.bin").symlink_to(outside_file)
    return {"dotdot": os.path.relpath(outside_file, folder), "absolute": str(outside_file), "symlink": "link.bin"}


# ---- the helper ------------------------------------------------------------------------------------------------------
def test_inside_keeps_names_in_the_folder_and_refuses_each_way_out(tmp_path):
    folder, secret = tmp_path / "folder", tmp_path / "secret.txt"
    (folder / "sub").mkdir(parents=True)
    secret.write_text("not yours")
    (folder / "sub" / "shard.bin").write_text("ok")
    (folder / "inner.bin").symlink_to(folder / "sub" / "shard.bin")  # a symlink that stays inside is fine
    source = folder / "index.json"
    assert inside(folder, "sub/shard.bin", source) == folder / "sub" / "shard.bin"
    assert inside(folder, "inner.bin", source) == folder / "inner.bin"
    for name in [*outside_names(folder, secret).values(), "sub/../../secret.txt", "", None, 3]:
        with pytest.raises(UserError, match="is not inside its folder") as refused:
            inside(folder, name, source)
        assert "\n" not in str(refused.value) and str(source) in str(refused.value)


def test_a_hugging_face_cache_snapshot_may_link_into_its_blobs(tmp_path):
    """The hub client's own layout: a snapshot's files are symlinks into ../../blobs; elsewhere they stay refused."""
    repo = tmp_path / "models--org--name"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "0123").write_text("weights")
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/0123"))
    source = snapshot / "model.safetensors.index.json"
    assert inside(snapshot, "model.safetensors", source) == snapshot / "model.safetensors"
    with pytest.raises(UserError, match="is not inside its folder"):
        inside(snapshot, "../../blobs/0123", source)  # a name that climbs is refused even there
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(blobs / "0123")
    with pytest.raises(UserError, match="is not inside its folder"):
        inside(plain, "model.safetensors", plain / "index.json")


# ---- a Hugging Face weight index -------------------------------------------------------------------------------------
@pytest.mark.parametrize("way", ["dotdot", "absolute", "symlink"])
def test_a_weight_index_naming_a_file_outside_its_folder_is_refused(way, tmp_path):
    """The shard outside is a genuine copy of the weights, so following the index would convert without a word."""
    folder = tmp_path / "hf"
    save_hf_model("llama", folder)
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    name = outside_names(folder, outside)[way]
    from safetensors import safe_open

    with safe_open(outside, "pt") as f:
        weight_map = {key: name for key in f.keys()}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    result = litgpt("convert_to_litgpt", folder)
    assert_one_line_refusal(result, INDEX_FILE, repr(name), "not inside its folder")
    assert not (folder / "lit_model.pth").exists()


# ---- a run's manifest ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    config = Config(name="strangers", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=1, n_embd=32,
                    n_head=2, intermediate_size=64, prompt_style="alpaca")
    return write_random_checkpoint(tmp_path_factory.mktemp("base") / "ckpt", config)


@pytest.mark.parametrize("way", ["dotdot", "absolute", "symlink"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused_at_resume(way, tmp_path, base):
    """A step folder whose manifest lists a file outside it, with that file's true size and SHA-256 (whoever wrote
    the manifest can hash): `--resume PATH` and `--resume auto` refuse it without reading the file."""
    out_dir = tmp_path / "out"
    step = out_dir / "step-000001"
    step.mkdir(parents=True)
    for file in base.iterdir():
        (step / file.name).write_bytes(file.read_bytes())
    torch.save({"step": 1}, step / TRAINING_STATE_FILE)
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's own file")
    name = outside_names(step, secret)[way]
    write_manifest(step, {"step": 1})
    manifest = json.loads((step / MANIFEST_FILE).read_text())
    manifest["files"].pop("link.bin", None)
    manifest["files"][name] = {"bytes": secret.stat().st_size, "sha256": file_sha256(secret)}
    (step / MANIFEST_FILE).write_text(json.dumps(manifest))

    command = ["finetune_full", base, "--out_dir", out_dir, "--data", "Alpaca"]
    for resume in (step, "auto"):
        result = litgpt(*command, "--resume", resume)
        assert_one_line_refusal(result, MANIFEST_FILE, repr(name), "not inside its folder")
    assert not (out_dir / "step-000002").exists()


# ---- a tokenizer config ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("way", ["dotdot", "absolute", "symlink"])
def test_a_tokenizer_config_naming_a_file_outside_its_folder_is_refused(way, tmp_path, base):
    """A folder with only a sentencepiece tokenizer.model is converted by transformers, which older versions let a
    `vocab_file` of tokenizer_config.json point anywhere."""
    pytest.importorskip("transformers")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for file in ("lit_model.pth", "model_config.yaml"):
        (folder / file).write_bytes((base / file).read_bytes())
    (folder / "tokenizer.model").write_bytes(b"")
    secret = tmp_path / "secret.model"
    secret.write_bytes(b"")
    name = outside_names(folder, secret)[way]
    (folder / "tokenizer_config.json").write_text(json.dumps({"vocab_file": name}))

    result = litgpt("generate", folder, "--prompt", "Once", "--max_new_tokens", "1")
    assert_one_line_refusal(result, "tokenizer_config.json", repr(name), "not inside its folder")


# ---- class paths -----------------------------------------------------------------------------------------------------
def plant_module(folder: Path) -> Path:
    """evilmod.py in `folder`: importing it writes the marker it returns (what a malicious module would do)."""
    marker = folder / "imported"
    (folder / "evilmod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\nclass Data:\n    pass\n"
    )
    return marker


def python_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """`python ARGS` in `folder`, where `import NAME` finds NAME.py of the folder (as a user's shell would)."""
    return subprocess.run([sys.executable, *args], cwd=folder, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_parser_imports_a_class_path_of_a_config_unless_we_check_it_first(tmp_path):
    """The control: jsonargparse alone imports the planted module, so its marker's absence below means something."""
    marker = plant_module(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"data": {"class_path": "evilmod.Data"}}))
    python_in(tmp_path, "-c", "from jsonargparse import CLI; from litgpt.finetune.lora import setup; "
                              "CLI(setup, args=['--config', 'config.yaml'], exit_on_error=False)")
    assert marker.exists()


CLASS_PATH_CASES = {
    "config data mapping": ({"data": {"class_path": "evilmod.Data", "init_args": {}}}, [], "--data 'evilmod.Data'"),
    "config data string": ({"data": "evilmod.Data"}, [], "--data 'evilmod.Data'"),
    "config data file": ({"data": "data.yaml"}, [], "--data 'evilmod.Data'"),
    "config standard library": ({"data": {"class_path": "subprocess.Popen"}}, [], "--data 'subprocess.Popen'"),
    "flag data": (None, ["--data", "evilmod.Data"], "--data 'evilmod.Data'"),
    "flag data file": (None, ["--data", "data.yaml"], "--data 'evilmod.Data'"),
    "flag data mapping": (None, ["--data={class_path: evilmod.Data}"], "--data 'evilmod.Data'"),
    "flag data class_path": (None, ["--data.class_path", "evilmod.Data"], "--data 'evilmod.Data'"),
}


@pytest.mark.parametrize("case", CLASS_PATH_CASES)
def test_a_class_path_outside_installed_code_is_refused_before_it_is_imported(case, tmp_path):
    config, flags, named = CLASS_PATH_CASES[case]
    marker = plant_module(tmp_path)
    (tmp_path / "data.yaml").write_text(yaml.safe_dump({"class_path": "evilmod.Data"}))
    args = flags
    if config is not None:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        args = ["--config", "config.yaml"]
    result = python_in(tmp_path, "-m", "litgpt", "finetune_lora", "checkpoints/any", *args)
    assert_one_line_refusal(result, named)
    assert not marker.exists(), "the planted module was imported"


def test_a_module_named_after_a_distribution_that_does_not_provide_it_is_refused():
    """PyYAML (a requirement of jsonargparse) provides `yaml`, not `pyyaml`: the names a distribution provides
    decide, not its name."""
    assert may_import("yaml.loader") and may_import("torch.optim") and may_import("litgpt.data")
    for name in ("pyyaml", "pyyaml.loader", "os.path", "evilmod"):
        assert not may_import(name), name
    with pytest.raises(UserError, match="'pyyaml' is neither"):
        check_class_paths(["--data", "pyyaml.Data"])


def test_class_paths_of_litgpt_and_installed_packages_pass(tmp_path):
    """The check lets LitGPT's own recipes through: short names, litgpt's modules, torch's optimizers, data files."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "data": {"class_path": "litgpt.data.JSON", "init_args": {"json_path": "train.json"}},
        "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}},
    }))
    check_class_paths(["--config", str(tmp_path / "config.yaml"), "--data", "Alpaca", "--optimizer", "AdamW",
                       "--data.json_path", "data/train.json"])

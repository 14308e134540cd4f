"""`litgpt download` against a real offline Hugging Face cache built in a temporary folder."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from litgpt.download import _pick_weights, download
from litgpt.errors import UserError
from tokenizer_helpers import make_tokenizer_folder

REPO_ID = "org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[1]


def _add_to_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """Lay out `source`'s files as huggingface_hub caches a repo: content-addressed blobs, a snapshot folder of
    relative symlinks to them, and refs/main naming the snapshot's commit."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    for path in sorted(source.iterdir()):
        data = path.read_bytes()
        # Large (LFS) files are stored under their sha256, small ones under their git blob sha1.
        if path.suffix in (".safetensors", ".bin"):
            blob = hashlib.sha256(data).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (storage / "blobs" / blob).write_bytes(data)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A cache holding REPO_ID: a tiny random LlamaForCausalLM (safetensors and .bin) and a llama-style tokenizer."""
    import transformers
    import torch

    source = make_tokenizer_folder(tmp_path_factory.mktemp("source"), "llama")
    vocab_size = len(transformers.AutoTokenizer.from_pretrained(source))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")
    (source / "README.md").write_text("# tiny llama\n")
    home = tmp_path_factory.mktemp("hf_home")
    _add_to_cache(home / "hub", REPO_ID, source)
    return home


@pytest.fixture
def offline(hub_cache, monkeypatch) -> dict[str, str]:
    """Point huggingface_hub at the test cache, offline; returns the environment for a subprocess."""
    from huggingface_hub import constants

    cache = hub_cache / "hub"
    monkeypatch.setenv("HF_HOME", str(hub_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # huggingface_hub reads the environment when it is imported, so set what it read too.
    monkeypatch.setattr(constants, "HF_HOME", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return dict(os.environ)


def test_download_from_the_offline_cache_and_convert(tmp_path, offline):
    download(REPO_ID, checkpoint_dir=tmp_path)
    folder = tmp_path / "org" / "tiny-llama"
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    assert "pytorch_model.bin" not in names  # safetensors win when the repo has both
    assert "README.md" not in names
    assert not (folder / "model.safetensors").is_symlink()
    # The conversion wrote the litgpt checkpoint beside the files.
    assert (folder / "lit_model.pth").is_file()
    assert (folder / "model_config.yaml").is_file()

    from litgpt.tokenizer import Tokenizer

    assert Tokenizer(folder).encode("hello").tolist()[0] == 1


def test_tokenizer_only_fetches_no_weights(tmp_path, offline):
    download(REPO_ID, checkpoint_dir=tmp_path, tokenizer_only=True)
    names = {p.name for p in (tmp_path / REPO_ID).iterdir()}
    assert "tokenizer.json" in names and "config.json" in names
    assert not any(name.endswith((".safetensors", ".bin", ".pth")) for name in names)


def test_download_without_conversion(tmp_path, offline):
    download(REPO_ID, checkpoint_dir=tmp_path, convert_checkpoint=False)
    names = {p.name for p in (tmp_path / REPO_ID).iterdir()}
    assert "model.safetensors" in names and "lit_model.pth" not in names


def test_bin_weights_when_the_repo_has_no_safetensors(tmp_path, hub_cache, offline):
    from huggingface_hub import constants

    source = tmp_path / "source"
    source.mkdir()
    snapshot = hub_cache / "hub" / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / COMMIT
    for name in ("config.json", "pytorch_model.bin", "tokenizer.json", "training_args.bin"):
        (source / name).write_bytes((snapshot / name).read_bytes() if (snapshot / name).exists() else b"x")
    cache = tmp_path / "cache"
    _add_to_cache(cache, "org/bin-only", source)
    constants.HF_HUB_CACHE = str(cache)  # undone by the `offline` fixture's monkeypatch
    download("org/bin-only", checkpoint_dir=tmp_path / "out", convert_checkpoint=False)
    names = {p.name for p in (tmp_path / "out" / "org" / "bin-only").iterdir()}
    assert names == {"config.json", "pytorch_model.bin", "tokenizer.json"}


def test_earlier_download_is_reused_offline(tmp_path, offline):
    download(REPO_ID, checkpoint_dir=tmp_path, convert_checkpoint=False)
    from huggingface_hub import constants

    constants.HF_HUB_CACHE = str(tmp_path / "empty-cache")  # the cache is gone, the checkpoint folder is not
    download(REPO_ID, checkpoint_dir=tmp_path, convert_checkpoint=False)
    with pytest.raises(UserError, match="not in the local Hugging Face cache"):
        download(REPO_ID, checkpoint_dir=tmp_path / "elsewhere", convert_checkpoint=False)


def test_unknown_repo_offline(tmp_path, offline):
    with pytest.raises(UserError, match=r"org/unknown is not in the local Hugging Face cache.*HF_HUB_OFFLINE"):
        download("org/unknown", checkpoint_dir=tmp_path)
    assert not (tmp_path / "org" / "unknown").exists()


def test_invalid_repo_ids(tmp_path, offline, monkeypatch):
    fake = types.ModuleType("litgpt.configs")
    fake.configs_by_name = lambda: {"tiny-llama": {"hf_config": {"org": "org", "name": "tiny-llama"}}}
    monkeypatch.setitem(sys.modules, "litgpt.configs", fake)
    with pytest.raises(UserError, match="not a valid Hugging Face repo id"):
        download("org/bad name", checkpoint_dir=tmp_path)
    with pytest.raises(UserError, match=r"not a Hugging Face repo id \(ORG/NAME\).*Did you mean 'tiny-llama'"):
        download("tiny-lama", checkpoint_dir=tmp_path)
    # A registered name stands for its repo.
    download("tiny-llama", checkpoint_dir=tmp_path, tokenizer_only=True)
    assert (tmp_path / REPO_ID / "tokenizer.json").is_file()


def test_bad_conversion_options_fail_before_downloading(tmp_path, offline):
    with pytest.raises(UserError, match="--dtype 'float8'"):
        download(REPO_ID, checkpoint_dir=tmp_path, dtype="float8")
    assert not (tmp_path / "org").exists()


def test_list_prints_registered_names(monkeypatch, capsys):
    fake = types.ModuleType("litgpt.configs")
    fake.configs_by_name = lambda: {
        "pythia-14m": {"hf_config": {"org": "EleutherAI", "name": "pythia-14m"}},
        "Llama-3.2-1B": {"hf_config": {"org": "meta-llama", "name": "Llama-3.2-1B"}},
    }
    fake.configs_by_family = lambda: [("Pythia", ["pythia-14m"]), ("Llama", ["Llama-3.2-1B"])]
    fake.litgpt_names = lambda: {"Llama-3.2-1b": "Llama-3.2-1B"}
    monkeypatch.setitem(sys.modules, "litgpt.configs", fake)
    download("list")
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "", "Pythia:", "  pythia-14m    EleutherAI/pythia-14m",
        "", "Llama:", "  Llama-3.2-1B  meta-llama/Llama-3.2-1B  (LitGPT: Llama-3.2-1b)",
    ]


def test_list_with_the_real_registry(capsys):
    import litgpt.configs as configs

    download("list")
    out = capsys.readouterr().out
    for name in configs.configs_by_name():
        assert f"  {name} " in out
    # By family, each under its module's title; LitGPT's other spellings beside the names.
    assert "\nTII Falcon3 (Llama architecture):\n  Falcon3-1B-Base " in out
    assert "(LitGPT: Gemma-2-2b)" in out and "(LitGPT: Llama-3-8B)" in out


def test_pick_weights():
    assert _pick_weights(["model.safetensors", "pytorch_model.bin", "README.md"]) == ["model.safetensors"]
    sharded = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    mistral = sharded + ["consolidated.safetensors", "params.json", "original/consolidated.00.pth"]
    assert _pick_weights(mistral) == sorted(sharded)
    assert _pick_weights(["pytorch_model.bin", "training_args.bin"]) == ["pytorch_model.bin"]
    bins = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json"]
    assert _pick_weights(bins) == bins
    assert _pick_weights(["weights.safetensors", "adapter_model.safetensors"]) == ["weights.safetensors"]
    assert _pick_weights(["model.gguf", "config.json"]) == []


def test_cli(tmp_path, offline):
    command = [sys.executable, "-m", "litgpt", "download"]
    done = subprocess.run(
        command + [REPO_ID, "--checkpoint_dir", str(tmp_path)], env=offline, capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / REPO_ID / "model.safetensors").is_file()
    assert (tmp_path / REPO_ID / "lit_model.pth").is_file()

    done = subprocess.run(
        command + ["org/does-not-exist", "--checkpoint_dir", str(tmp_path)],
        env=offline,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "org/does-not-exist is not in the local Hugging Face cache" in done.stderr


# ---- against a stand-in for the hub --------------------------------------------------------------------------------
def _hub_error(cls, status: int):
    """A huggingface_hub HTTP error as raised for a response with `status` (without building a real response)."""
    error = cls.__new__(cls)
    Exception.__init__(error, f"{status} Client Error")
    error.response = types.SimpleNamespace(status_code=status)
    return error


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """Replace the hub's file listing and snapshot_download; record what download() asks for."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub = types.SimpleNamespace(files=[], error=None, calls=[])

    def list_repo_files(self, repo_id, token=None, **kwargs):
        if hub.error is not None:
            raise hub.error
        return list(hub.files)

    def snapshot_download(repo_id, *, local_dir, allow_patterns, token=None, **kwargs):
        hub.calls.append(
            {"repo_id": repo_id, "local_dir": Path(local_dir), "allow_patterns": allow_patterns, "token": token}
        )
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        for pattern in allow_patterns:
            (Path(local_dir) / pattern).write_text("x")
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return hub


def test_online_download_asks_for_safetensors_config_and_tokenizer(tmp_path, fake_hub, monkeypatch):
    fake_hub.files = [
        ".gitattributes", "README.md", "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
        "consolidated.safetensors", "original/consolidated.00.pth", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "tokenizer.model",
    ]
    url = "https://huggingface.co/org/name"
    download(url, checkpoint_dir=tmp_path, access_token="hf_given", convert_checkpoint=False)
    (call,) = fake_hub.calls
    assert call["repo_id"] == "org/name" and call["local_dir"] == tmp_path / "org" / "name"
    assert call["token"] == "hf_given"
    assert sorted(call["allow_patterns"]) == sorted([
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "tokenizer.model", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ])
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    download("org/name", checkpoint_dir=tmp_path, tokenizer_only=True)
    assert fake_hub.calls[-1]["token"] == "hf_from_env"
    assert not any(p.endswith((".safetensors", ".bin")) for p in fake_hub.calls[-1]["allow_patterns"])


@pytest.mark.parametrize(
    ("name", "repo"),
    [
        ("Llama-3-8B", "meta-llama/Meta-Llama-3-8B"),  # LitGPT's spelling of Meta-Llama-3-8B
        ("Gemma-2-9b-it", "google/gemma-2-9b-it"),  # of gemma-2-9b-it
        ("R1-Distill-Llama-8B", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"),
        ("Mistral-7B-v0.2", "unsloth/Mistral-7B-v0.2"),
        ("Mathstral-7B-v0.1", "mistralai/mathstral-7B-v0.1"),
    ],
)
def test_litgpt_names_download_their_repo(tmp_path, fake_hub, name, repo):
    fake_hub.files = ["config.json", "model.safetensors", "tokenizer.json"]
    download(name, checkpoint_dir=tmp_path, convert_checkpoint=False)
    (call,) = fake_hub.calls
    assert call["repo_id"] == repo and call["local_dir"] == tmp_path / repo


def test_online_repo_without_weights(tmp_path, fake_hub):
    fake_hub.files = ["config.json", "model.Q4_K_M.gguf", "tokenizer.json"]
    with pytest.raises(UserError, match=r"no model weights.*model\.Q4_K_M\.gguf.*--tokenizer_only"):
        download("org/name", checkpoint_dir=tmp_path)
    assert fake_hub.calls == []


def test_access_errors_say_what_to_do(tmp_path, fake_hub):
    from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    cases = [
        (GatedRepoError, 401, None, r"gated model: accept its license at https://huggingface.co/org/name.*HF_TOKEN"),
        (GatedRepoError, 403, "hf_x", r"no access to the gated model org/name: accept its license"),
        (RepositoryNotFoundError, 401, None, r"not found.*Check the repo id.*private, set HF_TOKEN"),
        (HfHubHTTPError, 401, "hf_bad", r"rejected the token"),
        (HfHubHTTPError, 500, None, r"answered 500 when listing org/name.*HF_HUB_OFFLINE=1"),
        (HfHubHTTPError, 404, None, r"answered 404 when listing org/name"),
    ]
    for cls, status, token, message in cases:
        fake_hub.error = _hub_error(cls, status)
        with pytest.raises(UserError, match=message):
            download("org/name", checkpoint_dir=tmp_path, access_token=token)
    assert fake_hub.calls == []


def test_only_network_errors_fall_back_to_the_cache_and_say_so(tmp_path, fake_hub, hub_cache, monkeypatch, capsys):
    """With the repo in the local cache: a connection error (the real exception type of the hub's HTTP client) takes
    the cached copy and says why; an answer of the hub's (500) or an error the client does not raise for the network
    is never hidden behind the cache."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import HfHubHTTPError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache / "hub"))
    fake_hub.error = httpx2.ConnectError("[Errno 111] Connection refused")
    download(REPO_ID, checkpoint_dir=tmp_path / "a", convert_checkpoint=False)
    assert (tmp_path / "a" / REPO_ID / "model.safetensors").is_file()
    assert "could not be reached (ConnectError: [Errno 111] Connection refused): took org/tiny-llama from the local " \
           "cache" in capsys.readouterr().err

    fake_hub.error = _hub_error(HfHubHTTPError, 500)
    with pytest.raises(UserError, match="answered 500"):
        download(REPO_ID, checkpoint_dir=tmp_path / "b", convert_checkpoint=False)
    fake_hub.error = KeyError("a bug of the client's")
    with pytest.raises(KeyError):
        download(REPO_ID, checkpoint_dir=tmp_path / "b", convert_checkpoint=False)
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_an_unreachable_hub_falls_back_to_the_cache(tmp_path, hub_cache):
    """The real client against a port where nothing listens (it retries for about 25 s before giving up)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HOME": str(hub_cache), "HF_HUB_CACHE": str(hub_cache / "hub"),
           "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([sys.executable, "-m", "litgpt", "download", REPO_ID, "--checkpoint_dir", str(tmp_path),
                           "--convert_checkpoint", "false"], env=env, capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "The hub could not be reached (ConnectError" in done.stderr and "from the local cache" in done.stderr
    assert (tmp_path / REPO_ID / "model.safetensors").is_file()

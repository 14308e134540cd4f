"""`litgpt download`: fetch a model's weights, config and tokenizer from the Hugging Face hub, then convert them."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Iterable, Optional

from litgpt.errors import UserError
from litgpt.fetch import RETRIED_STATUSES, first_line as _first_line, http_status as _http_status, with_retries

# Top-level .bin / .safetensors files that are not model weights (training state, adapters).
NOT_WEIGHTS_PREFIXES = ("training_args", "optimizer", "scheduler", "rng_state", "adapter_")



def download(
    repo_id: str,
    checkpoint_dir: Path = Path("checkpoints"),
    access_token: Optional[str] = None,
    tokenizer_only: bool = False,
    convert_checkpoint: bool = True,
    dtype: Optional[str] = None,
    model_name: Optional[str] = None,
) -> None:
    """Download a model from the Hugging Face hub into CHECKPOINT_DIR/ORG/NAME and convert it to litgpt's format.

    The weights are fetched as safetensors when the repo has them (else as PyTorch .bin files), together with
    config.json, generation_config.json and the tokenizer files. Without a connection to the hub, or with
    HF_HUB_OFFLINE=1, the files are taken from the local Hugging Face cache (HF_HOME / HF_HUB_CACHE).

    Args:
        repo_id: The hub repo, ORG/NAME (e.g. "Qwen/Qwen2.5-0.5B"), or a registered litgpt model name.
            "list" prints the registered models instead of downloading.
        checkpoint_dir: The folder under which the model is saved, in a subfolder ORG/NAME.
        access_token: A Hugging Face token, needed for gated or private repos (default: the HF_TOKEN environment
            variable, then the token saved by `hf auth login`).
        tokenizer_only: Fetch only the config and tokenizer files, no weights.
        convert_checkpoint: After the download, write lit_model.pth and model_config.yaml into the folder.
        dtype: Store the converted weights as float32, bfloat16 or float16 (default: as in the checkpoint).
        model_name: A registered litgpt model name whose config the conversion uses (default: derived from
            config.json).
    """
    if repo_id == "list":
        print_registered_models()
        return

    repo_id = _resolve_repo_id(repo_id)
    convert = convert_checkpoint and not tokenizer_only
    if convert:
        _check_conversion_options(dtype, model_name)
    token = access_token or os.environ.get("HF_TOKEN") or None
    target = Path(checkpoint_dir) / repo_id

    remote_files, unreachable = _list_remote_files(repo_id, token)
    if remote_files is not None:
        wanted = _wanted_files(remote_files, repo_id, tokenizer_only, where="on the hub")
        _snapshot_download(repo_id, target, wanted, token)
    else:
        _copy_from_cache(repo_id, target, tokenizer_only, unreachable)

    print(f"Saved {repo_id} to {target}", file=sys.stderr)
    if convert:
        from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint

        # Downloading again is asking for the repo's current weights, converted.
        convert_hf_checkpoint(checkpoint_dir=target, model_name=model_name, dtype=dtype, overwrite=True)


def print_registered_models() -> None:
    """Print every registered model name with the hub repo its weights come from, family by family, and LitGPT's
    spelling of the names it spells differently."""
    from litgpt.configs import configs_by_family, configs_by_name, litgpt_names

    registry = configs_by_name()
    spellings: dict[str, list[str]] = {}
    for litgpt_name, name in litgpt_names().items():
        spellings.setdefault(name, []).append(litgpt_name)
    width = max((len(name) for name in registry), default=0)
    print("Registered models (pass the repo id, or the name, to `litgpt download`):")
    for title, names in configs_by_family():
        print(f"\n{title}:")
        for name in names:
            also = f"  (LitGPT: {', '.join(spellings[name])})" if name in spellings else ""
            print(f"  {name:<{width}}  {_hub_repo(registry[name]) or ''}{also}".rstrip())


# ---- repo ids ------------------------------------------------------------------------------------------------------
def _hub_repo(values: dict) -> Optional[str]:
    hf_config = values.get("hf_config") or {}
    if hf_config.get("org") and hf_config.get("name"):
        return f"{hf_config['org']}/{hf_config['name']}"
    return None


def _resolve_repo_id(repo_id: str) -> str:
    """ORG/NAME as given, or the repo of a registered model name; a clear error for anything else."""
    repo_id = repo_id.strip().rstrip("/")
    for prefix in ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/"):
        if repo_id.startswith(prefix):  # a repo's web address, pasted
            repo_id = repo_id[len(prefix) :]
    if "/" not in repo_id:
        registry = _registry_or_empty()
        repo_id = _canonical_name(repo_id)
        if repo_id in registry and _hub_repo(registry[repo_id]):
            return _hub_repo(registry[repo_id])
        import difflib

        close = difflib.get_close_matches(repo_id, list(registry), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UserError(
            f"{repo_id!r} is not a Hugging Face repo id (ORG/NAME) nor a registered model name.{hint} "
            "`litgpt download list` shows the registered models."
        )
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise UserError(f"{repo_id!r} is not a valid Hugging Face repo id: {_first_line(error)}") from None
    return repo_id


def _registry_or_empty() -> dict:
    try:
        from litgpt.configs import configs_by_name
    except ImportError:
        return {}
    return configs_by_name()


def _canonical_name(name: str) -> str:
    """The registered name for LitGPT's spelling of it ("Llama-3-8B" for "Meta-Llama-3-8B")."""
    try:
        from litgpt.configs import canonical_name
    except ImportError:
        return name
    return canonical_name(name)


def _check_conversion_options(dtype: Optional[str], model_name: Optional[str]) -> None:
    """Fail before a long download on options the conversion would reject."""
    dtypes = ("float32", "bfloat16", "float16")
    if dtype is not None and dtype not in dtypes:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(dtypes)}.")
    if model_name is not None:
        from litgpt.config import Config

        Config.from_name(model_name)  # raises a UserError naming close matches


# ---- which files -----------------------------------------------------------------------------------------------------
def _pick_weights(files: Iterable[str]) -> list[str]:
    """The weight files of a repo's file list: safetensors when there are any, else .bin; with their index."""
    top = sorted(f for f in files if "/" not in f)
    for extension, stem in ((".safetensors", "model"), (".bin", "pytorch_model")):
        candidates = [f for f in top if f.endswith(extension) and not f.startswith(NOT_WEIGHTS_PREFIXES)]
        # Prefer the transformers layout (model.safetensors or model-0000x-of-0000y.safetensors) over other copies,
        # such as Mistral's consolidated.safetensors.
        standard = [f for f in candidates if f == stem + extension or f.startswith(stem + "-")]
        if standard:
            index = stem + extension + ".index.json"
            return standard + ([index] if index in top else [])
        if candidates:
            return candidates + [f for f in top if f.endswith(extension + ".index.json")]
    return []


def _wanted_files(files: list[str], repo_id: str, tokenizer_only: bool, where: str) -> list[str]:
    """The files to fetch out of `files`: config.json, the tokenizer files and (unless tokenizer_only) the weights."""
    from litgpt.checkpoint.model_files import TOKENIZER_FILES

    names = set(files)
    small = [f for f in ("config.json", *TOKENIZER_FILES) if f in names]
    if tokenizer_only:
        if not any(f in names for f in ("tokenizer.json", "tokenizer.model")):
            raise UserError(f"{repo_id} has no tokenizer.json or tokenizer.model {where}.")
        return small
    weights = _pick_weights(files)
    if not weights:
        listing = ", ".join(sorted(files)[:8]) + (", ..." if len(files) > 8 else "")
        raise UserError(
            f"{repo_id} has no model weights (*.safetensors or *.bin) {where}; it has: {listing or 'no files'}. "
            "Check the repo id, or pass --tokenizer_only true to fetch only the tokenizer."
        )
    return small + weights


# ---- from the hub ----------------------------------------------------------------------------------------------------
def _list_remote_files(repo_id: str, token: Optional[str]) -> tuple[Optional[list[str]], Optional[BaseException]]:
    """The repo's files, or (None, why) when the network does not reach the hub (offline mode, no connection, a
    timeout): only then may the local cache stand in for it. Any answer of the hub's is an answer."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    try:
        return HfApi().list_repo_files(repo_id, token=token), None
    except network_errors() as error:
        return None, error
    except HfHubHTTPError as error:
        _raise_for_access(error, repo_id, token)
        status = getattr(getattr(error, "response", None), "status_code", None)
        raise UserError(
            f"The Hugging Face hub answered {status or 'with an error'} when listing {repo_id}: {_first_line(error)}. "
            "Try again later, or set HF_HUB_OFFLINE=1 to use a copy in the local cache."
        ) from None


def network_errors() -> tuple[type[BaseException], ...]:
    """What the hub client raises when no answer came: offline mode, and the connection and timeout errors of the
    HTTP libraries huggingface_hub uses (httpx2 or httpx in recent versions, requests in older ones)."""
    import importlib
    import socket

    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list = [OfflineModeIsEnabled, ConnectionError, TimeoutError, socket.gaierror]
    for module_name, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                               ("requests", ("ConnectionError", "Timeout"))):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        errors += [getattr(module, name) for name in names if hasattr(module, name)]
    return tuple(errors)


def _snapshot_download(repo_id: str, target: Path, files: list[str], token: Optional[str]) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, OfflineModeIsEnabled

    patterns = [_escape_pattern(f) for f in files]

    def is_transient(error: BaseException) -> bool:
        dropped = isinstance(error, network_errors()) and not isinstance(error, OfflineModeIsEnabled)
        return dropped or _http_status(error) in RETRIED_STATUSES

    try:
        # huggingface_hub resumes its partial files (.incomplete): another try continues where one broke off.
        with_retries(lambda: snapshot_download(repo_id, local_dir=target, allow_patterns=patterns, token=token),
                     is_transient, f"Downloading {repo_id}")
    except HfHubHTTPError as error:
        _raise_for_access(error, repo_id, token)
        raise UserError(f"Downloading {repo_id} failed: {_first_line(error)}. Try again later.") from None
    except network_errors() as error:  # connection lost on every try
        raise UserError(
            f"Downloading {repo_id} failed: {_first_line(error)}. Run the command again to resume."
        ) from None
    except OSError as error:  # disk full, ...
        raise UserError(f"Downloading {repo_id} failed: {_first_line(error)}.") from None


def _raise_for_access(error: BaseException, repo_id: str, token: Optional[str]) -> None:
    """Turn the hub's answers about access into messages that say what to do."""
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    status = getattr(getattr(error, "response", None), "status_code", None)
    page = f"https://huggingface.co/{repo_id}"
    if isinstance(error, GatedRepoError):
        if token is None:
            raise UserError(
                f"{repo_id} is a gated model: accept its license at {page}, then set HF_TOKEN (or pass "
                "--access_token) to a token of that account (https://huggingface.co/settings/tokens)."
            ) from None
        raise UserError(
            f"Your token has no access to the gated model {repo_id}: accept its license at {page} with the account "
            "of the token (approval can take a while), and make sure a fine-grained token may read gated repos."
        ) from None
    if isinstance(error, RepositoryNotFoundError):
        login = "set HF_TOKEN (or pass --access_token)" if token is None else "check that your token can read it"
        raise UserError(
            f"Repository {repo_id} was not found on the Hugging Face hub. Check the repo id (`litgpt download list` "
            f"shows the registered models); if it is private, {login}."
        ) from None
    if status == 401:
        raise UserError(
            "The Hugging Face hub rejected the token (401 Unauthorized). Check HF_TOKEN / --access_token, or create "
            "a new token at https://huggingface.co/settings/tokens."
        ) from None
    if status == 403:
        raise UserError(
            f"Access to {repo_id} is forbidden for this token (403). Accept the model's license at {page} and use a "
            "token with read access."
        ) from None


def _escape_pattern(name: str) -> str:
    """A file name as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


# ---- from the local cache --------------------------------------------------------------------------------------------
def _copy_from_cache(repo_id: str, target: Path, tokenizer_only: bool, unreachable: Optional[BaseException]) -> None:
    """Without the hub: copy the files from the Hugging Face cache, or keep those of an earlier download."""
    snapshot = _cached_snapshot(repo_id)
    why = _offline_reason(unreachable)
    if snapshot is not None:
        files = _wanted_files(
            [p.name for p in snapshot.iterdir() if p.is_file()],
            repo_id,
            tokenizer_only,
            where=f"in the local Hugging Face cache ({snapshot}) and {why}",
        )
        from litgpt.io import atomic_path

        for name in files:
            with atomic_path(target / name) as tmp:
                shutil.copyfile(snapshot / name, tmp)
        print(f"{why[0].upper() + why[1:]}: took {repo_id} from the local cache {snapshot}", file=sys.stderr)
        return
    if target.is_dir():
        present = [p.name for p in target.iterdir() if p.is_file()]
        ready = any(f in present for f in ("tokenizer.json", "tokenizer.model"))
        if ready and (tokenizer_only or _pick_weights(present)):
            print(f"{why[0].upper() + why[1:]}: using the files already in {target}", file=sys.stderr)
            return
    raise UserError(
        f"{repo_id} is not in the local Hugging Face cache and {why}. Connect to the internet (and unset "
        "HF_HUB_OFFLINE) to download it, or check the repo id."
    )


def _cached_snapshot(repo_id: str) -> Optional[Path]:
    """The folder of the cached snapshot of the repo's main branch: HF_HUB_CACHE/models--ORG--NAME/snapshots/COMMIT."""
    from huggingface_hub import constants

    storage = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    ref = storage / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = storage / "snapshots" / ref.read_text().strip()
    return snapshot if snapshot.is_dir() else None


def _offline_reason(error: Optional[BaseException]) -> str:
    from huggingface_hub.utils import OfflineModeIsEnabled

    if error is None or isinstance(error, OfflineModeIsEnabled):
        return "the hub is not contacted (HF_HUB_OFFLINE is set)"
    return f"the hub could not be reached ({type(error).__name__}: {_first_line(error)})"

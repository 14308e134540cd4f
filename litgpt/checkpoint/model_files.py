"""A model's checkpoint folder (lit_model.pth, model_config.yaml, the tokenizer) and loading its weights into a model."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from litgpt.errors import UserError
from litgpt.io import atomic_copy

WEIGHTS_FILE = "lit_model.pth"

CONFIG_FILE = "model_config.yaml"

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)


# Where `litgpt download ORG/NAME` puts a model; LitGPT's commands take `ORG/NAME` for `checkpoints/ORG/NAME`.
CHECKPOINTS_DIR = Path("checkpoints")


def expand_checkpoints_shorthand(checkpoint_dir: Path) -> Path:
    """`checkpoints/ORG/NAME` for a relative `ORG/NAME` that is no folder here while that one is (as LitGPT reads its
    checkpoint_dir arguments); any other path as it is."""
    checkpoint_dir = Path(checkpoint_dir)
    under_checkpoints = CHECKPOINTS_DIR / checkpoint_dir
    if (not checkpoint_dir.is_dir() and not checkpoint_dir.is_absolute() and checkpoint_dir.parts
            and checkpoint_dir.parts[0] != CHECKPOINTS_DIR.name and under_checkpoints.is_dir()):
        return under_checkpoints
    return checkpoint_dir


def find_checkpoint_dir(checkpoint_dir: Path) -> Path:
    """Check that a folder (or LitGPT's `ORG/NAME` for checkpoints/ORG/NAME) holds a litgpt checkpoint; return it."""
    checkpoint_dir = expand_checkpoints_shorthand(Path(checkpoint_dir))
    if not checkpoint_dir.is_dir():
        raise UserError(
            f"Checkpoint folder {str(checkpoint_dir)!r} does not exist. Download one with `litgpt download REPO_ID` "
            "or convert one with `litgpt convert_to_litgpt HF_DIR`."
        )
    if not (checkpoint_dir / WEIGHTS_FILE).is_file():
        hint = ""
        if any(checkpoint_dir.glob("*.safetensors")) or any(checkpoint_dir.glob("pytorch_model*.bin")):
            hint = f" It looks like a Hugging Face folder: run `litgpt convert_to_litgpt {checkpoint_dir}` first."
        elif (checkpoint_dir / "sharded").is_dir():
            hint = f" It is a sharded checkpoint: run `litgpt consolidate {checkpoint_dir}` to write one."
        raise UserError(f"{str(checkpoint_dir)!r} has no {WEIGHTS_FILE}.{hint}")
    if not (checkpoint_dir / CONFIG_FILE).is_file():
        raise UserError(f"{str(checkpoint_dir)!r} has no {CONFIG_FILE}; it is needed to build the model.")
    return checkpoint_dir


def read_model_weights(path: Path) -> dict:
    """The model's tensors in a lit_model.pth, memory-mapped: ours and LitGPT's (whose converted folders hold the
    state dict itself and whose training runs save {"model": state dict, ...} with the optimizer beside it).

    LitGPT 0.5 names and lays out every tensor as we do (q/k/v fused as [q heads | k groups | v groups], the output
    head stored also when tied), so nothing else changes.
    """
    from litgpt.io import load_state_dict

    state_dict = load_state_dict(Path(path))
    wrapped = state_dict.get("model")
    if isinstance(wrapped, dict) and not any(isinstance(value, torch.Tensor) for value in state_dict.values()):
        state_dict = wrapped
    if any(key.endswith(LEGACY_QKV_SUFFIXES) for key in state_dict):
        state_dict = renamed_legacy_qkv(state_dict, Path(path))
    return state_dict


# Before LitGPT 0.5 the fused q/k/v projection was `attn.attn`, its rows interleaved per query group.
LEGACY_QKV_SUFFIXES = (".attn.attn.weight", ".attn.attn.bias")


def renamed_legacy_qkv(state_dict: dict, path: Path) -> dict:
    """A pre-0.5 LitGPT state dict with each `attn.attn` as today's `attn.qkv`: the rows [q.., k, v] of each query
    group regrouped into [all q | all k | all v] (what LitGPT 0.5 does on load), by the model_config.yaml beside it."""
    from litgpt.config import Config

    if not (path.parent / CONFIG_FILE).is_file():
        raise UserError(
            f"{str(path)!r} holds pre-0.5 LitGPT weights (attn.attn keys), whose q/k/v rows are regrouped by the "
            f"model's config, and no {CONFIG_FILE} is beside it: put the model's {CONFIG_FILE} next to it."
        )
    config = Config.from_checkpoint(path.parent)
    if getattr(config, "latent_attention", None):
        raise UserError(f"{str(path)!r} holds pre-0.5 LitGPT attn.attn weights for a model without fused q/k/v "
                        "attention: convert it with LitGPT 0.5 (load it in LitGPT and save its state_dict) first.")
    q_rows = config.head_size * config.n_head // config.n_query_groups
    renamed = {}
    for key, tensor in state_dict.items():
        if key.endswith(LEGACY_QKV_SUFFIXES):
            if tensor.shape[0] != config.n_query_groups * (q_rows + 2 * config.head_size):
                raise UserError(f"{key} in {str(path)!r} has {tensor.shape[0]} rows; the {CONFIG_FILE} beside it "
                                "gives another q/k/v size: check that the config belongs to these weights.")
            groups = tensor.reshape(config.n_query_groups, q_rows + 2 * config.head_size, *tensor.shape[1:])
            q, k, v = groups.split([q_rows, config.head_size, config.head_size], dim=1)
            tensor = torch.cat([part.reshape(-1, *tensor.shape[1:]) for part in (q, k, v)])
            key = key.replace(".attn.attn.", ".attn.qkv.")
        renamed[key] = tensor
    return renamed


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            atomic_copy(Path(source) / name, Path(destination) / name)


class _SkipInitOnMeta(torch.overrides.TorchFunctionMode):
    """Skip random initializers on meta tensors, where they compute nothing.

    The meta kernel of `normal_` (nn.Embedding's initializer) lives in Python and costs seconds of imports on first
    use; building a model on the meta device does not need it.
    """

    SKIPPED = ("normal_", "trunc_normal_", "uniform_", "kaiming_uniform_")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.SKIPPED:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device() -> Iterator[None]:
    """Create modules on the meta device (no memory, no initialization); materialize or `assign` weights later."""
    with torch.device("meta"), _SkipInitOnMeta():
        yield


def check_weights_match(
    expected: dict[str, torch.Size], state_dict: dict, source: str, subject: str = "The weights", fix: str = ""
) -> None:
    """Raise UserError naming the first missing, unexpected or misshapen key of `state_dict` against `expected`."""
    fix = fix or "Check that model_config.yaml belongs to these weights."
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (first: {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (first: {unexpected[0]})")
        raise UserError(f"{subject} in {source} do not match the model config: {', '.join(parts)}. {fix}")
    for key, shape in expected.items():
        if state_dict[key].shape != shape:
            raise UserError(
                f"{subject} in {source} do not match the model config: {key} has shape "
                f"{tuple(state_dict[key].shape)}, the config expects {tuple(shape)}. {fix}"
            )


def retie_embeddings(model: torch.nn.Module) -> None:
    """Share the output head with the embedding again (loading with `assign` replaces the two one by one)."""
    if getattr(getattr(model, "config", None), "tie_embeddings", False):
        model.lm_head.weight = model.transformer.wte.weight


def copy_weights(
    model: torch.nn.Module,
    state_dict: dict,
    source: str,
    select: Callable[[str], bool] = lambda key: True,
    subject: str = "The weights",
    fix: str = "",
    row_orders: Optional[dict] = None,
    held_elsewhere: Optional[dict] = None,
) -> None:
    """Copy a full `state_dict` (e.g. memory-mapped) into a materialized model's selected keys, sharded or not.

    Each rank reads only the part of each tensor that it holds. Names the first missing, unexpected or misshapen key.
    `row_orders`: the keys the model stores with permuted rows (`litgpt.distributed.tensor_parallel.row_orders`).
    `held_elsewhere`: key -> shape of what other ranks hold in place of this one (other ranks' experts under expert
    parallelism, `litgpt.distributed.expert_parallel.held_elsewhere`): checked, not copied.
    """
    from litgpt.distributed.dtensor import copy_into_shard  # torch.distributed.tensor: only loads that shard need it

    targets = {key: value for key, value in model.state_dict().items() if select(key)}
    expected = {key: value.shape for key, value in targets.items()}
    expected.update({key: shape for key, shape in (held_elsewhere or {}).items() if select(key)})
    check_weights_match(expected, state_dict, source, subject, fix)
    for key, target in targets.items():
        copy_into_shard(target, state_dict[key], (row_orders or {}).get(key))


def assign_weights(model: torch.nn.Module, state_dict: dict, source: str, select: Callable[[str], bool]) -> None:
    """Load the selected keys of `state_dict`; a meta-device model takes its (memory-mapped) tensors without a copy."""
    expected = {key: value.shape for key, value in model.state_dict().items() if select(key)}
    check_weights_match(expected, state_dict, source)
    assign = any(value.is_meta for key, value in model.state_dict().items() if select(key))
    model.load_state_dict(state_dict, strict=False, assign=assign)
    retie_embeddings(model)


def load_model_weights(model: torch.nn.Module, state_dict: dict, source: str) -> None:
    """Load `state_dict` into `model`, naming the first missing, unexpected or misshapen key on failure."""
    check_weights_match({k: v.shape for k, v in model.state_dict().items()}, state_dict, source)
    model.load_state_dict(state_dict, strict=True, assign=any(p.is_meta for p in model.parameters()))
    retie_embeddings(model)

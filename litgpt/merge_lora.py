"""`litgpt merge_lora`: fold the adapters of a LoRA finetuning run into its base weights, giving a plain checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import yaml

from litgpt.errors import UserError
from litgpt.precision import PRECISION_DTYPES

LORA_WEIGHTS_FILE = "lit_model.pth.lora"
HPARAMS_FILE = "hyperparameters.yaml"
# Where a LoRA run's folder finds its base from any working directory: the base as typed, its absolute path, and its
# path relative to this folder (for a run tree moved whole). LitGPT does not read it; hyperparameters.yaml stays a
# valid --config of the command.
BASE_RECORD_FILE = "base_checkpoint.yaml"

def merge_lora(
    checkpoint_dir: Path, pretrained_checkpoint_dir: Optional[Path] = None, precision: Optional[str] = None
) -> None:
    """Merge the LoRA adapters of a finetuning run into the base weights and write a plain lit_model.pth beside them.

    The result is an ordinary litgpt checkpoint folder: `litgpt generate`, `litgpt chat` and
    `litgpt convert_from_litgpt` work on it. The base weights are read memory-mapped; the output is written under a
    temporary name and renamed, so an interrupted merge leaves no partial lit_model.pth. A folder that already holds
    the merged lit_model.pth beside its adapters (finetune_lora's final/) is left as it is, and that is no error.

    Args:
        checkpoint_dir: The output folder of a LoRA finetuning run: it holds lit_model.pth.lora (the adapters),
            hyperparameters.yaml (with the base checkpoint_dir and the lora_* settings), model_config.yaml and the
            tokenizer files.
        pretrained_checkpoint_dir: The base model's checkpoint folder (default: the checkpoint_dir recorded in
            hyperparameters.yaml).
        precision: The dtype of the merged weights: 32-true, 16-true or bf16-true (also float32, float16,
            bfloat16). Default: the base checkpoint's dtype.
    """
    from litgpt.checkpoint.model_files import (
        CONFIG_FILE,
        meta_device,
        TOKENIZER_FILES,
        WEIGHTS_FILE,
        expand_checkpoints_shorthand,
        read_model_weights,
    )
    from litgpt.io import save_state_dict
    from litgpt.config import Config
    from litgpt.lora import LoRASettings, add_lora, load_base_weights, load_lora_weights, plain_state_dict
    from litgpt.model import GPT

    # ---- every check before anything is read in bulk or written ----
    checkpoint_dir = expand_checkpoints_shorthand(Path(checkpoint_dir))
    if not checkpoint_dir.is_dir():
        raise UserError(
            f"Folder {str(checkpoint_dir)!r} does not exist; pass the output folder of a LoRA finetuning run."
        )
    output = checkpoint_dir / WEIGHTS_FILE
    lora_path = checkpoint_dir / LORA_WEIGHTS_FILE
    if output.exists() and lora_path.is_file():
        # What `finetune_lora` publishes as final/ (it merges when the run ends), where LitGPT's guides run this next.
        print(f"{str(checkpoint_dir)!r} already holds {WEIGHTS_FILE} merged from its {LORA_WEIGHTS_FILE}: nothing to "
              f"do (delete {WEIGHTS_FILE} to merge again).")
        return
    if output.exists():
        raise UserError(
            f"{str(checkpoint_dir)!r} holds {WEIGHTS_FILE} and no {LORA_WEIGHTS_FILE}: it is a plain checkpoint, "
            "not the output folder of a LoRA finetuning run."
        )
    if not lora_path.is_file():
        raise UserError(
            f"{str(checkpoint_dir)!r} has no {LORA_WEIGHTS_FILE}: it is not the output folder of a LoRA finetuning run."
        )
    if precision is not None and precision not in PRECISION_DTYPES:
        raise UserError(f"Unknown precision {precision!r}; use one of {', '.join(PRECISION_DTYPES)}.")
    hparams = read_hparams(checkpoint_dir)
    settings = LoRASettings.from_hparams(hparams, source=str(checkpoint_dir / HPARAMS_FILE))
    base_dir = base_checkpoint_dir(checkpoint_dir, hparams, pretrained_checkpoint_dir)
    config_dir = checkpoint_dir if (checkpoint_dir / CONFIG_FILE).is_file() else base_dir
    config = Config.from_checkpoint(config_dir)

    # ---- build the adapted model on meta, take the memory-mapped base tensors, load the adapters ----
    with meta_device():
        model = GPT(config)
    add_lora(model, settings)
    base_path = base_dir / WEIGHTS_FILE
    load_base_weights(model, read_model_weights(base_path), source=str(base_path))
    adapters = read_lora_adapters(lora_path, config, settings)
    load_lora_weights(model, adapters, source=str(lora_path))

    merged = plain_state_dict(model)
    if precision is not None:
        merged = cast_floating(merged, PRECISION_DTYPES[precision])
    save_state_dict(merged, output)

    # A plain checkpoint folder also needs its config and tokenizer: take those the run folder lacks from the base.
    copied = []
    for name in (CONFIG_FILE, *TOKENIZER_FILES):
        if not (checkpoint_dir / name).exists() and (base_dir / name).is_file():
            shutil.copy2(base_dir / name, checkpoint_dir / name)
            copied.append(name)
    note = f"; copied {', '.join(copied)} from the base" if copied else ""
    print(f"Merged {len(adapters)} LoRA tensors of {lora_path} into the weights of {base_path}: wrote {output}{note}")


def base_checkpoint_dir(checkpoint_dir: Path, hparams: dict, pretrained_checkpoint_dir: Optional[Path]) -> Path:
    """The base checkpoint a LoRA run's adapters belong to: `pretrained_checkpoint_dir`, else the first folder of
    `base_candidates` that exists; checked to be a checkpoint folder."""
    from litgpt.checkpoint.model_files import find_checkpoint_dir

    if pretrained_checkpoint_dir is not None:
        return find_checkpoint_dir(Path(pretrained_checkpoint_dir))
    candidates = base_candidates(Path(checkpoint_dir), hparams)
    if not candidates:
        raise UserError(f"{str(checkpoint_dir / HPARAMS_FILE)!r} does not record the base checkpoint_dir; pass "
                        "--pretrained_checkpoint_dir BASE_DIR.")
    for candidate in candidates:
        if candidate.is_dir():
            return find_checkpoint_dir(candidate)
    tried = ", ".join(repr(str(candidate)) for candidate in candidates)
    raise UserError(f"The base checkpoint of {str(checkpoint_dir)!r} does not exist at {tried}; pass the folder "
                    "the run was finetuned from with --pretrained_checkpoint_dir.")


def base_candidates(checkpoint_dir: Path, hparams: dict) -> list[Path]:
    """Where a run folder's base may be, in order: its checkpoint_dir as typed, from the working directory (LitGPT's
    `ORG/NAME` as checkpoints/ORG/NAME); the absolute path it recorded; its path relative to the run folder."""
    from litgpt.checkpoint.model_files import expand_checkpoints_shorthand

    candidates = []
    if hparams.get("checkpoint_dir"):
        candidates.append(expand_checkpoints_shorthand(Path(str(hparams["checkpoint_dir"]))))
    record_path = checkpoint_dir / BASE_RECORD_FILE
    record = read_yaml_mapping(record_path) if record_path.is_file() else {}
    if record.get("absolute"):
        candidates.append(Path(str(record["absolute"])))
    if record.get("from_this_folder"):
        candidates.append(checkpoint_dir / str(record["from_this_folder"]))
    return list(dict.fromkeys(candidates))


def write_base_record(folder: Path, as_typed: str, base_dir: Path) -> None:
    """Record in `folder` where its base checkpoint is (BASE_RECORD_FILE), for `base_candidates`."""
    from litgpt.io import write_yaml

    absolute = Path(base_dir).resolve()
    write_yaml(Path(folder) / BASE_RECORD_FILE, {
        "as_typed": str(as_typed), "absolute": str(absolute),
        "from_this_folder": os.path.relpath(absolute, Path(folder).resolve()),
    })


def read_lora_adapters(path: Path, config, settings) -> dict:
    """The adapter tensors of a lit_model.pth.lora in our names: ours, or LitGPT's ({"model": ...}, one lora_A/lora_B
    pair for the fused q/k/v projection)."""
    from litgpt.io import load_state_dict
    from litgpt.lora import adapters_from_litgpt

    adapters = load_state_dict(Path(path))
    if set(adapters) == {"model"} and isinstance(adapters["model"], dict):
        adapters = adapters["model"]
    return adapters_from_litgpt(adapters, config, settings, source=str(path))


def read_hparams(checkpoint_dir: Path) -> dict:
    path = Path(checkpoint_dir) / HPARAMS_FILE
    if not path.is_file():
        raise UserError(
            f"{str(checkpoint_dir)!r} has no {HPARAMS_FILE}: the LoRA settings and the base checkpoint_dir are read "
            "from it."
        )
    return read_yaml_mapping(path)


def read_yaml_mapping(path: Path) -> dict:
    """A YAML file that must hold a mapping (safe_load: plain values only)."""
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UserError(f"{str(path)!r} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(values, dict):
        raise UserError(f"{str(path)!r} must hold a mapping of names to values.")
    return values


def cast_floating(state_dict: dict, dtype: torch.dtype) -> dict:
    """Cast floating-point tensors to `dtype`; tensors that shared memory (tied weights) still share it after."""
    cast: dict[tuple, torch.Tensor] = {}
    result = {}
    for key, tensor in state_dict.items():
        if not tensor.is_floating_point():
            result[key] = tensor
            continue
        identity = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
        if identity not in cast:
            cast[identity] = tensor.to(dtype)
        result[key] = cast[identity]
    return result

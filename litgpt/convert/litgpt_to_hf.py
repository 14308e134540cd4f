"""`litgpt convert_from_litgpt`: a litgpt checkpoint -> a folder that `transformers` loads with `from_pretrained`."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from litgpt.checkpoint.model_files import (
    find_checkpoint_dir, meta_device, read_model_weights, TOKENIZER_FILES, WEIGHTS_FILE,
)
from litgpt.config import Config
from litgpt.convert.families.configs import config_to_hf
from litgpt.convert.families.weights import weight_rules
from litgpt.convert.hf_to_litgpt import DTYPES
from litgpt.errors import UserError
from litgpt.progress import Progress

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: str) -> int:
    text = size.strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * _UNITS[unit])
            except ValueError:
                break
    if text.isdigit():
        return int(text)
    raise UserError(f"max_shard_size {size!r} is not a size such as '5GB' or '500MB'.")


def convert_lit_checkpoint(
    checkpoint_dir: Path, output_dir: Path, *, dtype: Optional[str] = None, max_shard_size: str = "5GB",
    peft: Optional[bool] = None, pretrained_checkpoint_dir: Optional[Path] = None,
) -> None:
    """Write a litgpt checkpoint as a Hugging Face model folder.

    The folder holds config.json, generation_config.json, safetensors weights (sharded with an index above
    max_shard_size) and the tokenizer files, and loads with `AutoModelForCausalLM.from_pretrained(output_dir)`.

    Args:
        checkpoint_dir: A folder with lit_model.pth and model_config.yaml.
        output_dir: The folder to create. It must not exist yet (nothing on disk is overwritten).
        dtype: Store the weights as float32, bfloat16 or float16 (default: as in the checkpoint).
        max_shard_size: The largest safetensors file to write, e.g. "5GB".
        peft: For a LoRA run's folder (one with lit_model.pth.lora): write the run's unmerged base model into
            output_dir and the adapters as a PEFT LoRA folder into output_dir/adapter/, which
            `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(output_dir), output_dir/adapter)` loads.
            Default: so for a folder of adapters without merged weights (a step checkpoint); a folder with merged
            weights (the run's final/) converts as the merged model unless --peft true.
        pretrained_checkpoint_dir: With --peft: the base checkpoint (default: the checkpoint_dir the run's
            hyperparameters.yaml records).
    """
    from litgpt.convert.peft import (
        ADAPTER_DIR, check_exportable, exported_adapter, lora_run_export, write_peft_adapter,
    )

    lora_run = lora_run_export(Path(checkpoint_dir), peft, pretrained_checkpoint_dir)
    checkpoint_dir = lora_run.run_dir if lora_run else find_checkpoint_dir(Path(checkpoint_dir))
    weights_dir = lora_run.base_dir if lora_run else checkpoint_dir
    output_dir = Path(output_dir)
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise UserError(f"{str(output_dir)!r} already exists and is not empty; choose a new output folder.")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    shard_limit = parse_size(max_shard_size)
    config = Config.from_checkpoint(checkpoint_dir)
    generation = generation_config(checkpoint_dir)
    # pad_token_id is stated even when unknown: some families' defaults point outside a small vocabulary.
    token_ids = {"pad_token_id": None, **{k: generation[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in generation}}
    hf_config = config_to_hf(config, extra=token_ids)
    if lora_run:
        check_exportable(config)
        adapter = exported_adapter(lora_run, config, DTYPES.get(dtype))
    state_dict = read_model_weights(weights_dir / WEIGHTS_FILE)

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        first_dtype = write_safetensors(state_dict, config, staging, DTYPES.get(dtype), shard_limit, weights_dir)
        if lora_run:
            write_peft_adapter(staging / ADAPTER_DIR, *adapter, base_model_name_or_path=str(output_dir.resolve()))
        hf_config["torch_dtype"] = str(first_dtype).removeprefix("torch.")
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if name != "generation_config.json" and (checkpoint_dir / name).is_file():
                shutil.copy2(checkpoint_dir / name, staging / name)
        if output_dir.exists():
            output_dir.rmdir()  # empty, checked above
        os.replace(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"Wrote a Hugging Face model folder to {output_dir}")
    if lora_run:
        print(f"It holds the base model {lora_run.base_dir}, and {output_dir / ADAPTER_DIR} the LoRA adapters of "
              f"{checkpoint_dir} as a PEFT folder (`PeftModel.from_pretrained(model, '{output_dir / ADAPTER_DIR}')`)")


def generation_config(checkpoint_dir: Path) -> dict:
    """The checkpoint's generation_config.json, else one built from the tokenizer's BOS/EOS."""
    path = checkpoint_dir / "generation_config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise UserError(f"{str(path)!r} is not valid JSON: {error}") from None
    out: dict = {}
    if (checkpoint_dir / "tokenizer.json").is_file():
        from litgpt.tokenizer import Tokenizer

        tokenizer = Tokenizer(checkpoint_dir)
        if tokenizer.bos_id is not None:
            out["bos_token_id"] = tokenizer.bos_id
        if tokenizer.eos_id is not None:
            out["eos_token_id"] = tokenizer.eos_id
    return out


def write_safetensors(
    state_dict: dict,
    config: Config,
    folder: Path,
    dtype: Optional[torch.dtype],
    shard_limit: int,
    source: Path,
) -> torch.dtype:
    """Convert tensor by tensor and write shards of at most `shard_limit` bytes; returns the weights' dtype."""
    from safetensors.torch import save_file

    from litgpt.model import GPT

    with meta_device():
        expected = GPT(config).state_dict()
    if set(state_dict) != set(expected):
        missing = sorted(set(expected) - set(state_dict))
        extra = sorted(set(state_dict) - set(expected))
        detail = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise UserError(
            f"{str(source / WEIGHTS_FILE)!r} does not match its model_config.yaml ({detail}). "
            "A LoRA checkpoint must be merged first (`litgpt merge_lora`)."
        )

    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0
    weights_dtype = None

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            save_file(current, str(folder / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
            shards.append({name: None for name in current})
            current, current_bytes = {}, 0

    total = 0
    rules = list(weight_rules(config, set(expected)))
    with Progress(sum(len(rule.lit) for rule in rules), "Converting weights", unit="tensor") as shown:
        for rule in rules:
            for name in rule.lit:
                if state_dict[name].shape != expected[name].shape:
                    raise UserError(
                        f"{name} has shape {tuple(state_dict[name].shape)} in {str(source / WEIGHTS_FILE)!r}, "
                        f"but model_config.yaml implies {tuple(expected[name].shape)}."
                    )
            tensors = rule.to_hf([state_dict[name] for name in rule.lit], config)
            for hf_name, tensor in zip(rule.hf, tensors):
                tensor = (tensor.to(dtype) if dtype is not None else tensor).contiguous().clone()
                weights_dtype = weights_dtype or tensor.dtype
                size = tensor.numel() * tensor.element_size()
                if current and current_bytes + size > shard_limit:
                    flush()
                current[hf_name] = tensor
                current_bytes += size
                total += size
            shown.update(len(rule.lit))
    flush()

    if len(shards) == 1:
        os.replace(folder / "shard-00000.tmp", folder / "model.safetensors")
        return weights_dtype
    weight_map = {}
    for i, names in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(folder / f"shard-{i:05d}.tmp", folder / file_name)
        weight_map.update({name: file_name for name in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weights_dtype

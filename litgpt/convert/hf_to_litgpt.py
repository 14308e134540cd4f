"""`litgpt convert_to_litgpt`: a Hugging Face model folder -> lit_model.pth + model_config.yaml in the same folder."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Iterator, Optional

import torch

from litgpt.checkpoint.model_files import CONFIG_FILE, meta_device, WEIGHTS_FILE
from litgpt.io import load_state_dict, save_state_dict
from litgpt.config import Config
from litgpt.convert.families.configs import config_from_hf
from litgpt.convert.families.weights import weight_rules
from litgpt.errors import UserError
from litgpt.safe_paths import inside
from litgpt.progress import Progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Buffers some checkpoints carry that are derived, not learned.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


class HFWeights:
    """Tensors of a Hugging Face folder, read one at a time (safetensors preferred, single or sharded, else .bin)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[str, Path] = {}  # key -> file
        self._open: dict[Path, object] = {}
        safetensors = self._shards("model.safetensors", "*.safetensors")
        if safetensors:
            for path in safetensors:
                handle = SafetensorsFile(path)
                self._open[path] = handle
                self._files.update({key: path for key in handle.keys()})
        else:
            for path in self._shards("pytorch_model.bin", "pytorch_model*.bin"):
                state = load_state_dict(path)  # memory-mapped, weights_only
                self._open[path] = state
                self._files.update({key: path for key in state})
        if not self._files:
            raise UserError(
                f"{str(folder)!r} holds no weights (*.safetensors or pytorch_model*.bin). "
                "Download the model again with `litgpt download REPO_ID`."
            )
        self._names = {key: key for key in self._files}  # the name conversion uses -> the name in the file
        self._fp8: dict[str, str] = {}  # FP8 weight -> its block scales (`dequantize_fp8`)
        self._fp8_block, self._fp8_dtype = (128, 128), torch.bfloat16

    def _shards(self, single: str, pattern: str) -> list[Path]:
        index = self.folder / f"{single}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise UserError(f"{str(index)!r} is not a valid weight index ({error}).") from None
            if not isinstance(weight_map, dict):
                raise UserError(f"{str(index)!r} is not a valid weight index (its weight_map is not a mapping).")
            paths = sorted({inside(self.folder, name, source=index) for name in weight_map.values()})
            missing = [p.name for p in paths if not p.is_file()]
            if missing:
                raise UserError(f"{str(index)!r} lists shard {missing[0]!r}, which is missing: download it again.")
            return paths
        return sorted(self.folder.glob(pattern))

    def language_model_only(self) -> None:
        """Read a multimodal checkpoint's language model under the text model's names; leave the rest out."""
        prefixes = {"language_model.model.": "model.", "model.language_model.": "model.",
                    "language_model.lm_head.": "lm_head."}
        names = {}
        for key in self._files:
            for old, new in prefixes.items():
                if key.startswith(old):
                    names[new + key[len(old):]] = key
        self._names = names

    def dequantize_fp8(self, block: tuple[int, int], dtype: torch.dtype) -> None:
        """Read every float8 weight that has a `weight_scale_inv` beside it as weight * scale per block (DeepSeek's
        published checkpoints), in `dtype`; the scales themselves are then no tensors of the model."""
        scales = {key[: -len("_scale_inv")]: key for key in self._names if key.endswith(".weight_scale_inv")}
        self._fp8 = {key: scale for key, scale in scales.items() if key in self._names}
        self._names = {key: name for key, name in self._names.items() if key not in self._fp8.values()}
        self._fp8_block, self._fp8_dtype = block, dtype

    def keys(self) -> set[str]:
        """The tensors' names; a pair NAME_blocks, NAME_scales of MXFP4 weights (gpt-oss) shows as NAME."""
        names = set(self._names)
        quantized = {key.removesuffix("_blocks") for key in names if key.endswith("_blocks")}
        quantized = {key for key in quantized if key + "_scales" in names}
        return names - {k + s for k in quantized for s in ("_blocks", "_scales")} | quantized

    def get(self, key: str) -> torch.Tensor:
        if key not in self._names and key + "_blocks" in self._names:
            return dequantize_mxfp4(self.get(key + "_blocks"), self.get(key + "_scales"))
        name = self._names[key]
        tensor = self._open[self._files[name]][name]
        scale_key = self._fp8.get(key)
        if scale_key is None:
            return tensor
        scale = self._open[self._files[scale_key]][scale_key]
        return dequantize_fp8_blocks(tensor, scale, self._fp8_block).to(self._fp8_dtype)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight (rows, cols) times scale_inv[i // block[0], j // block[1]] at every (i, j), in float32: the block
    scaling of DeepSeek's FP8 checkpoints (the last blocks of a row or column may be partial)."""
    rows, cols = weight.shape
    if scale_inv.shape != (-(-rows // block[0]), -(-cols // block[1])):
        raise UserError(f"An FP8 weight of shape {tuple(weight.shape)} has scales of shape {tuple(scale_inv.shape)}, "
                        f"which do not tile it in blocks of {block[0]}x{block[1]}.")
    scale = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scale


# The 16 values of a 4-bit e2m1 float (1 sign, 2 exponent and 1 mantissa bit), by their code.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 expert weights as bfloat16 (exact: every value is an e2m1 number times a power of two).

    `blocks` (n_expert, out, in / 32, 16) uint8 holds two 4-bit codes a byte, the low nibble first; `scales`
    (n_expert, out, in / 32) uint8 the power of two of each block of 32, biased by 127 (e8m0). The result is
    (n_expert, in, out), the layout of transformers' unquantized gpt-oss experts.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise UserError(f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} "
                        f"({scales.dtype}) do not fit together; download the checkpoint again.")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    out = torch.empty(blocks.size(0), blocks.size(2) * 32, blocks.size(1), dtype=torch.bfloat16)
    for expert in range(blocks.size(0)):  # one expert at a time bounds the float32 temporaries
        codes = torch.stack((blocks[expert] & 0x0F, blocks[expert] >> 4), dim=-1).flatten(-2)  # (out, groups, 32)
        powers = torch.exp2(scales[expert].to(torch.float32) - 127).unsqueeze(-1)
        out[expert] = (table[codes.long()] * powers).flatten(-2).t()
    return out


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class SafetensorsFile:
    """Zero-copy tensors over a memory-mapped .safetensors file.

    The tensors stay backed by the file (a private copy-on-write mapping), so converting a checkpoint larger than
    RAM needs memory only for the tensors that conversion actually changes (fused q/k/v, dtype casts).
    """

    def __init__(self, path: Path) -> None:
        import mmap
        import struct

        self.path = path
        with open(path, "rb") as f:
            try:
                (header_size,) = struct.unpack("<Q", f.read(8))
                self.header = json.loads(f.read(header_size))
            except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
                raise UserError(f"{str(path)!r} is not a valid safetensors file; download it again.") from None
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.header.pop("__metadata__", None)
        self._data_start = 8 + header_size

    def keys(self) -> list[str]:
        return list(self.header)

    def __getitem__(self, key: str) -> torch.Tensor:
        entry = self.header[key]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise UserError(f"{key} in {str(self.path)!r} has dtype {entry['dtype']}, which litgpt does not read.")
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        start, end = entry["data_offsets"]
        count = (end - start) // dtype.itemsize
        if count == 0:
            return torch.empty(entry["shape"], dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + start)
        return flat.view(entry["shape"])


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"{str(folder)!r} has no config.json: it is not a Hugging Face model folder.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{str(path)!r} is not valid JSON: {error}") from None


def convert_hf_checkpoint(
    checkpoint_dir: Path, *, model_name: Optional[str] = None, dtype: Optional[str] = None, overwrite: bool = False,
    pretrained_checkpoint_dir: Optional[Path] = None,
) -> None:
    """Convert a Hugging Face model folder into litgpt's format, written beside the tokenizer files.

    The litgpt config is derived from the folder's config.json, so any model of a supported architecture converts,
    also one without a registered name.

    Args:
        checkpoint_dir: A folder as written by `save_pretrained` or `litgpt download` (config.json and weights).
        model_name: A registered litgpt name to take the config from (its architecture must match config.json).
        dtype: Store the weights as float32, bfloat16 or float16 (default: as in the checkpoint).
        overwrite: Replace the lit_model.pth that the folder already holds (kept until the new one is complete).
        pretrained_checkpoint_dir: For a PEFT LoRA adapter folder (adapter_config.json, no config.json): the litgpt
            checkpoint of its base model (default: its base_model_name_or_path, as a folder or under checkpoints/).
            The folder then gets lit_model.pth.lora, hyperparameters.yaml, model_config.yaml and the base's
            tokenizer files, for `litgpt merge_lora`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(f"Folder {str(checkpoint_dir)!r} does not exist.")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    from litgpt.convert.peft import convert_peft_adapter, is_peft_folder

    if is_peft_folder(checkpoint_dir):
        if model_name is not None:
            raise UserError("--model_name does not apply to a PEFT adapter folder; its base is --pretrained_checkpoint_dir.")
        return convert_peft_adapter(checkpoint_dir, pretrained_checkpoint_dir, overwrite, DTYPES.get(dtype))
    if pretrained_checkpoint_dir is not None:
        raise UserError(f"--pretrained_checkpoint_dir goes with a PEFT adapter folder; {str(checkpoint_dir)!r} has no "
                        "adapter_config.json.")
    config = resolve_config(checkpoint_dir, model_name)
    if (checkpoint_dir / WEIGHTS_FILE).exists() and not overwrite:
        raise UserError(f"{str(checkpoint_dir / WEIGHTS_FILE)!r} exists already: pass --overwrite true to replace it.")
    weights = HFWeights(checkpoint_dir)
    hf_config = read_hf_config(checkpoint_dir)
    if "text_config" in hf_config:
        weights.language_model_only()
    _read_fp8(weights, hf_config, DTYPES.get(dtype))
    # DeepSeek-V3 and GLM-4.5 publish their multi-token prediction layers as layers n_layer, n_layer + 1, ...: a
    # draft head for speculative decoding, which litgpt does not run; they are left out, with a note.
    mtp_layers = hf_config.get("num_nextn_predict_layers") or 0
    state_dict = dict(convert_weights(weights, config, DTYPES.get(dtype), mtp_layers))
    if config.tie_embeddings:
        # The output head shares the embedding matrix; the state dict names it under both keys, stored once.
        state_dict["lm_head.weight"] = state_dict["transformer.wte.weight"]
    save_state_dict(state_dict, checkpoint_dir / WEIGHTS_FILE)
    config.save(checkpoint_dir / CONFIG_FILE)
    print(f"Wrote {checkpoint_dir / WEIGHTS_FILE} and {checkpoint_dir / CONFIG_FILE} ({config.name or 'unnamed'})")


def _read_fp8(weights: HFWeights, hf: dict, dtype: Optional[torch.dtype]) -> None:
    """DeepSeek-V3's published checkpoints store most weights in FP8 with a scale per block (quant_method "fp8",
    weight_block_size): read them dequantized, in `dtype` (default bfloat16, the dtype of their other tensors)."""
    quantization = hf.get("quantization_config") or {}
    if quantization.get("quant_method") == "fp8":
        block = tuple(quantization.get("weight_block_size") or (128, 128))
        weights.dequantize_fp8(block, dtype or torch.bfloat16)


def resolve_config(checkpoint_dir: Path, model_name: Optional[str]) -> Config:
    """The config from config.json, named after the registered model it equals when there is one."""
    where = str(checkpoint_dir / "config.json")
    derived = config_from_hf(read_hf_config(checkpoint_dir), where)
    if model_name is not None:
        registered = Config.from_name(model_name)
        differences = architecture_differences(registered, derived)
        if differences:
            raise UserError(
                f"--model_name {model_name!r} does not match {where}: {differences}. "
                "Leave out --model_name to use the folder's own config."
            )
        return registered
    from litgpt.configs import configs_by_name

    folder_name = checkpoint_dir.name
    for values in configs_by_name().values():
        if values.get("hf_config", {}).get("name") == folder_name:
            candidate = Config(**values)
            if not architecture_differences(candidate, derived):
                return candidate
    return derived


# Fields that name or describe a model without changing its computation.
_DESCRIPTIVE = {"name", "hf_config", "prompt_style", "padding_multiple"}


def architecture_differences(a: Config, b: Config) -> str:
    diffs = [
        f"{f.name}={getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in fields(Config)
        if f.name not in _DESCRIPTIVE and getattr(a, f.name) != getattr(b, f.name)
    ]
    return ", ".join(diffs)


def convert_weights(
    weights: HFWeights, config: Config, dtype: Optional[torch.dtype], mtp_layers: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield litgpt (name, tensor) pairs, reading and converting one Hugging Face tensor group at a time; the
    `mtp_layers` multi-token prediction layers after the last layer (model.layers.{n_layer}...) are skipped."""
    from litgpt.model import GPT

    with meta_device():
        reference = GPT(config).state_dict()
    available = weights.keys()
    used: set[str] = set()
    rules = list(weight_rules(config, set(reference)))
    with Progress(sum(len(rule.lit) for rule in rules), "Converting weights", unit="tensor") as shown:
        for rule in rules:
            missing = [key for key in rule.hf if key not in available]
            if missing:
                raise UserError(
                    f"The checkpoint in {str(weights.folder)!r} lacks {missing[0]!r}, which its config.json implies. "
                    "The weights and config.json do not belong together."
                )
            tensors = rule.to_lit([weights.get(key) for key in rule.hf], config)
            for name, tensor in zip(rule.lit, tensors):
                if tensor.shape != reference[name].shape:
                    raise UserError(
                        f"{'+'.join(rule.hf)} has shape {tuple(tensor.shape)} in {str(weights.folder)!r}, "
                        f"but config.json implies {tuple(reference[name].shape)} for {name}."
                    )
                # The routers' correction biases stay float32 (as the model keeps them: `litgpt.moe.Router`).
                keep = dtype is None or name.endswith(".e_score_correction_bias")
                yield name, tensor if keep else tensor.to(dtype)
                shown.update(1)
            used.update(rule.hf)
    mtp = tuple(f"model.layers.{config.n_layer + i}." for i in range(mtp_layers))
    skipped = {key for key in available if mtp and key.startswith(mtp)}
    if skipped:
        print(f"Skipped the {mtp_layers} multi-token prediction layer(s) ({len(skipped)} tensors, "
              f"{', '.join(p.rstrip('.') for p in mtp)}): litgpt does not run them.")
    available = available - skipped
    unexpected = sorted(
        key
        for key in available - used
        if not key.endswith(IGNORED_SUFFIXES) and not (config.tie_embeddings and key == "lm_head.weight")
    )
    if unexpected:
        raise UserError(
            f"The checkpoint in {str(weights.folder)!r} has weights its config.json does not explain "
            f"({len(unexpected)}, first: {unexpected[0]!r}); the architecture is not one litgpt supports as is."
        )

"""LoRA adapters between litgpt (`lit_model.pth.lora`) and Hugging Face PEFT (`adapter_config.json` +
`adapter_model.safetensors`).

Export (`litgpt convert_from_litgpt RUN_DIR OUT --peft true`): OUT is the run's *unmerged* base model as a Hugging
Face folder and OUT/adapter/ the adapters as a PEFT LoRA folder, so that
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(OUT), OUT/adapter)` computes what the run's merged
model computes.

Import (`litgpt convert_to_litgpt ADAPTER_DIR`): a PEFT LoRA folder gets `lit_model.pth.lora`, `hyperparameters.yaml`
(the base checkpoint_dir and the `lora_*` settings), `model_config.yaml` and the tokenizer files of the base, the
layout of a LoRA run's step folder, so `litgpt merge_lora ADAPTER_DIR` and then `litgpt generate ADAPTER_DIR` use it.

Both directions read the weight-name map of `litgpt.convert.families`. Our fused q/k/v projection holds one (A, B)
pair per enabled part (q, k, v) over its rows, which are exactly PEFT's q_proj/k_proj/v_proj adapters. Where the
Hugging Face model fuses what litgpt keeps apart, or keeps fused what we split in parts (Phi-3's qkv_proj and
gate_up_proj, GPT-NeoX's query_key_value), the parts are stacked into one adapter of rank (parts x r): A is the parts'
A stacked, B block-diagonal, which is the same update; the way back gives every part the shared A and its rows of B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from litgpt.config import Config
from litgpt.convert.families.weights import Rule, weight_rules
from litgpt.errors import UserError
from litgpt.lora import LoRASettings

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# PEFT names modules as the model class does, which can differ from the checkpoint's keys: transformers 5 calls
# GPT-NeoX's output head `lm_head` (checkpoints, and adapters made with transformers 4, say `embed_out`).
MODULE_NAMES = {"embed_out": "lm_head"}
# PEFT LoRA options whose non-default value changes the adapted model in ways litgpt's LoRA cannot hold.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "adapters on parameters (target_parameters)",
    "lora_bias": "trained biases (lora_bias)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "layer_replication": "layer replication (layer_replication)",
}


# ---- the two layouts, module by module ----------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearGroup:
    """One rule of the weight map over linear weights: litgpt modules `lit` (their rows concatenated in order)
    against Hugging Face modules `hf` (each over `hf_rows` of those rows)."""

    rule: Rule
    lit: tuple[str, ...]
    lit_rows: tuple[int, ...]
    hf: tuple[str, ...]
    hf_rows: tuple[tuple[int, int], ...]


def linear_groups(config: Config, weights: dict[str, torch.Size]) -> Iterator[LinearGroup]:
    """Every group of the weight map whose weights are matrices; `weights` are the plain model's shapes."""
    for rule in weight_rules(config, set(weights)):
        if not rule.lit[0].endswith(".weight") or len(weights[rule.lit[0]]) != 2:
            continue
        lit_rows = tuple(weights[name][0] for name in rule.lit)
        total = sum(lit_rows)
        if rule.kind == "cat" and len(rule.hf) > 1:
            bounds = [0]
            for size in rule.sizes:
                bounds.append(bounds[-1] + size)
            hf_rows = tuple(zip(bounds[:-1], bounds[1:]))
        else:
            hf_rows = ((0, total),)
        lit = tuple(name.removesuffix(".weight") for name in rule.lit)
        hf = tuple(MODULE_NAMES.get(name, name) for name in (name.removesuffix(".weight") for name in rule.hf))
        yield LinearGroup(rule, lit, lit_rows, hf, hf_rows)


def plain_shapes(config: Config) -> dict[str, torch.Size]:
    from litgpt.checkpoint.model_files import meta_device
    from litgpt.model import GPT

    with meta_device():
        return {key: value.shape for key, value in GPT(config).state_dict().items()}


def check_exportable(config: Config) -> None:
    if config.mlp_class_name == "LLaMAMoE":
        raise UserError(
            "LoRA adapters of a mixture-of-experts model cannot be written in PEFT format (transformers keeps the "
            "experts in fused tensors); merge them instead (`litgpt merge_lora`) and convert the merged model."
        )


# ---- export: litgpt -> PEFT -------------------------------------------------------------------------------------------
def peft_adapter(config: Config, settings: LoRASettings, adapters: dict[str, torch.Tensor], dtype: Optional[torch.dtype],
                 source: str = "the LoRA adapters") -> tuple[dict[str, torch.Tensor], dict]:
    """Our adapter tensors (a `lora_state_dict`) as PEFT's tensors and adapter_config.json values (without the base
    model's name)."""
    from litgpt.checkpoint.model_files import meta_device
    from litgpt.lora import add_lora, load_lora_weights, lora_layers
    from litgpt.model import GPT

    check_exportable(config)
    with meta_device():
        model = GPT(config)
    add_lora(model, settings)
    load_lora_weights(model, adapters, source=source)
    layers = dict(lora_layers(model))
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    rank_pattern: dict[str, int] = {}
    for group in linear_groups(config, plain_shapes(config)):
        # Every part of every litgpt module of the group, by its rows in the group's concatenated output.
        parts, offset = [], 0
        for name, rows in zip(group.lit, group.lit_rows):
            if name in layers:
                parts += [(offset + start, offset + stop, a, b) for _, start, stop, a, b in layers[name].lora_factors()]
            offset += rows
        for hf_name, (first, last) in zip(group.hf, group.hf_rows):
            pieces = [(max(s, first), min(e, last), s, a, b) for s, e, a, b in parts if s < last and e > first]
            if not pieces:
                continue
            a_stacked = torch.cat([a for *_, a, _ in pieces], dim=0)
            b_blocks = a_stacked.new_zeros(last - first, a_stacked.shape[0])
            for index, (start, stop, part_start, _, b) in enumerate(pieces):
                b_blocks[start - first: stop - first, index * settings.r: (index + 1) * settings.r] = \
                    b[start - part_start: stop - part_start]
            if group.rule.kind in ("neox_qkv", "falcon_qkv"):  # the rows in GPT-NeoX's (Falcon's) order
                b_blocks = group.rule.to_hf([b_blocks], config)[0]
            short = hf_name.rsplit(".", 1)[-1]
            targets.add(short)
            if len(pieces) > 1:
                rank_pattern[short] = len(pieces) * settings.r
            for factor, tensor in (("lora_A", a_stacked), ("lora_B", b_blocks)):
                tensor = tensor.detach().to(dtype) if dtype is not None else tensor.detach()
                tensors[f"{PEFT_PREFIX}{hf_name}.{factor}.weight"] = tensor.contiguous().clone()
    config_values = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings.r,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(targets),
        # A fused module holding k of our parts has rank k * r and alpha k * alpha: the same alpha / r scale.
        "rank_pattern": rank_pattern,
        "alpha_pattern": {short: rank // settings.r * settings.alpha for short, rank in rank_pattern.items()},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
        "revision": None,
    }
    return tensors, config_values


def write_peft_adapter(folder: Path, tensors: dict[str, torch.Tensor], config_values: dict,
                       base_model_name_or_path: str) -> None:
    """Write adapter_config.json and adapter_model.safetensors into `folder` (a staging folder, published whole)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    values = {"base_model_name_or_path": base_model_name_or_path, **config_values}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(values, indent=2) + "\n")


@dataclass(frozen=True)
class LoRARunExport:
    """What `convert_from_litgpt --peft` reads: the run folder's adapters and settings, and the base they apply to."""

    run_dir: Path
    base_dir: Path
    settings: LoRASettings


def lora_run_export(checkpoint_dir: Path, peft: Optional[bool],
                    pretrained_checkpoint_dir: Optional[Path]) -> Optional[LoRARunExport]:
    """Whether `convert_from_litgpt` writes base + PEFT adapter (None: a plain conversion), checked before any write.

    `peft` None (the default) exports the adapter when the folder holds adapters but no merged weights (a step
    checkpoint of a LoRA run); a folder with merged weights (a run's final/) converts as the merged model unless
    `peft` is True.
    """
    from litgpt.checkpoint.model_files import WEIGHTS_FILE, expand_checkpoints_shorthand
    from litgpt.merge_lora import HPARAMS_FILE, LORA_WEIGHTS_FILE, base_checkpoint_dir, read_hparams

    checkpoint_dir = expand_checkpoints_shorthand(Path(checkpoint_dir))
    has_adapters = (checkpoint_dir / LORA_WEIGHTS_FILE).is_file()
    merged = (checkpoint_dir / WEIGHTS_FILE).is_file()
    if peft is None:
        peft = has_adapters and not merged
        if has_adapters and merged:
            print(f"{checkpoint_dir} holds merged weights: converting the merged model (--peft true writes the base "
                  "model and the LoRA adapters in PEFT format instead).")
    if not peft:
        if pretrained_checkpoint_dir is not None:
            raise UserError("--pretrained_checkpoint_dir names the base of a LoRA run's adapters; it goes with "
                            "--peft true on a folder that holds lit_model.pth.lora.")
        return None
    if not has_adapters:
        raise UserError(
            f"{str(checkpoint_dir)!r} has no {LORA_WEIGHTS_FILE}: --peft true exports the adapters of a LoRA "
            "finetuning run (its final/ or a step-XXXXXX/ folder)."
        )
    hparams = read_hparams(checkpoint_dir)
    settings = LoRASettings.from_hparams(hparams, source=str(checkpoint_dir / HPARAMS_FILE))
    return LoRARunExport(checkpoint_dir, base_checkpoint_dir(checkpoint_dir, hparams, pretrained_checkpoint_dir),
                         settings)


def exported_adapter(export: LoRARunExport, config: Config,
                     dtype: Optional[torch.dtype]) -> tuple[dict[str, torch.Tensor], dict]:
    """The run's adapters as PEFT tensors and adapter_config.json values (read and checked before any write)."""
    from litgpt.merge_lora import LORA_WEIGHTS_FILE, read_lora_adapters

    path = export.run_dir / LORA_WEIGHTS_FILE
    adapters = read_lora_adapters(path, config, export.settings)
    return peft_adapter(config, export.settings, adapters, dtype, source=str(path))


def read_initial_adapter(folder: Path, config: Config,
                         requested: LoRASettings) -> tuple[LoRASettings, dict[str, torch.Tensor]]:
    """The LoRA settings and adapter tensors (our names) a run continues from (finetune_lora --initial_adapter_dir):
    a PEFT adapter folder (adapter_config.json; convert_from_litgpt --peft writes one under adapter/), or a folder
    with lit_model.pth.lora and hyperparameters.yaml (one imported with convert_to_litgpt, a LoRA run's checkpoint,
    ours or LitGPT's). The adapter's rank, scale and targets win over the command's --lora_*; its dropout does not."""
    import dataclasses

    from litgpt.merge_lora import HPARAMS_FILE, LORA_WEIGHTS_FILE, read_hparams, read_lora_adapters

    folder = Path(folder)
    if not is_peft_folder(folder) and is_peft_folder(folder / ADAPTER_DIR):
        folder = folder / ADAPTER_DIR
    if (folder / LORA_WEIGHTS_FILE).is_file():
        settings = LoRASettings.from_hparams(read_hparams(folder), source=str(folder / HPARAMS_FILE))
        tensors = read_lora_adapters(folder / LORA_WEIGHTS_FILE, config, settings)
    elif is_peft_folder(folder):
        modules, _ = read_peft_tensors(folder)
        settings, tensors, _ = litgpt_adapters(config, read_peft_config(folder), modules, str(folder))
    else:
        raise UserError(f"--initial_adapter_dir {str(folder)!r} holds neither a PEFT adapter ({ADAPTER_CONFIG}) nor "
                        f"{LORA_WEIGHTS_FILE}: pass a folder that `convert_from_litgpt --peft` or "
                        "`convert_to_litgpt ADAPTER_DIR` wrote, or a LoRA run's checkpoint.")
    settings = dataclasses.replace(settings, dropout=requested.dropout)
    if settings != requested:
        print(f"Continuing from the adapter in {folder}: r={settings.r}, alpha={settings.alpha} and its targets "
              "replace the --lora_* options.")
    return settings, tensors


# ---- import: PEFT -> litgpt -------------------------------------------------------------------------------------------
def is_peft_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file() and not (Path(folder) / "config.json").is_file()


def read_peft_config(folder: Path) -> dict:
    """adapter_config.json, refused unless it is a LoRA adapter that litgpt's LoRA can hold."""
    path = Path(folder) / ADAPTER_CONFIG
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise UserError(f"{str(path)!r} must hold a JSON object.")
    kind = values.get("peft_type")
    if kind != "LORA":
        raise UserError(f"{str(path)!r} is a PEFT {kind} adapter; litgpt converts LoRA adapters only (peft_type LORA).")
    if values.get("task_type") not in (None, "CAUSAL_LM"):
        raise UserError(f"{str(path)!r} adapts a model for {values['task_type']}; litgpt converts CAUSAL_LM adapters.")
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if values.get(option):
            raise UserError(f"{str(path)!r} uses {what}, which litgpt's LoRA cannot hold; merge it with PEFT instead.")
    if values.get("bias", "none") != "none":
        raise UserError(f"{str(path)!r} trains biases (bias {values['bias']!r}); litgpt's LoRA holds bias 'none' only.")
    if values.get("fan_in_fan_out"):
        raise UserError(f"{str(path)!r} has fan_in_fan_out true (Conv1D layers), which litgpt's models do not have.")
    return values


def read_peft_tensors(folder: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The adapter's factors by Hugging Face module name ({"model.layers.0.self_attn.q_proj": {"A": .., "B": ..}}),
    and the base weights PEFT saved beside them ({"lm_head": tensor}: it saves an adapted head's base weight)."""
    from litgpt.io import load_state_dict

    folder = Path(folder)
    if (folder / ADAPTER_WEIGHTS).is_file():
        from safetensors.torch import load_file

        try:
            raw = load_file(str(folder / ADAPTER_WEIGHTS))
        except Exception as error:  # safetensors raises its own error types for a damaged file
            raise UserError(f"{str(folder / ADAPTER_WEIGHTS)!r} is not a valid safetensors file ({error}).") from None
    elif (folder / "adapter_model.bin").is_file():
        raw = load_state_dict(folder / "adapter_model.bin")
    else:
        raise UserError(f"{str(folder)!r} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} (or adapter_model.bin).")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    saved_base: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        name = key.removeprefix(PEFT_PREFIX)
        module, dot, rest = name.partition(".")
        name = MODULE_NAMES.get(module, module) + dot + rest
        factor = re.fullmatch(r"(.+)\.lora_([AB])(?:\.default)?\.weight", name)
        if factor is not None:
            modules.setdefault(factor.group(1), {})[factor.group(2)] = tensor
        elif name.endswith(".base_layer.weight"):
            saved_base[name.removesuffix(".base_layer.weight")] = tensor
        else:
            raise UserError(
                f"{str(folder)!r} holds {key!r}, which is not a LoRA factor of a linear layer (lora_A/lora_B); "
                "litgpt's LoRA cannot hold it."
            )
    for name, factors in modules.items():
        if set(factors) != {"A", "B"} or factors["A"].shape[0] != factors["B"].shape[1]:
            raise UserError(f"{str(folder)!r}: the adapter of {name} lacks lora_A or lora_B, or their ranks differ.")
    return modules, saved_base


def check_saved_base(config: Config, base_dir: Path, saved_base: dict[str, torch.Tensor], source: str) -> None:
    """The base weights an adapter folder carries must be the base checkpoint's: litgpt's LoRA holds no others."""
    from litgpt.checkpoint.model_files import WEIGHTS_FILE, read_model_weights

    if not saved_base:
        return
    lit_of = {hf: lit for group in linear_groups(config, plain_shapes(config)) if group.rule.kind == "copy"
              for hf, lit in zip(group.hf, group.lit)}
    base = read_model_weights(base_dir / WEIGHTS_FILE)
    for hf_name, tensor in saved_base.items():
        ours = base.get(f"{lit_of.get(hf_name)}.weight")
        if ours is None or ours.shape != tensor.shape or not torch.equal(ours.to(tensor.dtype), tensor):
            raise UserError(
                f"{source} carries a weight of {hf_name} that differs from the base checkpoint's (a retrained or "
                "resized layer); litgpt's LoRA holds adapters on an unchanged base only."
            )


def pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name that ends with it."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def full_lora_parts(config: Config) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """Every linear layer litgpt's LoRA can adapt in this model, with its parts (suffix, row start, row stop)."""
    from litgpt.checkpoint.model_files import meta_device
    from litgpt.lora import add_lora, lora_layers
    from litgpt.model import GPT

    everything = LoRASettings(r=1, alpha=1, query=True, key=True, value=True, projection=True, mlp=True,
                              head=not config.tie_embeddings)
    with meta_device():
        model = GPT(config)
    add_lora(model, everything)
    return {name: layer.lora_parts for name, layer in lora_layers(model)}


def switch_of(module: str, suffix: str) -> str:
    """The LoRASettings switch that adapts this part of this litgpt module."""
    if module.endswith("attn.qkv"):
        return {"_q": "query", "_k": "key", "_v": "value"}[suffix]
    if module.endswith("attn.proj"):
        return "projection"
    return "head" if module == "lm_head" else "mlp"


def litgpt_adapters(config: Config, peft_values: dict, modules: dict[str, dict[str, torch.Tensor]],
                    source: str) -> tuple[LoRASettings, dict[str, torch.Tensor], int]:
    """A PEFT adapter's factors as our LoRASettings and `lit_model.pth.lora` tensors, exactly the same update.

    Parts of our layers that the adapter leaves alone (some layers only, part of the MLP) get zero factors; a module
    fused in Hugging Face gives each of our parts its shared A and its rows of B. Ranks or scales that differ between
    modules are folded into B (scale) and zero padding (rank). Returns (settings, tensors, zero-filled parts).
    """
    check_exportable(config)
    shapes = plain_shapes(config)
    adaptable = full_lora_parts(config)
    assigned = assign_parts(config, shapes, adaptable, peft_values, modules, source)
    ranks_scales = {(a.shape[0], scale) for a, _, scale in assigned.values()}
    if len(ranks_scales) == 1:
        ((r, scale),) = ranks_scales
        alpha = scale * r
    else:
        r = alpha = max(rank for rank, _ in ranks_scales)  # scale 1: every module's own scale goes into its B
    switches = {switch_of(module, suffix) for module, suffix in assigned}
    settings = LoRASettings(r=r, alpha=_plain_number(alpha), dropout=float(peft_values.get("lora_dropout") or 0.0),
                            **{name: name in switches for name in ("query", "key", "value", "projection", "mlp", "head")})
    tensors, zero_filled = {}, 0
    for module, parts in adaptable.items():
        for suffix, start, stop in parts:
            if switch_of(module, suffix) not in switches:
                continue
            a_ours = torch.zeros(r, shapes[f"{module}.weight"][1])
            b_ours = torch.zeros(stop - start, r)
            if (module, suffix) in assigned:
                a, b, scale = assigned[module, suffix]
                a_ours[: a.shape[0]] = a
                b_ours[:, : b.shape[1]] = b * (scale / settings.scaling)
            else:
                zero_filled += 1
            tensors[f"{module}.lora_A{suffix}"], tensors[f"{module}.lora_B{suffix}"] = a_ours, b_ours
    return settings, tensors, zero_filled


def assign_parts(config: Config, shapes: dict, adaptable: dict, peft_values: dict,
                 modules: dict[str, dict[str, torch.Tensor]], source: str) -> dict:
    """{(our module, part suffix): (A, B rows of that part, scale)} from the adapter's modules, each checked."""
    rslora = bool(peft_values.get("use_rslora"))
    assigned: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    used = set()
    for group in linear_groups(config, shapes):
        in_features = shapes[f"{group.lit[0]}.weight"][1]
        for hf_name, (first, last) in zip(group.hf, group.hf_rows):
            if hf_name not in modules:
                continue
            used.add(hf_name)
            a, b = modules[hf_name]["A"].float(), modules[hf_name]["B"].float()
            if a.shape[1] != in_features or b.shape[0] != last - first:
                raise UserError(
                    f"The adapter of {hf_name} in {source} has shapes A {tuple(a.shape)}, B {tuple(b.shape)}, which "
                    f"do not fit the base model ({last - first} x {in_features}): it belongs to another base model."
                )
            if group.rule.kind in ("neox_qkv", "falcon_qkv"):
                b = group.rule.to_lit([b], config)[0]
            rank = a.shape[0]
            alpha = pattern_value(peft_values.get("alpha_pattern"), hf_name, peft_values.get("lora_alpha", 8))
            scale = alpha / math.sqrt(rank) if rslora else alpha / rank
            offset = 0
            for lit_name, rows in zip(group.lit, group.lit_rows):
                parts = adaptable.get(lit_name)
                if parts is None and offset < last and offset + rows > first:
                    raise UserError(
                        f"{source} adapts {hf_name}, which litgpt's LoRA does not adapt (litgpt's {lit_name}); "
                        "litgpt adapts attention and MLP linear layers and the output head."
                    )
                for suffix, start, stop in parts or ():
                    start, stop = offset + start, offset + stop
                    if first <= start and stop <= last:
                        assigned[(lit_name, suffix)] = (a, b[start - first: stop - first], scale)
                offset += rows
    unknown = sorted(set(modules) - used)
    if unknown:
        raise UserError(
            f"{source} adapts {unknown[0]!r} ({len(unknown)} such modules), which is not a linear layer of the base "
            "model: the adapter belongs to another architecture."
        )
    if not assigned:
        raise UserError(f"{source} holds no LoRA factors.")
    return assigned


def _plain_number(value: float):
    return int(round(value)) if abs(value - round(value)) < 1e-9 else float(value)


def peft_base_dir(folder: Path, peft_values: dict, pretrained_checkpoint_dir: Optional[Path]) -> Path:
    """The litgpt checkpoint the adapter applies to: --pretrained_checkpoint_dir, else the adapter's
    base_model_name_or_path as a folder or as `checkpoints/ORG/NAME` (where `litgpt download` puts it)."""
    from litgpt.checkpoint.model_files import WEIGHTS_FILE, find_checkpoint_dir

    if pretrained_checkpoint_dir is not None:
        return find_checkpoint_dir(Path(pretrained_checkpoint_dir))
    named = peft_values.get("base_model_name_or_path")
    for candidate in ([Path(named), Path("checkpoints") / named] if named else []):
        if (candidate / WEIGHTS_FILE).is_file():
            return find_checkpoint_dir(candidate)
    where = f"its base {named!r} is not a litgpt checkpoint here" if named else "it names no base model"
    raise UserError(
        f"{str(Path(folder) / ADAPTER_CONFIG)!r}: {where}; pass --pretrained_checkpoint_dir with the litgpt "
        "checkpoint of the model it was trained on (`litgpt download ORG/NAME` writes one)."
    )


def convert_peft_adapter(folder: Path, pretrained_checkpoint_dir: Optional[Path], overwrite: bool,
                         dtype: Optional[torch.dtype] = None) -> None:
    """Write a PEFT LoRA folder's adapter as litgpt's: lit_model.pth.lora (float32, or `dtype`),
    hyperparameters.yaml, model_config.yaml and the base's tokenizer files (those the folder lacks) into the folder;
    every check comes before any write."""
    from litgpt.checkpoint.model_files import CONFIG_FILE, TOKENIZER_FILES, WEIGHTS_FILE
    from litgpt.io import atomic_copy, save_state_dict, write_yaml
    from litgpt.merge_lora import HPARAMS_FILE, LORA_WEIGHTS_FILE, write_base_record

    folder = Path(folder)
    peft_values = read_peft_config(folder)
    if (folder / WEIGHTS_FILE).exists():
        raise UserError(
            f"{str(folder / WEIGHTS_FILE)!r} holds weights merged from an earlier conversion, which new adapters would "
            "not match: delete it, convert again, then merge again."
        )
    written = [name for name in (LORA_WEIGHTS_FILE, HPARAMS_FILE, CONFIG_FILE) if (folder / name).exists()]
    if written and not overwrite:
        raise UserError(f"{str(folder / written[0])!r} exists already: pass --overwrite true to replace it.")
    base_dir = peft_base_dir(folder, peft_values, pretrained_checkpoint_dir)
    config = Config.from_checkpoint(base_dir)
    modules, saved_base = read_peft_tensors(folder)
    settings, tensors, zero_filled = litgpt_adapters(config, peft_values, modules, str(folder))
    check_saved_base(config, base_dir, saved_base, str(folder))

    if dtype is not None:
        tensors = {key: tensor.to(dtype) for key, tensor in tensors.items()}
    save_state_dict(tensors, folder / LORA_WEIGHTS_FILE)
    config.save(folder / CONFIG_FILE)
    for name in TOKENIZER_FILES:
        if not (folder / name).exists() and (base_dir / name).is_file():
            atomic_copy(base_dir / name, folder / name)
    write_base_record(folder, str(base_dir), base_dir)
    # Last: hyperparameters.yaml is what makes the folder a LoRA run's for merge_lora.
    write_yaml(folder / HPARAMS_FILE, {"checkpoint_dir": str(base_dir.resolve()), **settings.to_hparams()})
    switched = ", ".join(f"lora_{name}" for name in ("query", "key", "value", "projection", "mlp", "head")
                         if getattr(settings, name))
    note = f"; {zero_filled} parts the adapter leaves alone hold zeros" if zero_filled else ""
    print(f"Wrote {folder / LORA_WEIGHTS_FILE} (r={settings.r}, alpha={settings.alpha}, {switched}) for the base "
          f"{base_dir}{note}. `litgpt merge_lora {folder}` merges it.")

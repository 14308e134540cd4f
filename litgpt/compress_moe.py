"""`litgpt compress_moe`: a mixture-of-experts checkpoint with fewer experts per layer, chosen by routing data.

Calibration data goes through the model once; a forward hook on every MoE layer's router (`mlp.gate`) turns its
logits into the routing the model applies (`LLaMAMoE.route_logits`: softmax or sigmoid scores, the top
`n_expert_per_token`, chosen with the correction bias of DeepSeek-style routers, renormalized when `moe_renormalize`)
and sums, per expert, the routing weight it receives and the tokens routed to it. The experts with the most weight
stay (`--strategy merge` folds the others into their nearest kept expert); the new checkpoint holds their router rows
(and correction biases) and weights, in the source's dtype, under new, consecutive indices. Dense layers and shared
experts stay as they are; group-limited routers are refused (dropping experts would unbalance their groups).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from litgpt.data.base import DataModule
from litgpt.errors import UserError
from litgpt.progress import progress

STRATEGIES = ("top_routed", "merge")
REPORT_FILE = "compress_moe.json"
DEFAULT_SEQ_LENGTH = 512
EXPERT_KEY = re.compile(r"transformer\.h\.(\d+)\.mlp\.experts\.(\d+)\.(.+)")


@dataclass
class CalibrationArgs:
    """The data routed through the model to measure what each expert receives.

    Args:
        samples: How many samples of the data's training split to route (all of them when it has fewer), drawn in an
            order fixed by `seed`.
        max_seq_length: Tokens per sample (default: 512, or the model's block size when that is shorter).
        batch_size: Samples per forward pass.
        seed: Seed of the draw of samples.
    """

    samples: int = 128
    max_seq_length: Optional[int] = None
    batch_size: int = 4
    seed: int = 42


def main(
    checkpoint_dir: Path,
    *,
    out_dir: Path,
    num_experts: int,
    strategy: str = "top_routed",
    data: Optional[DataModule] = None,
    calibration: CalibrationArgs = CalibrationArgs(),
    precision: Optional[str] = None,
    device: str = "auto",
    overwrite: bool = False,
) -> None:
    """Keep `num_experts` experts in every mixture-of-experts layer of a checkpoint, chosen by routing calibration data.

    The rule (`--strategy top_routed`): per layer, the experts that receive the most routing weight over the
    calibration tokens stay (a token's routing weight for an expert is its softmax probability if the expert is among
    the token's top n_expert_per_token, renormalized over those when the model renormalizes, else 0); equal weights
    go to the lower expert index. Kept experts keep their original order and are numbered 0..K-1; the router keeps
    their rows. `--strategy merge` keeps the same experts, then folds each dropped expert into its nearest kept one
    (highest cosine similarity of all its weights flattened, ties to the lower index): a kept expert becomes the
    average of itself and the experts folded into it, weighted by their routing weight (unchanged when that is all 0);
    the router keeps the kept experts' rows.

    The folder written to out_dir holds lit_model.pth, model_config.yaml (n_expert: K, everything else as in the
    source), the tokenizer files and compress_moe.json (per layer: the kept experts with their routing share and
    tokens, the share of routing weight kept, and for merge which experts were folded into which). It is written under
    a temporary name and renamed into place when complete. Calibration runs in this one process, on one device,
    which must hold the whole model.

    Args:
        checkpoint_dir: A litgpt checkpoint of a mixture-of-experts model (lit_model.pth, model_config.yaml, tokenizer).
        out_dir: The folder to write. An existing one that is not empty is refused unless --overwrite true.
        num_experts: Experts to keep per layer: at least the model's n_expert_per_token, at most its n_expert.
        strategy: top_routed (keep the most-routed experts) or merge (keep them and fold the others into them).
        data: The calibration data: any data module of the training commands, in the checkpoint's prompt style
            (default: the bundled tiny corpus, `Tiny`).
        calibration: How many samples (--calibration.samples), of how many tokens (--calibration.max_seq_length),
            in batches of --calibration.batch_size.
        precision: The dtype calibration runs in: 32-true, 16-true or bf16-true. Default: bf16-true on GPUs
            and on CPUs with native bf16 (AVX512-BF16 or AMX), 32-true on other CPUs.
            The weights written keep the checkpoint's dtype.
        device: Where calibration runs: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.
        overwrite: Replace an out_dir that is not empty (the old folder stays until the new one is complete).
    """
    from litgpt.checkpoint.model_files import WEIGHTS_FILE, find_checkpoint_dir
    from litgpt.config import Config

    checkpoint_dir = find_checkpoint_dir(Path(checkpoint_dir))
    config = Config.from_checkpoint(checkpoint_dir)
    check_request(config, num_experts, strategy, calibration)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, checkpoint_dir, overwrite)
    if data is None:
        from litgpt.data import Tiny

        data = Tiny()

    from litgpt.checkpoint.model_files import read_model_weights
    from litgpt.generate import load_model_and_tokenizer

    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(checkpoint_dir, precision, device)
    batches = calibration_batches(data, tokenizer, config, calibration)
    routing = collect_routing(model, batches)
    del model
    kept = {layer: select_experts(routing.weight[layer], num_experts) for layer in routing.layers}
    state_dict = read_model_weights(checkpoint_dir / WEIGHTS_FILE)
    merged_into = {layer: {} for layer in kept}
    if strategy == "merge":
        experts = experts_by_layer(state_dict)
        merged_into = {layer: nearest_kept_experts(experts[layer], layer_kept) for layer, layer_kept in kept.items()}
    compressed = compress_state_dict(state_dict, kept, merged_into, routing.weight)
    report = compression_report(checkpoint_dir, strategy, calibration_length(calibration, config), routing, kept,
                                merged_into)
    write_compressed(checkpoint_dir, out_dir, compressed, num_experts, report)
    print_summary(report)
    print(f"Wrote {out_dir} in {time.perf_counter() - start:.1f} s. Export it with "
          f"`litgpt convert_from_litgpt {out_dir} OUT_DIR`.")


# ---- checks ---------------------------------------------------------------------------------------------------------
def check_request(config, num_experts: int, strategy: str, calibration: CalibrationArgs) -> None:
    """UserError for a request that cannot be met, before anything is loaded."""
    if config.mlp_class_name != "LLaMAMoE":
        raise UserError(
            f"The model ({config.name or 'unnamed'}) is dense ({config.mlp_class_name}): compress_moe needs a "
            "mixture-of-experts checkpoint (mlp_class_name LLaMAMoE), such as Mixtral or Qwen3-MoE."
        )
    if config.moe_n_group > 1:
        raise UserError(
            f"compress_moe keeps the same experts in every group of a layer's router only by chance: this model routes "
            f"within {config.moe_n_group} groups of experts (moe_n_group), which compress_moe does not support."
        )
    if not config.n_expert_per_token <= num_experts <= config.n_expert:
        raise UserError(
            f"--num_experts {num_experts} is out of range: the model has {config.n_expert} experts per layer and "
            f"routes each token to {config.n_expert_per_token}, so keep between {config.n_expert_per_token} and "
            f"{config.n_expert}."
        )
    if strategy not in STRATEGIES:
        raise UserError(f"--strategy {strategy!r} is not one of {', '.join(STRATEGIES)}.")
    for name in ("samples", "batch_size"):
        if getattr(calibration, name) < 1:
            raise UserError(f"--calibration.{name} must be at least 1, got {getattr(calibration, name)}.")
    length = calibration.max_seq_length
    if length is not None and not 1 <= length <= config.block_size:
        raise UserError(
            f"--calibration.max_seq_length {length} must be between 1 and the model's block size {config.block_size}."
        )


def check_out_dir(out_dir: Path, checkpoint_dir: Path, overwrite: bool) -> None:
    if out_dir.resolve() == checkpoint_dir.resolve():
        raise UserError(f"--out_dir {str(out_dir)!r} is the checkpoint being compressed: choose another folder.")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out_dir {str(out_dir)!r} is a file: choose a folder.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(
            f"--out_dir {str(out_dir)!r} already exists and is not empty: pass --overwrite true to replace it, or "
            "choose another folder."
        )


# ---- calibration ----------------------------------------------------------------------------------------------------
def calibration_batches(data: DataModule, tokenizer, config, calibration: CalibrationArgs) -> list[tuple]:
    """(input_ids (B, T), lengths (B,)) batches of the first `calibration.samples` samples in the seed's order."""
    from litgpt.data.base import collate, epoch_order
    from litgpt.prompts import PromptStyle

    data.connect(tokenizer, calibration_length(calibration, config), PromptStyle.from_config(config))
    data.prepare()
    dataset = data.train_dataset()
    if len(dataset) == 0:
        raise UserError(f"The calibration data ({type(data).__name__}) has no training samples.")
    if len(dataset) < calibration.samples:
        print(f"Note: the calibration data has {len(dataset)} samples, fewer than --calibration.samples "
              f"{calibration.samples}; routing all of them.")
    order = epoch_order(len(dataset), calibration.seed, 0)[: calibration.samples].tolist()
    batches = []
    for first in range(0, len(order), calibration.batch_size):
        samples = [dataset[i] for i in order[first : first + calibration.batch_size]]
        lengths = torch.tensor([sample["input_ids"].numel() for sample in samples])
        batches.append((collate(samples)["input_ids"], lengths))
    return batches


def calibration_length(calibration: CalibrationArgs, config) -> int:
    return calibration.max_seq_length or min(DEFAULT_SEQ_LENGTH, config.block_size)



@dataclass
class Routing:
    """What the calibration tokens gave each expert: weight and tokens are (n_layer, n_expert), zero in the dense
    layers; `layers` lists the layers with experts."""

    layers: list[int]
    weight: torch.Tensor  # float64: the sum of the routing weight each expert received
    tokens: torch.Tensor  # int64: how many tokens were routed to each expert
    num_samples: int
    num_tokens: int  # calibration tokens (each reaches every layer once)


@torch.no_grad()
def collect_routing(model, batches: list[tuple]) -> Routing:
    """Run `batches` through `model`, summing the routing of every MoE layer from its router's logits."""
    config = model.config
    device = model.lm_head.weight.device
    weight = torch.zeros(config.n_layer, config.n_expert, dtype=torch.float64)
    tokens = torch.zeros(config.n_layer, config.n_expert, dtype=torch.int64)
    batch_weight, batch_tokens = {}, {}
    current = {}

    def hook_for(layer: int):
        def hook(module, inputs, logits) -> None:
            logits = logits.reshape(-1, config.n_expert)
            real = current["mask"]
            if logits.shape[0] != real.numel():  # the layer routed something other than the batch's tokens
                raise RuntimeError(f"layer {layer}'s router saw {logits.shape[0]} tokens, the batch has {real.numel()}")
            top_weights, top_experts, _ = model.transformer.h[layer].mlp.route_logits(logits)
            real = real[:, None].expand_as(top_experts).flatten()  # padding counts 0 (a mask, not a host sync)
            experts = top_experts.flatten()
            zeros = torch.zeros(config.n_expert, device=logits.device)
            batch_weight[layer] = zeros.index_add(0, experts, top_weights.flatten() * real)
            batch_tokens[layer] = zeros.long().index_add(0, experts, real.long())

        return hook

    layers = [layer for layer in range(config.n_layer) if config.is_moe_layer(layer)]
    handles = [model.transformer.h[layer].mlp.gate.register_forward_hook(hook_for(layer)) for layer in layers]
    num_samples = num_tokens = 0
    try:
        for input_ids, lengths in progress(batches, "Calibrating the routing", unit="batch"):
            positions = torch.arange(input_ids.shape[1])
            current["mask"] = (positions[None, :] < lengths[:, None]).flatten().to(device)
            batch_weight.clear()
            batch_tokens.clear()
            model(input_ids.to(device), return_hidden=True)  # the head's logits are not needed
            if sorted(batch_weight) != layers:  # a MoE layer that applies its router weight without the module
                raise RuntimeError(f"the routers (mlp.gate) of layers {sorted(batch_weight)} ran, not of all {layers}")
            weight[layers] += torch.stack([batch_weight[layer] for layer in layers]).double().cpu()
            tokens[layers] += torch.stack([batch_tokens[layer] for layer in layers]).cpu()
            num_samples, num_tokens = num_samples + len(lengths), num_tokens + int(lengths.sum())
    finally:
        for handle in handles:
            handle.remove()
    return Routing(layers=layers, weight=weight, tokens=tokens, num_samples=num_samples, num_tokens=num_tokens)


# ---- selection and merging ------------------------------------------------------------------------------------------
def select_experts(routing_weight: torch.Tensor, num_experts: int) -> list[int]:
    """The `num_experts` experts with the most routing weight, equal weights to the lower index, in index order."""
    values = routing_weight.tolist()
    ranked = sorted(range(len(values)), key=lambda expert: (-values[expert], expert))
    return sorted(ranked[:num_experts])


def experts_by_layer(state_dict: dict) -> dict[int, dict[int, dict[str, torch.Tensor]]]:
    """{layer: {expert: {name inside the expert (fc_1.weight, fc_2.weight, proj.weight, biases): tensor}}}."""
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in state_dict.items():
        match = EXPERT_KEY.fullmatch(key)
        if match is not None:
            experts.setdefault(int(match[1]), {}).setdefault(int(match[2]), {})[match[3]] = value
    return experts


def nearest_kept_experts(layer_experts: dict[int, dict[str, torch.Tensor]], kept: list[int]) -> dict[int, int]:
    """{dropped expert: the kept expert whose weights, all flattened into one vector, have the highest cosine
    similarity to its own}, ties to the lower kept index."""
    dropped = [expert for expert in sorted(layer_experts) if expert not in kept]
    if not dropped:
        return {}

    def unit_vectors(experts: list[int]) -> torch.Tensor:
        flat = [torch.cat([layer_experts[e][name].float().flatten() for name in sorted(layer_experts[e])])
                for e in experts]
        return torch.nn.functional.normalize(torch.stack(flat), dim=1)

    similarity = (unit_vectors(dropped) @ unit_vectors(kept).T).tolist()  # (dropped, kept): one matmul per layer
    nearest = {}
    for expert, row in zip(dropped, similarity):
        nearest[expert] = kept[max(range(len(kept)), key=lambda i: (row[i], -kept[i]))]
    return nearest


def merged_expert(layer_experts: dict[int, dict[str, torch.Tensor]], expert: int, folded: list[int],
                  weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The routing-weight-weighted average of `expert` and the experts `folded` into it (computed in float32)."""
    group = [expert, *folded]
    total = sum(float(weight[e]) for e in group)
    own = layer_experts[expert]
    if not folded or total == 0:
        return own
    return {
        name: sum(layer_experts[e][name].float() * (float(weight[e]) / total) for e in group).to(tensor.dtype)
        for name, tensor in own.items()
    }


def compress_state_dict(
    state_dict: dict, kept: dict[int, list[int]], merged_into: dict[int, dict[int, int]], weight: torch.Tensor
) -> dict:
    """The source weights with, per MoE layer (the keys of `kept`), the kept router rows and correction biases and
    the kept (or merged) experts numbered 0..K-1."""
    experts = experts_by_layer(state_dict)
    new_experts = {}  # (layer, new index) -> {name: tensor}
    for layer, layer_kept in kept.items():
        for new_index, expert in enumerate(layer_kept):
            folded = sorted(dropped for dropped, target in merged_into[layer].items() if target == expert)
            new_experts[layer, new_index] = merged_expert(experts[layer], expert, folded, weight[layer])
    compressed = {}
    for key, value in state_dict.items():
        match = EXPERT_KEY.fullmatch(key)
        if match is not None:
            layer, expert, name = int(match[1]), int(match[2]), match[3]
            if expert in kept[layer]:
                new = kept[layer].index(expert)
                compressed[f"transformer.h.{layer}.mlp.experts.{new}.{name}"] = new_experts[layer, new][name]
        elif key.endswith((".mlp.gate.weight", ".mlp.gate.bias", ".mlp.gate.e_score_correction_bias")):  # the router's rows (and bias) of the kept experts
            layer = int(key.split(".")[2])
            compressed[key] = value[kept[layer]].contiguous()
        else:
            compressed[key] = value
    return compressed


# ---- output ---------------------------------------------------------------------------------------------------------
def compression_report(checkpoint_dir: Path, strategy: str, seq_length: int, routing: Routing,
                       kept: dict[int, list[int]], merged_into: dict[int, dict[int, int]]) -> dict:
    """What compress_moe.json records: per MoE layer the kept experts and their shares, and the totals."""
    layers = []
    for layer, layer_kept in kept.items():
        total = float(routing.weight[layer].sum())
        layers.append({
            "layer": layer,
            "kept": [{"expert": e, "routing_share": float(routing.weight[layer, e]) / total,
                      "tokens": int(routing.tokens[layer, e])} for e in layer_kept],
            "kept_share": float(routing.weight[layer, layer_kept].sum()) / total,
            "merged_into": {str(d): k for d, k in merged_into[layer].items()},
        })
    kept_weight = sum(float(routing.weight[layer, layer_kept].sum()) for layer, layer_kept in kept.items())
    return {
        "source": str(checkpoint_dir),
        "strategy": strategy,
        "num_experts": len(next(iter(kept.values()))),
        "source_num_experts": routing.weight.shape[1],
        "calibration": {"samples": routing.num_samples, "max_seq_length": seq_length, "tokens": routing.num_tokens},
        "kept_share": kept_weight / float(routing.weight.sum()),
        "layers": layers,
    }


def write_compressed(checkpoint_dir: Path, out_dir: Path, state_dict: dict, num_experts: int, report: dict) -> None:
    """Write the compressed checkpoint folder under a temporary name and put it in place of out_dir when complete."""
    import yaml

    from litgpt.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE, copy_tokenizer_files
    from litgpt.checkpoint.store import publish_dir
    from litgpt.config import Config
    from litgpt.io import save_state_dict, write_json, write_yaml

    values = yaml.safe_load((checkpoint_dir / CONFIG_FILE).read_text())
    values["n_expert"] = num_experts
    Config.from_dict(values, source="the compressed config")  # still a valid model
    try:
        with publish_dir(out_dir) as staging:
            save_state_dict(state_dict, staging / WEIGHTS_FILE)
            write_yaml(staging / CONFIG_FILE, values)
            copy_tokenizer_files(checkpoint_dir, staging)
            write_json(staging / REPORT_FILE, report)
    except OSError as error:  # disk full, quota, read-only: out_dir is as it was
        raise UserError(f"Could not write {str(out_dir)!r}: {error.strerror or error}. Nothing there was replaced; "
                        "make room and run it again.") from None


def print_summary(report: dict) -> None:
    for layer in report["layers"]:
        merged = ", ".join(f"{d}->{k}" for d, k in layer["merged_into"].items())
        print(f"layer {layer['layer']:>3}: kept experts {[e['expert'] for e in layer['kept']]} of "
              f"{report['source_num_experts']}, {layer['kept_share']:.1%} of the routing weight"
              + (f" (merged {merged})" if merged else ""))
    print(f"Kept {report['kept_share']:.1%} of the routing weight over {len(report['layers'])} layers "
          f"({report['calibration']['tokens']} calibration tokens).")

"""Every parameter of the models a run holds, by FSDP unit (the root, then each block): shapes, whether it trains,
whether `--quantize` stores it in 4 or 8 bits."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from torch import nn

from litgpt.config import Config

if TYPE_CHECKING:
    from litgpt.plan.pipeline import Stage
    from litgpt.train.recipe import Recipe


@dataclass
class Param:
    shape: tuple[int, ...]
    trainable: bool
    quantized: bool
    expert: bool = False  # a routed expert's, held by its expert group's rank (--parallel.expert)
    optimized: bool = True  # False: the copy of a tied head a pipeline's first stage holds (no optimizer state)


@dataclass
class Layout:
    root: list[Param]  # the embedding, the final norm and the head
    blocks: list[list[Param]]  # one FSDP unit per block
    quantized_shapes: list[tuple[int, ...]]  # of the quantized weights
    embedding: list[Param] = dataclasses.field(default_factory=list)  # the token embedding's, of `root`
    head: list[Param] = dataclasses.field(default_factory=list)  # the output head's, of `root`

    @property
    def params(self) -> list[Param]:
        return self.root + [p for block in self.blocks for p in block]

    @property
    def total_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @property
    def trainable_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params if p.trainable)

    @property
    def top_block_trainable(self) -> list[Param]:
        return [p for p in self.blocks[-1] if p.trainable] if self.blocks else []


def parameter_layout(recipe: "Recipe", expert: int = 1, model: Optional[nn.Module] = None) -> Layout:
    """The recipe's model as it trains (`Recipe.build_model`: adapters added, what trains requiring gradients; or
    `model`, built so), with the blocks' linear weights marked quantized under `recipe.quantize`. Under `expert`-way
    expert parallelism one rank's: n_expert / expert routed experts of every MoE layer (with their adapters), marked
    `expert` (FSDP shards them over the ranks holding the same experts); the router and the shared experts whole."""
    model = recipe.build_model() if model is None else model
    return _layout(model, recipe.config.n_layer, quantized_weights(recipe, model), expert)


def stage_layout(recipe: "Recipe", stages: "list[Stage]", expert: int = 1) -> Layout:
    """`parameter_layout` of what a pipeline rank holds: the parameters of its `stages`
    (`litgpt.plan.pipeline.Stage`) as `litgpt.distributed.pipeline.StageModule` cuts the recipe's model: their blocks
    (`Layout.blocks`, in order), the embedding on the first stage, the final norm and the head on the last."""
    import torch

    from litgpt.distributed.pipeline import StageModule

    model = recipe.build_model()
    held = {id(param) for stage in stages
            for param in StageModule(model, stage.index, stage.n_stages, stage.layers, torch.float32).parameters()}
    layout = _layout(model, recipe.config.n_layer, quantized_weights(recipe, model), expert, held=held)
    root = layout.root
    if model.lm_head.weight is model.transformer.wte.weight and any(stage.index == 0 for stage in stages):
        # A tied head: the first stage holds the embedding as a copy of the last stage's head (`TiedEmbedding`)
        tied = model.lm_head.weight
        copy = Param(tuple(tied.shape), tied.requires_grad, quantized=False, optimized=False)
        holds_head = any(stage.index == stage.n_stages - 1 for stage in stages)
        root = root + [copy] if holds_head else [copy if p.shape == copy.shape else p for p in root]
    return Layout(root, [layout.blocks[index] for stage in stages for index in stage.layers],
                  layout.quantized_shapes)


def quantized_weights(recipe: "Recipe", model: nn.Module) -> set[int]:
    """The ids of the weights `recipe.quantize` quantizes: the blocks' linear layers' (none without it)."""
    from litgpt.quantize import quantize_targets

    return {id(layer.weight) for _, _, layer in quantize_targets(model)} if recipe.quantize else set()


def rank_recipe(recipe: "Recipe", tensor: int) -> "Recipe":
    """The recipe of one rank's piece of the model under `tensor`-way tensor parallelism: the plans
    (`litgpt.distributed.plans.dense`) give each rank 1/tensor of the heads (latent attention's too, its
    down-projections whole), key-value groups (with their fused qkv rows), MLP width, every expert's and the shared
    experts' width (the router whole) and vocabulary rows, and LoRA factors split as their layers are
    (`plans.styles`); a model of those sizes has the rank's parameter shapes and runs its attention and MLP as the
    rank does."""
    return recipe if tensor == 1 else dataclasses.replace(recipe, config=rank_config(recipe.config, tensor))


def rank_config(config: Config, tensor: int) -> Config:
    """The config of one rank's piece of a model of `config` under `tensor`-way tensor parallelism (`rank_recipe`):
    the trained model's, or a frozen one's (a teacher is split alike)."""
    if tensor == 1:
        return config
    vocab_rows = config.padded_vocab_size // tensor
    heads = config.n_head // tensor
    experts, shared = config.moe_intermediate_size, config.moe_shared_intermediate_size  # None: a dense model
    return dataclasses.replace(
        config, n_head=heads, head_size=config.head_size, intermediate_size=config.intermediate_size // tensor,
        # latent attention has no key-value groups: every head expands the latent
        n_query_groups=heads if config.kv_lora_rank is not None else config.n_query_groups // tensor,
        moe_intermediate_size=None if experts is None else experts // tensor,
        moe_shared_intermediate_size=None if shared is None else shared // tensor,
        padded_vocab_size=vocab_rows, vocab_size=min(config.vocab_size, vocab_rows),
    )


def frozen_layout(config: Config) -> Layout:
    """A frozen model the recipe holds beside the trained one (`Recipe.frozen_configs`): the plain model of `config`,
    as `Recipe.build_frozen` builds it, nothing trainable."""
    from litgpt.train.recipe import Recipe

    return _layout(Recipe.build_frozen(config), config.n_layer, set())


def routed_expert(name: str) -> "int | None":
    """The index of the routed expert a parameter name belongs to (`transformer.h.<i>.mlp.experts.<j>.`), else None."""
    from litgpt.distributed.plans.experts import MOE_LAYER, SPLIT

    parts = name.split(".")
    if len(parts) > 5 and parts[:2] == ["transformer", "h"] and parts[3:5] == [MOE_LAYER, SPLIT]:
        return int(parts[5])
    return None


def _layout(model: nn.Module, n_layer: int, quantized: set[int], expert: int = 1,
            held: "set[int] | None" = None) -> Layout:
    """`model`'s parameters by FSDP unit; only those in `held` (their ids) where given."""
    root: list[Param] = []
    embedding: list[Param] = []
    head: list[Param] = []
    blocks: list[list[Param]] = [[] for _ in range(n_layer)]
    quantized_shapes = []
    experts_held = model.config.n_expert // expert  # the first rank's: every rank holds as many of the same shapes
    for name, param in model.named_parameters():
        index = routed_expert(name) if expert > 1 else None
        if index is not None and index >= experts_held or (held is not None and id(param) not in held):
            continue
        entry = Param(tuple(param.shape), param.requires_grad, id(param) in quantized, expert=index is not None)
        if entry.quantized:
            quantized_shapes.append(tuple(param.shape))
        if name.startswith("transformer.h."):
            blocks[int(name.split(".")[2])].append(entry)
        else:
            root.append(entry)
            if name.startswith("transformer.wte."):
                embedding.append(entry)
            elif name.startswith("lm_head."):
                head.append(entry)
    return Layout(root, blocks, quantized_shapes, embedding, head)

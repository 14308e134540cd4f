"""--precision fp8-mixed: the linear layers of the blocks multiply in float8 through torchao's float8 training, with
one of its scaling recipes (--train.float8_recipe): rowwise, the default (a power-of-two scale per row of each
operand, as the matmul reads it; the recipe torchtitan recommends for accuracy), or tensorwise (one scale per tensor:
cheaper casts, which is why it pays at smaller widths).

`parallelize` converts the layers first, before tensor parallelism (whose styles then wrap the float8 layers
themselves, so that their inputs arrive as DTensors), activation checkpointing, compilation and sharding: the weights
stay float32 master copies (FSDP2 shards and gathers them as any others, in bf16 under its mixed-precision policy) and
each matmul casts its operands to float8. A tensorwise amax over a split tensor is reduced over the tensor-parallel
group (DTensor), so the split model multiplies as one process does; a rowwise scale covers each rank's share of a row
where tensor parallelism splits the rows (the input of a layer split along its input, the output gradient of one split
along its output). The embeddings, the output head and the mixture-of-experts router stay in bf16 (the head decides
the logits; the router's top-k choice is discontinuous), and so does any layer whose sizes `torch._scaled_mm` cannot
take. A checkpoint holds the same keys and tensors as a bf16-mixed run's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from litgpt.distributed.runtime import print_once
from litgpt.errors import UserError
from litgpt.precision import FLOAT8_RECIPES

# torch._scaled_mm takes operands whose dimensions are multiples of 16.
FLOAT8_DIVISOR = 16
INSTALL_HINT = "pip install 'litgpt[quantize]'"


def float8_layer_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(layers fp8-mixed converts, layers of the blocks it leaves in bf16 for their sizes), by name in `model`: the
    plain linear layers of the transformer blocks, the router excepted (LoRA layers and quantized ones are not plain)."""
    converted, kept = [], []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or ".h." not in f".{name}" or name.endswith("mlp.gate"):
            continue
        fits = module.in_features % FLOAT8_DIVISOR == 0 and module.out_features % FLOAT8_DIVISOR == 0
        (converted if fits else kept).append(name)
    return converted, kept


def convert_to_float8(model: nn.Module, recipe: str = FLOAT8_RECIPES[0]) -> None:
    """Swap the layers `float8_layer_names` picks for torchao's `Float8Linear` with the scaling `recipe` (rowwise or
    tensorwise; as `Float8Linear.from_float` makes them, keeping their parameters), in place; the model may be on the
    meta device."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError:
        raise UserError(f"--precision fp8-mixed needs the torchao package: {INSTALL_HINT}.") from None
    converted, kept = float8_layer_names(model)
    if not converted:
        raise UserError("--precision fp8-mixed found no linear layer in the model's blocks whose sizes are multiples "
                        f"of {FLOAT8_DIVISOR}: use bf16-mixed.")
    config = Float8LinearConfig.from_recipe_name(recipe)
    for name in converted:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, float8_linear_class().from_float(getattr(parent, child), config=config))
    left = f"; {len(kept)} whose sizes are not multiples of {FLOAT8_DIVISOR} stay in bf16" if kept else ""
    print_once(f"fp8-mixed: {len(converted)} linear layers of the blocks multiply in float8 ({recipe} scales); the "
               f"embeddings, the head and the router in bf16{left}.")


@functools.lru_cache(maxsize=None)
def float8_linear_class() -> type:
    """torchao's `Float8Linear`, except with gradients off (validation, the text samples a run generates, GRPO's
    rollouts), where it multiplies in the weights' dtype: torchao 0.18's float8 path cannot run under
    `torch.inference_mode` (its reshape of a rowwise-scaled tensor has no inference form), and torch.compile traces
    the grad mode (a guard) but breaks its graph at every `torch.is_inference_mode_enabled()`."""
    from torchao.float8.float8_linear import Float8Linear

    class Float8TrainingLinear(Float8Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                return F.linear(input, self.weight, self.bias)
            return super().forward(input)

    return Float8TrainingLinear

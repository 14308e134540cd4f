"""The op-level policy of `--train.activation_checkpointing ops`: inside every block, keep the outputs of the
expensive operations and recompute the cheap ones in the backward pass.

Imports only torch: `litgpt plan` measures what the policy keeps with the same list of operations.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten

# The operations whose outputs the forward pass keeps: matrix products (every linear layer, LoRA's adapters, a
# soft-capped attention's own matmuls) and the fused attention kernels. Recomputing them would cost most of a
# block's forward pass again; everything else (norms, rotary embedding, activation functions, softmax, elementwise
# ops, dropout with its random state restored) costs little compute for a lot of memory, and is recomputed.
KEPT_OPS = frozenset({
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._grouped_mm.default,  # a mixture of experts' expert matmuls (litgpt::grouped_mm wraps it where needed)
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
})


def is_kept(func) -> bool:
    """Whether op-level checkpointing keeps the output of `func` (litgpt's own ops are the experts' matmuls)."""
    return func in KEPT_OPS or getattr(func, "namespace", None) == "litgpt"


def _keep_expensive_outputs(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_kept(func) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_contexts():
    """`torch.utils.checkpoint.checkpoint`'s `context_fn` for op-level checkpointing: a fresh pair of contexts (the
    forward pass caches what `KEPT_OPS` produce, the recomputation reads them back) for every call."""
    return create_selective_checkpoint_contexts(_keep_expensive_outputs)

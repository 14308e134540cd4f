"""The tensor-parallel plans of the dense families (fused q/k/v attention, the GELU, SwiGLU and GeGLU MLPs), as data:
module names -> PyTorch's parallel styles, Megatron's layout: with sequence parallelism for training, without it for
generation (`INFERENCE_BLOCK_PLAN`, `INFERENCE_MODEL_PLAN`).

Between the layers the residual stream is split over the sequence (Shard(1)): the norms run on their rank's positions
(`SequenceParallel`); attention and the MLP gather the sequence at their input (`PrepareModuleInput`), split their
first matmuls by output rows (colwise: each rank its own heads, its own MLP columns) and their output projection by
input columns (rowwise), whose partial sums are reduce-scattered back onto the sequence. The embedding is split by
vocabulary rows and its output reduce-scattered onto the sequence; the final norm's output is gathered whole, for the
head and the loss (`litgpt.train.loss` gathers the head's weight).

The fused `qkv` rows are laid out [q heads | k groups | v groups]; a plain Shard(0) would give a rank a mix of q and k
rows, so `litgpt.distributed.tensor_parallel` stores them permuted to [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...] (rank
r's heads and key-value groups side by side, `qkv_row_order`) before sharding, and checkpoints un-permute them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from litgpt.config import Config
from litgpt.distributed.plans.styles import Colwise, Rowwise

# The norms' outputs go on as local tensors: they meet the local residual stream in additions.
_NORM = SequenceParallel(use_local_output=True)
# Attention's arguments are (x, rope, mask, input_pos); only x is sharded.
_GATHER_ATTENTION_INPUT = PrepareModuleInput(
    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None),
    use_local_output=True,
)
_GATHER_MLP_INPUT = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True)
# Colwise and rowwise with LoRA factors placed too (`litgpt.distributed.plans.styles`).
_COLUMNS = Colwise()
_ROWS_TO_SEQUENCE = Rowwise(output_layouts=Shard(1))

# Each transformer block: its module names (those a family has; identity norms have nothing to split) -> styles.
BLOCK_PLAN = (
    ("norm_1", _NORM),
    ("attn", _GATHER_ATTENTION_INPUT),
    ("attn.qkv", _COLUMNS),  # rows permuted first: `qkv_row_order`
    ("attn.proj", _ROWS_TO_SEQUENCE),
    ("post_attention_norm", _NORM),
    ("norm_2", _NORM),
    ("mlp", _GATHER_MLP_INPUT),
    ("mlp.fc", _COLUMNS),
    ("mlp.fc_1", _COLUMNS),
    ("mlp.fc_2", _COLUMNS),
    ("mlp.proj", _ROWS_TO_SEQUENCE),
    ("post_mlp_norm", _NORM),
)
# A block's norms, which run on the rank's positions (and save only theirs): `litgpt plan` counts them so.
SEQUENCE_SPLIT_NORMS = tuple(name for name, style in BLOCK_PLAN if style is _NORM)

# Outside the blocks, in this order (a module may take two styles).
MODEL_PLAN = (
    ("transformer.wte", RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))),
    ("transformer.ln_f", SequenceParallel()),
    # The final hidden states whole on every rank of the group: the chunked loss reads every position.
    ("transformer.ln_f", PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                             use_local_output=True)),
    # Logits gathered whole when the model's forward applies the head (generation); training's loss applies the
    # head itself on the gathered weight.
    ("lm_head", ColwiseParallel(output_layouts=Replicate())),
)

# Generation (`litgpt generate`, `litgpt serve`) without sequence parallelism: a decoding step feeds one position,
# which cannot be split over the group. The residual stream is whole on every rank (the norms run on it, unsplit);
# attention and the MLP split their first matmuls by output rows, and their output projections' partial sums are
# all-reduced. Each rank's KV cache holds its own key-value groups.
_ROWS_TO_ALL = Rowwise(output_layouts=Replicate())
INFERENCE_BLOCK_PLAN = (
    ("attn.qkv", _COLUMNS),  # rows permuted first: `qkv_row_order`
    ("attn.proj", _ROWS_TO_ALL),
    ("mlp.fc", _COLUMNS),
    ("mlp.fc_1", _COLUMNS),
    ("mlp.fc_2", _COLUMNS),
    ("mlp.proj", _ROWS_TO_ALL),
)
INFERENCE_MODEL_PLAN = (
    ("transformer.wte", RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())),
    ("lm_head", ColwiseParallel(output_layouts=Replicate())),  # the logits gathered whole: rank 0 samples from them
)


def qkv_row_order(config: Config, degree: int) -> torch.Tensor:
    """The fused qkv rows as tensor parallelism stores them: `order[i]` is the logical row (in [q | k | v]) stored
    at row i, so that Shard(0) over `degree` ranks gives rank r its n_head/degree query heads followed by its
    n_query_groups/degree key groups and as many value groups, the groups its heads read."""
    hs, heads, groups = config.head_size, config.n_head // degree, config.n_query_groups // degree
    q_start, k_start, v_start = 0, config.n_head * hs, (config.n_head + config.n_query_groups) * hs
    pieces = []
    for rank in range(degree):
        pieces.append(torch.arange(q_start + rank * heads * hs, q_start + (rank + 1) * heads * hs))
        pieces.append(torch.arange(k_start + rank * groups * hs, k_start + (rank + 1) * groups * hs))
        pieces.append(torch.arange(v_start + rank * groups * hs, v_start + (rank + 1) * groups * hs))
    return torch.cat(pieces)

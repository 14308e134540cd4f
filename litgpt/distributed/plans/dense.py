"""The tensor-parallel plans of the blocks (fused q/k/v and latent attention, dense MLPs and mixtures of experts) and
of the model around them, as data: module names -> PyTorch's parallel styles, Megatron's layout: with sequence
parallelism for training, without it for generation (`inference_block_plan`, `INFERENCE_MODEL_PLAN`).

Between the layers the residual stream is split over the sequence (Shard(1)): the norms run on their rank's positions
(`SequenceParallel`); attention and the MLP gather the sequence at their input (`PrepareModuleInput`), split their
first matmuls by output rows (colwise: each rank its own heads, its own MLP columns) and their output projection by
input columns (rowwise), whose partial sums are reduce-scattered back onto the sequence. The embedding is split by
vocabulary rows and its output reduce-scattered onto the sequence; the final norm's output is gathered whole, for the
loss, which runs on each rank's vocabulary rows of the head (`litgpt.train.loss`: a vocabulary-parallel
cross-entropy).

Within attention, what works per head runs on the rank's heads: query/key norms over each head's dims (replicated
weights, their gradients summed over the ranks), a per-head norm weight and attention sinks split with the heads.
Latent attention (DeepSeek) splits its up-projections (q_b_proj or q_proj, kv_b_proj) by heads, each head's rows
[nope | rope] and [key | value] whole, and computes the down-projections and their norms (q_a_proj, q_a_norm,
kv_a_proj, kv_a_norm) whole on every rank; the rotary key, shared by the heads, has its gradient summed over them.
A mixture of experts routes every token on every rank with a replicated router (the auxiliary loss is one
process's), splits every routed expert along its width (`ExpertsTensorParallel`: the grouped kernels run on the
rank's share) and its shared experts as a dense MLP; its output, a partial sum, is reduce-scattered onto the sequence.

The fused `qkv` rows are laid out [q heads | k groups | v groups]; a plain Shard(0) would give a rank a mix of q and k
rows, so `litgpt.distributed.tensor_parallel` stores them permuted to [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...] (rank
r's heads and key-value groups side by side, `qkv_row_order`) before sharding, and checkpoints un-permute them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from litgpt.config import Config
from litgpt.distributed.plans.styles import (
    Colwise,
    ExpertsTensorParallel,
    LocalParameters,
    Replicated,
    Rowwise,
    ShardedInput,
    SummedGradientOf,
)

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
_ROWS_PARTIAL = Rowwise(output_layouts=Partial())  # summed with the layer's other partial sums first
_WHOLE = Replicated()

# A block's norms, which run on the rank's positions (and save only theirs): `litgpt plan` counts them so.
SEQUENCE_SPLIT_NORMS = ("norm_1", "post_attention_norm", "norm_2", "post_mlp_norm")

FUSED_ATTENTION = (
    ("attn", _GATHER_ATTENTION_INPUT),
    ("attn.qkv", _COLUMNS),  # rows permuted first: `qkv_row_order`
    ("attn.proj", _ROWS_TO_SEQUENCE),
)
# Query/key norms, by their kind (`query_key_norms`): q and k are (B, heads, T, head_size), or (B, T, heads *
# head_size) for OLMo 2's norms over the whole projection; the rank holds its heads.
HEAD_NORMS = {
    "per head": SequenceParallel(sequence_dim=1, use_local_output=True),  # one weight every head shares
    "a weight per head": LocalParameters({"weight": Shard(0)}),  # StableLM 2: split with the heads
    "over all heads": ShardedInput(dim=2, placements={"weight": Shard(0), "bias": Shard(0)}),  # OLMo 2
}
ATTENTION_SINKS = (("attn", LocalParameters({"sinks": Shard(0)})),)  # one per head: split with the heads
LATENT_ATTENTION = (
    ("attn", _GATHER_ATTENTION_INPUT),
    ("attn", SummedGradientOf("expand", argument=1)),  # the rotary key every head reads
    ("attn.q_proj", _COLUMNS),  # without q_lora_rank
    ("attn.q_a_proj", _WHOLE),
    ("attn.q_a_norm", _WHOLE),
    ("attn.q_b_proj", _COLUMNS),
    ("attn.kv_a_proj", _WHOLE),
    ("attn.kv_a_norm", _WHOLE),
    ("attn.kv_b_proj", _COLUMNS),
    ("attn.proj", _ROWS_TO_SEQUENCE),
)
DENSE_MLP = (
    ("mlp", _GATHER_MLP_INPUT),
    ("mlp.fc", _COLUMNS),
    ("mlp.fc_1", _COLUMNS),
    ("mlp.fc_2", _COLUMNS),
    ("mlp.proj", _ROWS_TO_SEQUENCE),
)
MIXTURE_OF_EXPERTS = (
    ("mlp", _GATHER_MLP_INPUT),
    ("mlp", ExpertsTensorParallel(colwise=("fc_1", "fc_2"), rowwise=("proj",))),
    ("mlp", PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Shard(1), use_local_output=True)),
    ("mlp.gate", _WHOLE),
    ("mlp.shared_experts.fc_1", _COLUMNS),
    ("mlp.shared_experts.fc_2", _COLUMNS),
    ("mlp.shared_experts.proj", _ROWS_PARTIAL),
)


def block_plan(config: Config, moe: bool) -> tuple:
    """The plan of a block of `config` (`moe`: its MLP is a mixture of experts), in the order it is applied (a module
    may take several styles; names the block lacks, such as identity norms, are skipped)."""
    attention = LATENT_ATTENTION if config.kv_lora_rank is not None else FUSED_ATTENTION + per_head_parts(config)
    mlp = MIXTURE_OF_EXPERTS if moe else DENSE_MLP
    return (("norm_1", _NORM), *attention, ("post_attention_norm", _NORM), ("norm_2", _NORM), *mlp,
            ("post_mlp_norm", _NORM))


def per_head_parts(config: Config) -> tuple:
    """The plan of fused q/k/v attention's per-head parts, the same with and without sequence parallelism: its
    query/key norms and its sinks."""
    parts = ()
    if config.norm_qk:
        parts += tuple((f"attn.{name}", HEAD_NORMS[query_key_norms(config)]) for name in ("norm_q", "norm_k"))
    if config.attention_sinks:
        parts += ATTENTION_SINKS
    return parts


def query_key_norms(config: Config) -> str:
    """The kind of `config`'s query/key norms, a key of `HEAD_NORMS`."""
    if config.norm_qk_type == "olmo2":
        return "over all heads"
    return "a weight per head" if config.norm_qk_per_head else "per head"


# Outside the blocks, in this order (a module may take two styles).
MODEL_PLAN = (
    ("transformer.wte", RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))),
    ("transformer.ln_f", SequenceParallel()),
    # The final hidden states whole on every rank of the group: the chunked loss reads every position.
    ("transformer.ln_f", PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                             use_local_output=True)),
    # Logits gathered whole when the model's forward applies the head (generation); training's loss applies each
    # rank's vocabulary rows of the head itself (a LoRA head's B split with them).
    ("lm_head", Colwise(output_layouts=Replicate())),
)

# Generation (`litgpt generate`, `litgpt serve`) without sequence parallelism: a decoding step feeds one position,
# which cannot be split over the group. The residual stream is whole on every rank (the norms run on it, unsplit);
# attention and the MLP split their first matmuls by output rows, and their output projections' partial sums are
# all-reduced. Each rank's KV cache holds its own key-value groups.
_ROWS_TO_ALL = Rowwise(output_layouts=Replicate())
INFERENCE_FUSED_ATTENTION = (
    ("attn.qkv", _COLUMNS),  # rows permuted first: `qkv_row_order`
    ("attn.proj", _ROWS_TO_ALL),
)
# The down-projections and their norms stay plain, whole on every rank, and so does each rank's latent KV cache (the
# latent is every head's); a decoding step folds kv_b_proj's key rows of the rank's heads into their queries.
INFERENCE_LATENT_ATTENTION = (
    ("attn.q_proj", _COLUMNS),
    ("attn.q_b_proj", _COLUMNS),
    ("attn.kv_b_proj", _COLUMNS),
    ("attn", LocalParameters({"kv_b_proj.weight": None}, method="attend_latent")),
    ("attn.proj", _ROWS_TO_ALL),
)
INFERENCE_DENSE_MLP = (
    ("mlp.fc", _COLUMNS),
    ("mlp.fc_1", _COLUMNS),
    ("mlp.fc_2", _COLUMNS),
    ("mlp.proj", _ROWS_TO_ALL),
)
# The router (plain, whole) routes every token on every rank; the routed experts' and the shared experts' partial
# sums are added, then all-reduced.
INFERENCE_MIXTURE_OF_EXPERTS = (
    ("mlp", ExpertsTensorParallel(colwise=("fc_1", "fc_2"), rowwise=("proj",))),
    ("mlp", PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate(), use_local_output=True)),
    ("mlp.shared_experts.fc_1", _COLUMNS),
    ("mlp.shared_experts.fc_2", _COLUMNS),
    ("mlp.shared_experts.proj", _ROWS_PARTIAL),
)


def inference_block_plan(config: Config, moe: bool) -> tuple:
    """Generation's plan of a block of `config` (`moe`: its MLP is a mixture of experts): `block_plan`'s splits of
    the heads, the MLP widths and every expert's width, without sequence parallelism (the norms run whole)."""
    if config.kv_lora_rank is not None:
        attention = INFERENCE_LATENT_ATTENTION
    else:
        attention = INFERENCE_FUSED_ATTENTION + per_head_parts(config)
    return (*attention, *(INFERENCE_MIXTURE_OF_EXPERTS if moe else INFERENCE_DENSE_MLP))


INFERENCE_MODEL_PLAN = (
    ("transformer.wte", RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())),
    ("lm_head", Colwise(output_layouts=Replicate())),  # the logits gathered whole: rank 0 samples from them
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

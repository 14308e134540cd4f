"""The expert-parallel plan of the mixture-of-experts families (Mixtral, Qwen3-MoE, DeepSeek-V2/V3, Kimi K2,
GLM-4.5, gpt-oss: all `litgpt.moe.LLaMAMoE`), as data: which module of a block holds the experts that expert
parallelism splits, whole experts per rank, and which stay dense, with data parallelism (FSDP-sharded with the
block, or replicated)."""

from __future__ import annotations

# The MoE layer of a block (a block whose MLP is dense has none: DeepSeek's first dense layers).
MOE_LAYER = "mlp"
# Its list of routed experts, split over the expert group (`litgpt.distributed.expert_parallel.LocalExperts`).
SPLIT = "experts"
# What every rank keeps whole: the router (each rank routes its own tokens over all experts, so the auxiliary
# load-balancing loss is one process's) and DeepSeek's shared experts (every token goes through them).
DENSE = ("gate", "shared_experts")

"""`litgpt plan` beside the peak memory other toolkits published for the same runs.

Each row is a run whose peak GPU memory torchtune, LitGPT or Answer.AI measured and published, with the source (file
and commit of the peer's own repository). The planner is run with the same model, method, precision, batch, sequence
length, LoRA targets, quantization, activation checkpointing, devices and offload. A peer figure is one of two kinds,
and ours is compared like for like:

- "allocated" (torchtune's "Peak Memory Active", LitGPT's `torch.cuda.max_memory_allocated`): the planner's peak;
- "reserved" (Answer.AI's peak reserved memory): the planner's total, the peak plus its allowance for the CUDA
  context and the allocator's cache.

What the peers used is planned as they ran it: the optimizer step fused into the backward pass and activation
offloading (`--train.optimizer_in_backward`, `--train.offload_activations`); litgpt shards the token embedding and
the output head as FSDP units of their own, as torchtune's `custom_sharded_layers` does. The table's next row (8-bit
AdamW, 17.6 GiB) is left out: the planner counts AdamW's float32 moments only. Nothing is allocated: this runs
anywhere in seconds.

    python benchmarks/memory_peers.py            # the table
    python benchmarks/memory_peers.py --json out.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

GiB = 2**30

TORCHTUNE = "pytorch/torchtune README.md @ bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1"
LITGPT = "Lightning-AI/litgpt tutorials/resource-tables.md @ 26857050fe3ff627cd714fe92f5838f51a3d5efa (A100 40GB)"
# The Llama 3.1 70B / 405B rows of the same README table have not changed since it was written (30b8519e8, 2024-09-24);
# the recipe configs they name changed later (other LoRA targets, no fused AdamW), so those rows take their settings
# from recipes/configs/llama3_1/{70B_lora,70B_full,405B_qlora}.yaml as of that commit.
TORCHTUNE_LLAMA31 = ("pytorch/torchtune README.md @ bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1; settings: "
                     "recipes/configs/llama3_1/ @ 30b8519e86d2094879576e16ab1f8d21a6f6f9f7")
ANSWERAI = "AnswerDotAI/fsdp_qlora benchmarks_03_2024.md @ 05ed9f2a60f96a0795cb082bceab70a9b19fd213"


@dataclass(frozen=True)
class PeerRun:
    peer: str
    source: str
    run: str  # the peer's description of the run, as published
    peer_gib: float
    measure: str  # "allocated" or "reserved"
    model: str
    plan: dict = field(default_factory=dict)  # litgpt.plan.plan_for keyword arguments, --train/--fsdp as dicts
    lora: dict | None = None  # LoRASettings fields


def _gb(decimal_gb: float) -> float:
    """A figure published in decimal 'GB' (LitGPT's table prints max_memory_allocated / 1e9 so), in GiB."""
    return decimal_gb * 1e9 / GiB


def flags(**values) -> dict:
    """Keyword arguments, written as such."""
    return values


QV = flags(query=True, value=True)
ALL_LINEAR = flags(query=True, key=True, value=True, projection=True, mlp=True)
TORCHTUNE_LORA = flags(query=True, value=True, projection=True, mlp=True)
QKV = flags(query=True, key=True, value=True)
# torchtune's QLoRA stores the base as torchao's NF4Tensor, whose scalers are quantized too: bitsandbytes' nf4 with
# double quantization is the same format (about 4.13 bits a weight; under FSDP litgpt stores either as `ao.nf4`).
TORCHTUNE_QLORA = "bnb.nf4-dq"

RUNS = (
    PeerRun("torchtune", TORCHTUNE, "Llama 3.2 3B full, bf16, batch 2 x 4096 packed, compile, chunked CE", 42.9,
            "allocated", "Llama-3.2-3B",
            flags(method="full", train=flags(micro_batch_size=2, max_seq_length=4096), precision="bf16-true",
                  accumulate_gradients=False)),
    PeerRun("torchtune", TORCHTUNE, "... + activation checkpointing", 24.9, "allocated", "Llama-3.2-3B",
            flags(method="full", train=flags(micro_batch_size=2, max_seq_length=4096, activation_checkpointing=True),
                  precision="bf16-true", accumulate_gradients=False)),
    PeerRun("torchtune", TORCHTUNE, "... + optimizer step fused into the backward pass", 23.1, "allocated",
            "Llama-3.2-3B",
            flags(method="full", train=flags(micro_batch_size=2, max_seq_length=4096, activation_checkpointing=True,
                                             optimizer_in_backward=True, max_norm=None),
                  precision="bf16-true", accumulate_gradients=False)),
    PeerRun("torchtune", TORCHTUNE, "... + activation offloading", 21.8, "allocated", "Llama-3.2-3B",
            flags(method="full", train=flags(micro_batch_size=2, max_seq_length=4096, activation_checkpointing=True,
                                             optimizer_in_backward=True, max_norm=None, offload_activations=True),
                  precision="bf16-true", accumulate_gradients=False)),
    PeerRun("torchtune", TORCHTUNE, "Llama 3.2 3B LoRA r64 (q, v, out, MLP), same run, activation offloading", 8.5,
            "allocated", "Llama-3.2-3B",
            flags(method="lora", train=flags(micro_batch_size=2, max_seq_length=4096, activation_checkpointing=True,
                                             offload_activations=True),
                  precision="bf16-true", accumulate_gradients=False),
            lora=flags(r=64, alpha=128, dropout=0.0, **TORCHTUNE_LORA)),
    PeerRun("torchtune", TORCHTUNE, "Llama 3.2 3B QLoRA r64, same run, activation offloading", 4.6, "allocated",
            "Llama-3.2-3B",
            flags(method="lora", train=flags(micro_batch_size=2, max_seq_length=4096, activation_checkpointing=True,
                                             offload_activations=True),
                  precision="bf16-true", quantize=TORCHTUNE_QLORA, accumulate_gradients=False),
            lora=flags(r=64, alpha=128, dropout=0.0, **TORCHTUNE_LORA)),
    PeerRun("torchtune", TORCHTUNE, "Llama 3.1 8B LoRA r8 (q, v, out, MLP), 1x 4090, batch 2 x 2048 packed", 16.2,
            "allocated", "Llama-3.1-8B",
            flags(method="lora", train=flags(micro_batch_size=2, max_seq_length=2048, activation_checkpointing=True),
                  precision="bf16-true", accumulate_gradients=False),
            lora=flags(r=8, alpha=16, dropout=0.0, **TORCHTUNE_LORA)),
    PeerRun("torchtune", TORCHTUNE, "Llama 3.1 8B QLoRA r8, 1x 4090, batch 2 x 2048 packed", 7.4, "allocated",
            "Llama-3.1-8B",
            flags(method="lora", train=flags(micro_batch_size=2, max_seq_length=2048, activation_checkpointing=True),
                  precision="bf16-true", quantize=TORCHTUNE_QLORA, accumulate_gradients=False),
            lora=flags(r=8, alpha=16, dropout=0.0, **TORCHTUNE_LORA)),
    # The README's table: batch 2, no gradient accumulation, packed to 2048, compiled, for every row (its note),
    # whatever batch the config sets; 8 A100s sharded by FSDP over all of them.
    PeerRun("torchtune", TORCHTUNE_LLAMA31, "Llama 3.1 70B LoRA r16 (q, k, v), 8x A100, batch 2 x 2048 packed", 27.6,
            "allocated", "Llama-3.1-70B-Instruct",
            flags(method="lora", train=flags(micro_batch_size=2, max_seq_length=2048, activation_checkpointing=True),
                  fsdp=flags(sharding_strategy="FULL_SHARD"), precision="bf16-true", devices=8,
                  accumulate_gradients=False),
            lora=flags(r=16, alpha=32, dropout=0.0, **QKV)),
    # "CPU offload with fused optimizer" (the README's footnote): fsdp_cpu_offload and AdamW(fused=True), the pairing
    # the config's comment recommends; the distributed recipe had no optimizer_in_bwd then. The step runs on the CPU.
    PeerRun("torchtune", TORCHTUNE_LLAMA31, "Llama 3.1 70B full, 8x A100, CPU offload, fused AdamW, batch 2 x 2048",
            13.9, "allocated", "Llama-3.1-70B-Instruct",
            flags(method="full", train=flags(micro_batch_size=2, max_seq_length=2048, activation_checkpointing=True),
                  fsdp=flags(sharding_strategy="FULL_SHARD", cpu_offload=True), precision="bf16-true", devices=8,
                  accumulate_gradients=False)),
    # Published as "44.8 GB" (the other rows say GiB): taken as decimal GB, as printed. The config's loss was then
    # torch.nn.CrossEntropyLoss on whole float32 logits: one chunk of all 4,096 positions. At 2 x 2048 the 1/8 NF4
    # shard (25.2 GiB) and the 126 checkpointed block inputs (15.8 GiB) alone reach the figure: the config's own
    # batch (1, unpacked Alpaca, 16 accumulation steps) is likelier to be what was measured, at a length not given.
    PeerRun("torchtune", TORCHTUNE_LLAMA31,
            'Llama 3.1 405B QLoRA r16 (q, k, v, out, MLP), 8x A100, 2 x 2048, "44.8 GB"',
            _gb(44.8), "allocated", "Llama-3.1-405B-Instruct",
            flags(method="lora", train=flags(micro_batch_size=2, max_seq_length=2048, activation_checkpointing=True,
                                             loss_chunk_size=4096),
                  fsdp=flags(sharding_strategy="FULL_SHARD"), precision="bf16-true", quantize=TORCHTUNE_QLORA,
                  devices=8, accumulate_gradients=False),
            lora=flags(r=16, alpha=32, dropout=0.0, projection=True, mlp=True, **QKV)),
    PeerRun("LitGPT", LITGPT, "Llama 2 7B LoRA r8 (q, v), micro batch 1, Alpaca (longest 1,304 tokens)",
            _gb(21.30), "allocated", "Llama-2-7b-hf",
            flags(method="lora", train=flags(micro_batch_size=1, max_seq_length=1304), precision="bf16-true"),
            lora=flags(r=8, **QV)),
    PeerRun("LitGPT", LITGPT, "... with bnb.nf4", _gb(14.14), "allocated", "Llama-2-7b-hf",
            flags(method="lora", train=flags(micro_batch_size=1, max_seq_length=1304), precision="bf16-true",
                  quantize="bnb.nf4"),
            lora=flags(r=8, **QV)),
    PeerRun("LitGPT", LITGPT, "Llama 2 13B LoRA r8 (q, v), micro batch 1", _gb(38.12), "allocated", "Llama-2-13b-hf",
            flags(method="lora", train=flags(micro_batch_size=1, max_seq_length=1304), precision="bf16-true"),
            lora=flags(r=8, **QV)),
    PeerRun("LitGPT", LITGPT, "... with bnb.nf4", _gb(23.14), "allocated", "Llama-2-13b-hf",
            flags(method="lora", train=flags(micro_batch_size=1, max_seq_length=1304), precision="bf16-true",
                  quantize="bnb.nf4"),
            lora=flags(r=8, **QV)),
    PeerRun("Answer.AI", ANSWERAI, "Llama-2 7B QLoRA r64 (all linear), FSDP on 2 GPUs, batch 10 x 2048", 20.97,
            "reserved", "Llama-2-7b-hf",
            flags(method="lora", train=flags(micro_batch_size=10, max_seq_length=2048, activation_checkpointing=True),
                  fsdp=flags(sharding_strategy="FULL_SHARD"), precision="bf16-true", quantize="bnb.nf4", devices=2),
            lora=flags(r=64, alpha=16, dropout=0.1, **ALL_LINEAR)),
    PeerRun("Answer.AI", ANSWERAI, "Llama-2 7B LoRA r64 (all linear), FSDP on 2 GPUs, batch 6 x 2048", 21.35,
            "reserved", "Llama-2-7b-hf",
            flags(method="lora", train=flags(micro_batch_size=6, max_seq_length=2048, activation_checkpointing=True),
                  fsdp=flags(sharding_strategy="FULL_SHARD"), precision="bf16-true", devices=2),
            lora=flags(r=64, alpha=16, dropout=0.1, **ALL_LINEAR)),
    PeerRun("Answer.AI", ANSWERAI, "Llama-2 70B QLoRA r64 (all linear), 2 GPUs, CPU offload, batch 2 x 2048", 14.92,
            "reserved", "Llama-2-70b-hf",
            flags(method="lora", train=flags(micro_batch_size=2, max_seq_length=2048, activation_checkpointing=True),
                  fsdp=flags(sharding_strategy="FULL_SHARD", cpu_offload=True), precision="bf16-true",
                  quantize="bnb.nf4", devices=2),
            lora=flags(r=64, alpha=16, dropout=0.1, **ALL_LINEAR)),
)


def plan_row(run: PeerRun) -> dict:
    from litgpt.args import FSDPArgs, TrainArgs
    from litgpt.config import Config
    from litgpt.errors import UserError
    from litgpt.lora import LoRASettings
    from litgpt.plan import plan_for

    row = {"peer": run.peer, "source": run.source, "run": run.run, "measure": run.measure, "model": run.model,
           "peer_gib": round(run.peer_gib, 2), "plan_arguments": run.plan, "lora": run.lora}
    lora = LoRASettings(**run.lora) if run.lora else None
    try:
        train, fsdp = TrainArgs(**run.plan["train"]), FSDPArgs(**run.plan.get("fsdp", {}))
        arguments = {key: value for key, value in run.plan.items() if key not in ("train", "fsdp")}
        plan = plan_for(Config.from_name(run.model), lora=lora, device="cuda", train=train, fsdp=fsdp, **arguments)
    except UserError as error:  # a run litgpt cannot do: shown as such
        return {**row, "ours_gib": None, "ratio": None, "at_or_below": False, "refused": str(error)}
    ours = (plan.peak if run.measure == "allocated" else plan.total) / GiB
    return {**row, "ours_gib": round(ours, 2), "ratio": round(ours / run.peer_gib, 3), "at_or_below": ours <= run.peer_gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = [plan_row(run) for run in RUNS]
    print(f"{'peer':<10} {'run':<78} {'measure':<9} {'peer GiB':>8} {'ours GiB':>8} {'ours/peer':>9}")
    for row in rows:
        head = f"{row['peer']:<10} {row['run'][:78]:<78} {row['measure']:<9} {row['peer_gib']:>8.2f} "
        if row["ours_gib"] is None:
            print(f"{head}  refused: {row['refused']}")
            continue
        flag = "" if row["at_or_below"] else "  ABOVE"
        print(f"{head}{row['ours_gib']:>8.2f} {row['ratio']:>8.2f}x{flag}")
    print("\nSources:")
    for source in dict.fromkeys(row["source"] for row in rows):
        print(f"  {source}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=2)


if __name__ == "__main__":
    main()

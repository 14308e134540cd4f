#!/usr/bin/env bash
# The GPU path in one run on one H100/H200 (at most --budget, 480 s by default: each stage's time limit is cut to the
# time left, and the plan stage comes last): MFU in bf16-mixed and fp8-mixed (rowwise and tensorwise), grouped MoE
# against the loop, chunked loss memory, QLoRA under FSDP2 with NCCL, generation with CUDA graphs, the planner
# against measured peaks. Stages and options: benchmarks/gpu_check.py. Results: benchmarks/results/gpu-check-<date>/.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_check.py "$@"

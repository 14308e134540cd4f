#!/usr/bin/env bash
# The GPU path in one run on one H100/H200 (every stage: ~11 minutes on an H200; --budget, 480 s by default, stops
# starting stages after that): MFU in bf16-mixed and fp8-mixed, grouped MoE
# against the loop, chunked loss memory, QLoRA under FSDP2 with NCCL, generation with CUDA graphs, the planner
# against measured peaks. Stages and options: benchmarks/gpu_check.py. Results: benchmarks/results/gpu-check-<date>/.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_check.py "$@"

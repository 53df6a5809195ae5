#!/usr/bin/env bash
# Issue 3 GPU run (2 GPUs, ~9.5 min): Qwen3-1.7B-shaped SFT, all modes at 64K (one GPU as the scaling
# baseline), CSBP and CP at 128K with one timed step. Per-stage time limits; records written point by point.
source benchmarks/gpu_env.sh
stage() { local limit=$1; shift; echo "== $(date -u +%T) [limit ${limit}s] $*"; timeout -k 15 "$limit" "$@" 2>&1 | grep -v -i warn; }
B=benchmarks/bdlm_bench.py
R="$OUT/bdlm_sft.jsonl"
stage 320 torchrun --standalone --nproc-per-node 2 $B --contexts 65536 --modes csbp cp bp dp reference --out "$R"
stage 220 torchrun --standalone --nproc-per-node 2 $B --contexts 131072 --modes csbp cp --steps 1 --out "$R"
echo "== $(date -u +%T) done"

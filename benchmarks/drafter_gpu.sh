#!/usr/bin/env bash
# Issue 4 GPU run (2 GPUs, ~9.5 min): shape (a) CSBP vs CP vs DP at the target points, 1M with re-gather,
# then ours vs SpecForge 0.2.0 on one GPU (needs the specforge wheel in .whl/). Every stage has its own
# time limit so one slow stage cannot take the others' time; records are written point by point.
source benchmarks/gpu_env.sh
stage() { local limit=$1; shift; echo "== $(date -u +%T) [limit ${limit}s] $*"; timeout -k 15 "$limit" "$@" 2>&1 | grep -v -i warn; }
B=benchmarks/drafter_bench.py
R="$OUT/drafter.jsonl"
stage 170 torchrun --nproc-per-node 2 $B --shape a --modes csbp,cp,dp --contexts 128K --anchors 512,2048 --out "$R"
stage 130 torchrun --nproc-per-node 2 $B --shape a --modes csbp,cp,dp --contexts 512K --anchors 512 --out "$R"
stage 100 torchrun --nproc-per-node 2 $B --shape a --modes csbp,cp --contexts 1M --anchors 512 --regather --out "$R"
stage 130 env CUDA_VISIBLE_DEVICES=0 python3 $B --shape a --no-dflash2 --modes csbp,specforge --contexts 64K,128K,256K \
  --anchors 512 --no-components --out "$R"
echo "== $(date -u +%T) done"

#!/usr/bin/env bash
# Issue 4 GPU runs (2 GPUs), in two parts of < 10 min each: bash benchmarks/drafter_gpu.sh 1|2
# Every stage has its own time limit so one slow stage cannot take the others' time; records are written
# point by point. Part 1 starts with a check of the GPU path (flex, packing, masks) against the dense seam.
# Session 2 (2026-11-29) ran the earlier form of part 1 + the 1-GPU stage: benchmarks/logs/drafter_h200x2_2026-11-29.log.
source benchmarks/gpu_env.sh
stage() { local limit=$1; shift; echo "== $(date -u +%T) [limit ${limit}s] $*"; timeout -k 15 "$limit" "$@" 2>&1 | grep -v -i warn; }
B=benchmarks/drafter_bench.py
R="$OUT/drafter.jsonl"
case "${1:-1}" in
1)
  stage 210 torchrun --nproc-per-node 2 $B --shape a --modes csbp,cp --contexts 128K --anchors 512 --check-context 8192 --out "$R"
  stage 150 torchrun --nproc-per-node 2 $B --shape a --modes csbp,cp --contexts 128K --anchors 2048 --out "$R"
  stage 140 torchrun --nproc-per-node 2 $B --shape a --modes csbp,cp --contexts 512K --anchors 512 --out "$R"
  ;;
2)
  stage 110 torchrun --nproc-per-node 2 $B --shape a --modes csbp,cp --contexts 1M --anchors 512 --regather --out "$R"
  stage 120 torchrun --nproc-per-node 2 $B --shape a --modes csbp --contexts 128K --anchors 512 --schedule overlap --profile --out "$R"
  stage 140 env CUDA_VISIBLE_DEVICES=0 python3 $B --shape a --no-dflash2 --modes csbp,specforge --contexts 64K,128K,256K \
    --anchors 512 --no-components --out "$R"
  ;;
esac
echo "== $(date -u +%T) done"

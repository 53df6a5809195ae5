#!/usr/bin/env bash
# Issue 2 GPU re-run (2 GPUs, < 10 min): the attention layer with every mode from a fresh compile state
# (bench/isolation.py). Sessions 1-3 ran their modes one after another in one process, so later modes
# inherited the first one's compiled kernels (docs/performance.md, "Read first"); CP and torch-cp go first here.
source benchmarks/gpu_env.sh
stage() { local limit=$1; shift; echo "== $(date -u +%T) [limit ${limit}s] $*"; timeout -k 15 "$limit" "$@" 2>&1 | grep -v -i warn; }
B=benchmarks/attention_bench.py
R="$OUT/attention.jsonl"
stage 270 torchrun --nproc-per-node 2 $B --contexts 65536,131072 --modes cp,torch-cp,csbp --schedule fused \
  --iters 4 --warmup 2 --check-context 2048 --out "$R"
stage 270 torchrun --nproc-per-node 2 $B --contexts 262144 --modes cp,torch-cp,csbp --schedule fused \
  --iters 4 --warmup 2 --out "$R"
echo "== $(date -u +%T) done"

#!/usr/bin/env bash
# Issue 3 GPU run (2 GPUs, < 10 min): Qwen3-1.7B-shaped SFT. 64K: the 1-GPU reference (scaling baseline)
# and CSBP/CP with the default (fused) schedule; 128K: CP and CSBP with one timed step.
# Session 2 (2026-11-29) ran `--modes csbp cp bp dp reference` at 64K and `csbp cp` at 128K (overlap schedule,
# the default then); the reference and CP 128K points were cut by these stage limits.
source benchmarks/gpu_env.sh
stage() { local limit=$1; shift; echo "== $(date -u +%T) [limit ${limit}s] $*"; timeout -k 15 "$limit" "$@" 2>&1 | grep -v -i warn; }
B=benchmarks/bdlm_bench.py
R="$OUT/bdlm_sft.jsonl"
stage 300 torchrun --standalone --nproc-per-node 2 $B --contexts 65536 --modes reference csbp cp --out "$R"
stage 250 torchrun --standalone --nproc-per-node 2 $B --contexts 131072 --modes cp csbp --steps 1 --out "$R"
echo "== $(date -u +%T) done"

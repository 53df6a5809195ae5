#!/usr/bin/env bash
# Issue 23 GPU run (ONE H200, ~10 min in all): full-BDLM SFT of a Gemma-3-1B-shaped model (sliding + full
# layers, window 512) and a Qwen3-MoE-shaped model (2.9B parameters, 16 experts, top 2, router aux loss on),
# random weights, bf16 autocast, activation checkpointing, at 32K and 64K clean tokens (2L = 64K / 128K
# rows). Records (tokens_per_s, mfu, peak_mem_gib, breakdown) go to $OUT/bdlm_families.jsonl.
#   bash benchmarks/bdlm_families_gpu.sh          # all three stages
#   bash benchmarks/bdlm_families_gpu.sh gemma    # one stage: gemma | moe32 | moe64
source benchmarks/gpu_env.sh
python3 -c 'import transformers; print("transformers", transformers.__version__)'
stage() { local limit=$1; shift; echo "== $(date -u +%T) [limit ${limit}s] $*"; timeout -k 15 "$limit" "$@" 2>&1 | grep -v -i warn; }
B=benchmarks/bdlm_bench.py
R="$OUT/bdlm_families.jsonl"
C=benchmarks/configs
# MoE experts: transformers' default kernel; if it fails on this GPU / version, rerun with
# EXPERTS="--experts-implementation eager" (a loop over experts, same math).
EXPERTS=${EXPERTS:-}
run() { case "$1" in
  gemma) stage 290 torchrun --standalone --nproc-per-node 1 $B --model-config $C/gemma3-1b-shape.json \
           --modes reference --contexts 32768 65536 --steps 2 --out "$R" ;;
  moe32) stage 290 torchrun --standalone --nproc-per-node 1 $B --model-config $C/qwen3-moe-3b-a0.7b-shape.json \
           --modes reference --contexts 32768 --steps 2 $EXPERTS --out "$R" ;;
  moe64) stage 290 torchrun --standalone --nproc-per-node 1 $B --model-config $C/qwen3-moe-3b-a0.7b-shape.json \
           --modes reference --contexts 65536 --steps 2 $EXPERTS --out "$R" ;;
esac; }
if [ $# -eq 0 ]; then set -- gemma moe32 moe64; fi
for s in "$@"; do run "$s"; done
echo "== $(date -u +%T) done"

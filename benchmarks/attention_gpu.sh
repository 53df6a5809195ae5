#!/usr/bin/env bash
# Issue 2 GPU run: the attention benchmark on all GPUs of the machine.
# Usage: bash benchmarks/attention_gpu.sh [contexts]   (extra flags through ATTN_ARGS)
source benchmarks/gpu_env.sh
torchrun --nproc-per-node "$NGPU" benchmarks/attention_bench.py --contexts "${1:-32768,65536,131072,262144}" \
  --out "$OUT/attention.jsonl" ${ATTN_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/attention.log"

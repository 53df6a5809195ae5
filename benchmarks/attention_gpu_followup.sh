#!/usr/bin/env bash
# Second issue-2 GPU run (after chunked block masks): torch-cp beside csbp at 64K/128K, then all modes at 256K.
source benchmarks/gpu_env.sh
torchrun --nproc-per-node "$NGPU" benchmarks/attention_bench.py --contexts 65536,131072 --modes torch-cp,csbp \
  --iters 2 --warmup 1 --check-context 2048 --out "$OUT/attention.jsonl" 2>&1 | grep -v Warning | tee "$OUT/attention_a.log"
torchrun --nproc-per-node "$NGPU" benchmarks/attention_bench.py --contexts 262144 --modes csbp,cp,bp,reference \
  --iters 2 --warmup 1 --check-context 0 --out "$OUT/attention.jsonl" 2>&1 | grep -v Warning | tee "$OUT/attention_b.log"

#!/usr/bin/env bash
# Next GPU run for issue 2: our two schedules side by side with PyTorch's context parallel, and one profiled
# step per point. Each launch records `schedule`; the report pairs records within a launch.
source benchmarks/gpu_env.sh
for schedule in fused overlap; do
  torchrun --nproc-per-node "$NGPU" benchmarks/attention_bench.py --contexts "${1:-65536,262144}" \
    --modes csbp,cp,torch-cp --schedule $schedule --iters 4 --warmup 2 --check-context 2048 --profile \
    --out "$OUT/attention.jsonl" 2>&1 | grep -v Warning | tee "$OUT/attention_$schedule.log"
done

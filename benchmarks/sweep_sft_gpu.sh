#!/usr/bin/env bash
# Issue 6 GPU run (2 GPUs, < 10 min): the Qwen3-1.7B-shaped SFT sweep, one fresh process per point (OOM and
# failures recorded, never ending the sweep), one timed step and no control step per point so 128K fits.
# Usage: bash benchmarks/sweep_sft_gpu.sh [contexts] [sweep seconds]. Records + point logs come back in $OUT.
source benchmarks/gpu_env.sh
timeout -k 15 "${2:-540}" python3 -m specforge_csbp sweep --workload sft --contexts "${1:-32K,64K,128K}" \
  --modes csbp,cp --world-sizes 2 --block-sizes 32 --args "--steps 1 --breakdown-modes" --timeout 240 \
  --out-dir /tmp/sweep-sft --no-progress > /tmp/sweep-sft.log 2>&1
echo "sweep exit $?"; grep -v -i warn /tmp/sweep-sft.log | tail -20
cp -v /tmp/sweep-sft/records.jsonl "$OUT/sweep_sft.jsonl"
tar czf "$OUT/sweep_sft_logs.tgz" -C /tmp/sweep-sft logs && ls -la "$OUT"

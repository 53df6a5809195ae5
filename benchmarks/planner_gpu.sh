#!/usr/bin/env bash
# Issue 6 GPU run (2 GPUs): calibrate the planner's machine profile, then a sweep of the DFlash2
# Qwen3-8B-shaped drafter (one fresh process per point, OOM recorded). Usage: bash benchmarks/planner_gpu.sh
# [contexts] [modes] [sweep seconds]. Only records, the profile and a log come back ($OUT holds <= 8 files).
source benchmarks/gpu_env.sh
timeout -k 15 240 torchrun --nproc-per-node 2 -m specforge_csbp plan --calibrate --profile-out "$OUT/h200x2.json" \
  --model drafter_configs/qwen3-8b-dflash2.json --context 1M --gpus 8 --gpu-mem 141 --workload drafter 2>&1 | grep -v -i warn
# No pipe after the sweep: a point's process tree runs in its own session and would hold a pipe open.
# Copy what was recorded even when the time limit stops the sweep (records are appended point by point).
timeout -k 15 "${3:-300}" python3 -m specforge_csbp sweep --workload drafter --contexts "${1:-64K,256K,1M}" \
  --modes "${2:-csbp,cp}" --world-sizes 2 --block-sizes 16 --args "--shape b --dflash2 --anchors 512" \
  --timeout 150 --out-dir /tmp/sweep --no-progress > /tmp/sweep.log 2>&1
echo "sweep exit $?"; grep -v -i warn /tmp/sweep.log | tail -20
cp -v /tmp/sweep/records.jsonl "$OUT/sweep_drafter.jsonl"
tar czf "$OUT/sweep_logs.tgz" -C /tmp/sweep logs && ls -la "$OUT"
echo "== $(date -u +%T) done"

#!/usr/bin/env bash
# The long-context study on one GPU (H200 or H100) (docs/long_context.md), in parts that each fit a 10-minute call.
# After `source benchmarks/gpu_env.sh` (carried wheels: specforge 0.2.0 + pydantic for the train stage):
#   bash benchmarks/longctx_gpu.sh 1     # target: trains up to --target-minutes (9), resumable; repeat until done
#   bash benchmarks/longctx_gpu.sh 2     # capture the stores the chosen drafters need (~7 GiB each, under RUN)
#                                        # + train and export the chosen drafters
#   bash benchmarks/longctx_gpu.sh 3     # eval the chosen drafters on both held-out sets (one process) + records,
#                                        # plot and tables of every drafter evaluated so far
#   bash benchmarks/longctx_gpu.sh probe # the plateau probe (scripts/long_context_probe.py) of PROBE_DRAFTERS
#                                        # (default short,long; their exports and both stores) -> RUN/probe.json
#   bash benchmarks/longctx_gpu.sh all   # 1, 2, 3 in order (each skips what is done: rerun it after a time limit)
#   bash benchmarks/longctx_gpu.sh collect  # only copy the small outputs to $OUT/longctx/ (after a cut call)
# DRAFTERS=a,b,c picks drafters of the grid (specforge_csbp/studies/long_context/grid.py; their warm-start
# sources are added, skipped when exported); default: all.
# A finished target also comes back as $OUT/longctx/target.tar.part-* (15 MiB pieces): to continue on a fresh
# machine, put them in a carried folder and `cat target.tar.part-* | tar x -C $RUN`.
# Parts 2 and 3 need the run directory of the part before (the same warm machine, or RUN carried back:
# benchmarks/device_longctx.sh packs it).
# Each part copies what it made that is small (accuracy, eval JSON, records, plot, tables, log) to $OUT/longctx/.
set -euo pipefail
PART=${1:?part 1, 2 or 3}
RUN=${RUN:-runs/long_context/gpu}   # ignored by git: kept between calls on a warm machine; target/ (~40 MB) can be carried
OUT=${OUT:-benchmarks/results}
DATE=$(date -u +%F)
# the records file names the GPU the run had (an H200 call may run on an H100): h100, h200, ... or gpu
KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE '[abhl][0-9]{2,3}' | head -1 | tr 'A-Z' 'a-z')
KIND=${KIND:-gpu}
GPUS=${GPUS:-1}
DRAFTERS=${DRAFTERS:-all}
mkdir -p "$RUN" "$OUT/longctx"
S="python3 scripts/long_context_study.py --scale gpu --run $RUN"
rc=0  # a failed stage fails the part (after the outputs below are copied), so `all` stops there
case "$PART" in
  1) $S --stage target --target-minutes "${TARGET_MINUTES:-9}" || { rc=$?; [ "$rc" = 3 ] && echo "target: not done; run part 1 again"; } ;;
  2) { $S --stage capture --drafters "$DRAFTERS" && $S --stage train --drafters "$DRAFTERS" --gpus "$GPUS"; } || rc=$? ;;
  3) { $S --stage eval --drafters "$DRAFTERS" && $S --stage report --records "$OUT/longctx_${KIND}_$DATE.jsonl"; } || rc=$? ;;
  probe) python3 scripts/long_context_probe.py --scale gpu --run "$RUN" --drafters "${PROBE_DRAFTERS:-short,long}" \
      --near 256 --device cuda --blocks 32 || rc=$? ;;
  all) { bash "$0" 1 && bash "$0" 2 && bash "$0" 3; } || rc=$? ;;
  collect) ;;
  *) echo "part must be 1, 2, 3, probe, all or collect" >&2; exit 2 ;;
esac
if [ -f "$RUN/target/DONE" ] && ! ls "$OUT"/longctx/target.tar.part-* >/dev/null 2>&1; then
  tar cf - -C "$RUN" target | split -b 15M - "$OUT/longctx/target.tar.part-"
fi
cp "$RUN"/{accuracy.json,long_context.png,long_context_tables.md,study.log,commands.json,probe.json} "$RUN"/eval-*.json "$OUT/longctx/" 2>/dev/null || true
exit $rc

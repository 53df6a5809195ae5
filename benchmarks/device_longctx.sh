#!/usr/bin/env bash
# One device call of the long-context study: `bash benchmarks/device_longctx.sh SECONDS` runs
# benchmarks/longctx_gpu.sh all for at most SECONDS, then packs what came out so it fits the device tool's
# 8 files back: $OUT/results.tgz (logs, JSON, records, plot), $OUT/state.tgz (what a fresh machine needs to
# continue: every exported drafter, eval results, commands, accuracy, log; a few MB) and, the first time,
# $OUT/target.tar.part-* (the trained target in 15 MiB pieces).
# To continue on a fresh machine, put state.tgz and the target pieces in runs/carry/ and carry that folder:
# the stores are not carried (a stage needs them only until both drafters are trained and exported).
set -uo pipefail
LIMIT=${1:-560}
source benchmarks/gpu_env.sh; set +e  # gpu_env sets -e: a cut study must still be packed
FINAL=$OUT
export OUT=$FINAL/p
mkdir -p "$OUT/longctx"
RUN=${RUN:-runs/long_context/gpu}
CARRIED_TARGET=0
if ls runs/carry/target.tar.part-* >/dev/null 2>&1 && [ ! -f "$RUN/target/DONE" ]; then
  mkdir -p "$RUN" && cat runs/carry/target.tar.part-* | tar xf - -C "$RUN" && echo "target: from runs/carry"
  CARRIED_TARGET=1
fi
if [ -f runs/carry/state.tgz ]; then
  mkdir -p "$RUN" && tar xzf runs/carry/state.tgz -C "$RUN" --skip-old-files && echo "state: from runs/carry"
fi
timeout -k 10 "$LIMIT" bash benchmarks/longctx_gpu.sh all > "$OUT/longctx.log" 2>&1
echo "longctx rc=$?"
bash benchmarks/longctx_gpu.sh collect >> "$OUT/longctx.log" 2>&1
tail -40 "$OUT/longctx.log"
if [ "$CARRIED_TARGET" = 1 ]; then rm -f "$OUT"/longctx/target.tar.part-*; else mv "$OUT"/longctx/target.tar.part-* "$FINAL/" 2>/dev/null; fi
( cd "$RUN" && tar czf "$FINAL/state.tgz" $(ls -d drafter-* eval-*.json accuracy.json commands.json study.log \
    2>/dev/null) )
df -h . | tail -1
tar czf "$FINAL/results.tgz" -C "$OUT" . && rm -rf "$OUT"

#!/usr/bin/env bash
# One device call of the long-context study: `bash benchmarks/device_longctx.sh SECONDS` runs
# benchmarks/longctx_gpu.sh all for at most SECONDS, then packs what came out so it fits the device tool's
# 8 files back: $OUT/results.tgz (logs, JSON, records, plot) and $OUT/target.tar.part-* (the target, to carry).
set -uo pipefail
LIMIT=${1:-560}
source benchmarks/gpu_env.sh; set +e  # gpu_env sets -e: a cut study must still be packed
FINAL=$OUT
export OUT=$FINAL/p
mkdir -p "$OUT/longctx"
# a fresh machine continues from what an earlier call brought back, carried in runs/carry/ (target pieces,
# accuracy.json, commands.json, study.log)
RUN=${RUN:-runs/long_context/gpu}
if ls runs/carry/target.tar.part-* >/dev/null 2>&1 && [ ! -f "$RUN/target/DONE" ]; then
  mkdir -p "$RUN" && cat runs/carry/target.tar.part-* | tar xf - -C "$RUN" && echo "target: from runs/carry"
  for f in accuracy.json commands.json study.log; do [ -f "runs/carry/$f" ] && cp -n "runs/carry/$f" "$RUN/"; done
fi
timeout -k 10 "$LIMIT" bash benchmarks/longctx_gpu.sh all > "$OUT/longctx.log" 2>&1
echo "longctx rc=$?"
bash benchmarks/longctx_gpu.sh collect >> "$OUT/longctx.log" 2>&1
tail -40 "$OUT/longctx.log"
mv "$OUT"/longctx/target.tar.part-* "$FINAL/" 2>/dev/null
df -h . | tail -1
tar czf "$FINAL/results.tgz" -C "$OUT" . && rm -rf "$OUT"

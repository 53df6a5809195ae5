#!/usr/bin/env bash
# One device call of the long-context study:
#   [PARTS="2 3"] [DRAFTERS=a,b,c] bash benchmarks/device_longctx.sh SECONDS
# runs benchmarks/longctx_gpu.sh PART for each of PARTS (default: 1 2 3; also: probe) and the chosen drafters of the grid
# (default: all) for at most SECONDS in all, then packs what came out so it fits the device tool's 8 files
# of 16 MiB back:
#   $OUT/results.tgz                 logs, eval JSON, records, plot, tables (small)
#   $OUT/state.tgz.part-*            what a fresh machine needs to continue, in 15 MiB pieces (the study's
#                                    `--stage carry` list: eval results, commands, accuracy, log, and only the
#                                    exports still needed - not yet evaluated, or a source of a warm start to come)
#   $OUT/target.tar.part-*           the trained target in 15 MiB pieces (the call that finished it only)
# To continue on a fresh machine, put the state and target pieces (or an older state.tgz) in runs/carry/ and
# carry that folder: the stores are not carried (capture writes them again while a chosen drafter is not
# exported, ~70 s for both).
set -uo pipefail
LIMIT=${1:-560}
PARTS=${PARTS:-1 2 3}
export DRAFTERS=${DRAFTERS:-all}
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
for state in runs/carry/state.tgz runs/carry/state.tgz.part-aa; do
  [ -f "$state" ] || continue
  mkdir -p "$RUN"
  if [ "${state##*.}" = "tgz" ]; then cat "$state"; else cat runs/carry/state.tgz.part-*; fi \
    | tar xzf - -C "$RUN" --skip-old-files && echo "state: from $state"
done
START=$(date +%s)
for part in $PARTS; do
  LEFT=$(( LIMIT - ($(date +%s) - START) ))
  [ "$LEFT" -gt 10 ] || { echo "no time left for part $part"; break; }
  echo "== part $part, drafters $DRAFTERS, $LEFT s left" | tee -a "$OUT/longctx.log"
  timeout -k 10 "$LEFT" bash benchmarks/longctx_gpu.sh "$part" >> "$OUT/longctx.log" 2>&1
  rc=$?
  echo "part $part rc=$rc"
  [ "$rc" = 0 ] || break  # a cut or failed part: the next one would lack its inputs
done
bash benchmarks/longctx_gpu.sh collect >> "$OUT/longctx.log" 2>&1
tail -40 "$OUT/longctx.log"
if [ "$CARRIED_TARGET" = 1 ]; then rm -f "$OUT"/longctx/target.tar.part-*; else mv "$OUT"/longctx/target.tar.part-* "$FINAL/" 2>/dev/null; fi
CARRY=$(python3 scripts/long_context_study.py --scale gpu --run "$RUN" --stage carry)
echo "state: $(echo $CARRY | wc -w) paths: $(echo $CARRY)"
( cd "$RUN" && tar czf - $CARRY ) | split -b 15M - "$FINAL/state.tgz.part-"
ls -la "$FINAL"
[ "$(ls "$FINAL" | grep -v '^p$' | wc -l)" -le 7 ] || echo "WARNING: more than 8 files to bring back; carry fewer drafters per call"
df -h . | tail -1
tar czf "$FINAL/results.tgz" -C "$OUT" . && rm -rf "$OUT"

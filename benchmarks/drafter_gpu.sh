#!/usr/bin/env bash
# Issue 4 GPU runs (2 GPUs), in parts of < 10 min each: bash benchmarks/drafter_gpu.sh N (N = 1-17)
# Every stage has its own time limit so one slow stage cannot take the others' time; records are written
# point by point. Earlier forms of these parts: benchmarks/logs/drafter_h200x2_2026-11-29{,_b}.log.
# Part 1: why CSBP loses at 512K / 512 anchors (session 3: 0.88x CP, ceiling 1.19x, ~180 ms per step outside
# every measured component): one profiled step per mode, `prep_ms` (mask building of a fresh plan) in the
# components, the timed steps' recompiles / device allocations, an allocator A/B; then the DP point that
# the "2 GPUs >= 1.8x one GPU" target needs, with today's code.
source benchmarks/gpu_env.sh
stage() { local limit=$1; shift; echo "== $(date -u +%T) [limit ${limit}s] $*"; timeout -k 15 "$limit" "$@" 2>&1 | grep -v -i warn; }
B=benchmarks/drafter_bench.py
R="$OUT/drafter.jsonl"
case "${1:-1}" in
1)
  stage 240 torchrun --nproc-per-node 2 $B --shape a --modes csbp,cp --contexts 512K --anchors 512 --profile --out "$R"
  # the same pair with the allocator's expandable segments (plans change shapes every step; records show
  # the timed steps' device allocations and recompiles either way)
  stage 110 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nproc-per-node 2 $B --shape a \
    --modes csbp,cp --contexts 512K --anchors 512 --no-components --out "$R"
  stage 150 torchrun --nproc-per-node 2 $B --shape a --modes dp,csbp --contexts 128K --anchors 512 --out "$R"
  ;;
2)
  stage 150 torchrun --nproc-per-node 2 $B --shape a --modes csbp,cp --contexts 1M --anchors 512 --regather --out "$R"
  stage 200 env CUDA_VISIBLE_DEVICES=0 python3 $B --shape a --no-dflash2 --modes csbp,specforge --contexts 256K,512K \
    --anchors 512 --no-components --out "$R"
  ;;
3)
  # Session 4: every mode of a launch now starts from a fresh compile state (bench/isolation.py), CP runs
  # first, and the next step's masks are built ahead on a side stream (models/dflash/prefetch.py). The first
  # stage also tells whether that path works here: if it recorded nothing, the rest run without it.
  stage 130 torchrun --nproc-per-node 2 $B --shape a --modes dp,cp,csbp --contexts 128K --anchors 512 --out "$R"
  PF=""; grep -q '"status":"ok"' "$R" 2>/dev/null || PF=--no-prefetch-masks
  stage 120 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 512K --anchors 512 $PF --out "$R"
  stage 100 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 128K --anchors 2048 $PF --out "$R"
  stage 120 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 1M --anchors 512 $PF --out "$R"
  stage 120 env CUDA_VISIBLE_DEVICES=0 python3 $B --shape a --no-dflash2 --modes specforge,csbp \
    --contexts 64K,128K,256K --anchors 512 --no-components $PF --out "$R"
  ;;
4)
  # Session 5 built after its GPU time: the step's indices staged on the device (no pageable copy in the step;
  # the profile's "Memcpy HtoD (Pageable -> Device)" row should be gone) and fewer host syncs. The 512K pair
  # profiled (the 1.15x target), then 128K DP vs CSBP (the 1.8x-one-GPU target), CP first.
  stage 150 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 512K --anchors 512 --profile --out "$R"
  stage 130 torchrun --nproc-per-node 2 $B --shape a --modes dp,cp,csbp --contexts 128K --anchors 512 --out "$R"
  ;;
5)
  # Session 6: where one GPU's step goes (the 1.3x-over-SpecForge target at 64K): components and a profile of
  # ours on DFlash (conv and selector off, as in the SpecForge comparison) with kept logits.
  stage 120 env CUDA_VISIBLE_DEVICES=0 python3 $B --shape a --no-dflash2 --modes csbp --contexts 64K --anchors 512 \
    --keep-logits-gib 6 --profile --out "$R"
  ;;
6)
  # Session 6 changes: FlexAttention told when lengths are multiples of 128 (IS_DIVISIBLE: the dynamic-shape
  # kernels every mode got were 22% slower, benchmarks/flex_layer_bench.py) and the per-chunk CE arithmetic
  # compiled (objectives/ce_chunk.py). The issue-4 points again, CP first; then one GPU, ours first.
  stage 120 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 512K --anchors 512 --out "$R"
  stage 100 torchrun --nproc-per-node 2 $B --shape a --modes dp,cp,csbp --contexts 128K --anchors 512 --out "$R"
  stage 130 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 1M --anchors 512 --out "$R"
  stage 120 env CUDA_VISIBLE_DEVICES=0 python3 $B --shape a --no-dflash2 --modes csbp,specforge --contexts 64K,128K \
    --anchors 512 --no-components --keep-logits-gib 6 --out "$R"
  ;;
7)
  # Session 6, after part 6: CSBP's fused call gathers into a head-major buffer and concatenates with plain
  # block copies (collectives.py "heads"; the strided copies and zero-filled gradients were 25 ms of a
  # 200 ms full layer at 512K, benchmarks/flex_layer_bench.py +executor).
  stage 110 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 512K --anchors 512 --out "$R"
  stage 80 torchrun --nproc-per-node 2 $B --shape a --modes dp,cp,csbp --contexts 128K --anchors 512 --out "$R"
  stage 120 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 1M --anchors 512 --out "$R"
  ;;
8)
  # Next session, first (queue in benchmarks/README.md): the planner recalibrated for session 6's code (it now
  # also measures the top-1 loss rate), what is left of the 1M full-layer gap in one layer's call, and the
  # per-segment overlap schedule against fused at 1M (CSBP only: CP gathers no K/V).
  stage 140 torchrun --nproc-per-node 2 -m specforge_csbp plan --calibrate --profile-out "$OUT/h200x2.json" \
    --model drafter_configs/qwen3-8b-dflash2.json --context 1M --gpus 8 --gpu-mem 141 --workload drafter
  stage 150 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/flex_layer_bench.py --shape a --context 1M --anchors 512 \
    --variants cp:dynamic+divisible,cp:dynamic+divisible+rev,csbp:dynamic+divisible,csbp:dynamic+divisible+rev,csbp:dynamic+divisible+split
  stage 150 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 1M --anchors 512 --out "$R"
  stage 120 torchrun --nproc-per-node 2 $B --shape a --modes csbp --contexts 1M --anchors 512 --schedule overlap --out "$R"
  ;;
9)
  # Session 7: the rest of the shape-a grid (2048 anchors), each context with the fused and the per-segment
  # overlap schedule side by side (overlap won at 1M / 512 in part 8: 1337 vs 1365 ms). DP last: an OOM ends
  # a multi-rank launch.
  for L in 64K 256K 512K; do
    stage 150 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp,dp --contexts $L --anchors 2048 --out "$R"
    stage 90 torchrun --nproc-per-node 2 $B --shape a --modes csbp --contexts $L --anchors 2048 --schedule overlap --out "$R"
  done
  ;;
10)
  stage 150 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp,dp --contexts 1M --anchors 2048 --out "$R"
  stage 100 torchrun --nproc-per-node 2 $B --shape a --modes csbp --contexts 1M --anchors 2048 --schedule overlap --out "$R"
  for L in 64K 256K; do
    stage 120 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp,dp --contexts $L --anchors 512 --out "$R"
  done
  ;;
11)
  # Session 7, last call: CSBP fused at 1M / 2048 (CP ran out of memory there in part 10, ending that launch),
  # 128K / 2048 with session 6's code, shape b at 1M, and one GPU against SpecForge at 256K.
  stage 110 torchrun --nproc-per-node 2 $B --shape a --modes csbp,dp --contexts 1M --anchors 2048 --out "$R"
  stage 80 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 128K --anchors 2048 --out "$R"
  stage 120 torchrun --nproc-per-node 2 $B --shape b --dflash2 --modes cp,csbp --contexts 1M --anchors 512 --out "$R"
  stage 110 env CUDA_VISIBLE_DEVICES=0 python3 $B --shape a --no-dflash2 --modes csbp,specforge --contexts 256K \
    --anchors 512 --no-components --keep-logits-gib 16 --out "$R"
  ;;
12)
  # Session 8, first (session 7 built after its GPU time: warm-up to a steady compile state, the
  # --reverse-queries switch, --gather-ahead). 1M / 512 was the one shape-a point under 95% of its ceiling
  # (fused 94.5%; the overlap schedule was 2% faster in its own launch; CSBP's exposed communication was
  # 22 ms): fused with DP (the missing DP point, last: an OOM ends the launch), then overlap, reversed
  # queries and the gather one layer ahead, each side by side with CP. Session 8 ran parts 12 and 13 before
  # the gather ahead became the default; --no-gather-ahead reproduces them.
  NG=--no-gather-ahead
  stage 150 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp,dp --contexts 1M --anchors 512 $NG --out "$R"
  stage 130 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 1M --anchors 512 --schedule overlap $NG --out "$R"
  stage 130 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 1M --anchors 512 --reverse-queries $NG --out "$R"
  stage 130 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 1M --anchors 512 --gather-ahead --out "$R"
  ;;
13)
  # 512K / 512 with DP; the schedule crossover with a steady warm-up (session 7's overlap records at 64K /
  # 256K compiled during their timed steps); DP at 128K / 2048; reversed queries at 128K. (The 256K overlap
  # stage's CSBP run needs more than its 90 s.)
  NG=--no-gather-ahead
  stage 130 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp,dp --contexts 512K --anchors 512 $NG --out "$R"
  for L in 64K 256K; do
    stage 90 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts $L --anchors 2048 --schedule overlap $NG --out "$R"
  done
  stage 120 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp,dp --contexts 128K --anchors 2048 $NG --out "$R"
  stage 90 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 128K --anchors 512 --reverse-queries $NG --out "$R"
  ;;
14)
  # `specforge train --csbp` itself on 2 GPUs at 128K (SpecForge's trainer with the plugin's look-ahead and
  # feature prefetch), on a head-only random target and a random store (benchmarks/plugin_setup.py: 6 samples,
  # 40 GB in /tmp; a step trains 2 samples, so 3 steps), then the same drafter in the benchmark. Read
  # perf/optimizer_step_time_s of steps 2-3 (per 2 samples) against 2 x the benchmark's CSBP step.
  P=/tmp/plugin
  stage 200 python3 benchmarks/plugin_setup.py --draft-config drafter_configs/qwen3.6-27b-dflash2.json \
    --context 128K --samples 6 --out $P --overwrite
  stage 330 python3 -m specforge_csbp train --csbp -c examples/long_context/qwen3.6-27b-dflash2-256k.yaml \
    model.target_model_path=$P/target data.hidden_states_path=$P/store data.max_length=131072 \
    output_dir=$P/output csbp.anchor_sampling=uniform training.log_interval=1
  stage 150 torchrun --nproc-per-node 2 $B --draft-config drafter_configs/qwen3.6-27b-dflash2.json --modes cp,csbp \
    --contexts 128K --anchors 512 --out "$R"
  ;;
15)
  # Session 8, after 12 and 13 (the gather ahead won at 1M / 512): the gather ahead at 512K / 512 and 1M / 512,
  # then 1M / 512 gathering in front of each layer with DP again (part 12's records were not fetched).
  stage 120 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 512K --anchors 512 --gather-ahead --out "$R"
  stage 140 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts 1M --anchors 512 --gather-ahead --out "$R"
  stage 150 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp,dp --contexts 1M --anchors 512 --no-gather-ahead --out "$R"
  ;;
16)
  # Session 8: the gather ahead at the other shape-a points (does it ever lose?), side by side with CP.
  for LN in 64K:512 256K:512 128K:2048 256K:2048; do
    stage 110 torchrun --nproc-per-node 2 $B --shape a --modes cp,csbp --contexts ${LN%:*} --anchors ${LN#*:} --gather-ahead --out "$R"
  done
  ;;
17)
  # Session 8: shape b with today's code and the gather ahead (the recorded sweep predates session 6).
  for L in 64K 256K 1M; do
    stage 125 torchrun --nproc-per-node 2 $B --shape b --dflash2 --modes cp,csbp --contexts $L --anchors 512 --gather-ahead --out "$R"
  done
  ;;
esac
echo "== $(date -u +%T) done"

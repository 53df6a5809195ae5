#!/usr/bin/env bash
# Profile the trainers themselves on one GPU (the user's commands, not a harness), beside the benchmark step of
# the same model.   bash benchmarks/profile_gpu.sh drafter | bench | eval | bdlm
#   drafter: `specforge-csbp train --csbp` (SpecForge's trainer + the plugin), Qwen3.6-27B DFlash2 drafter at 64K,
#            512 anchors, one rank, on benchmarks/plugin_setup.py's random target head and store, with the host
#            syncs of two steps counted by stack and the recompiles logged;
#   bench:   drafter_bench.py's step of the same drafter, with and without kept logits.
#   eval:    `specforge-csbp eval`'s loop (benchmarks/eval_bench.py), Qwen3-1.7B-shaped target, 32K and 128K prompts.
#   bdlm:    `specforge-csbp train-bdlm` for the Qwen3-1.7B shape at 64K (one rank, default settings).
#   flex:    the same model's 2L FlexAttention call at 64K (forward, forward + backward) under kernel options:
#            TMA loads, forward / backward tile shapes, and inductor's autotuned choice.
# Writes $OUT/<part>/{ops_cuda,ops_cpu}.txt, steps.json, and the benchmark's records.
source benchmarks/gpu_env.sh
stage() { local limit=$1; shift; echo "== $(date -u +%T) [limit ${limit}s] $*"; timeout -k 15 "$limit" "$@" 2>&1 | grep -v -i warn; }
case "${1:-drafter}" in
drafter)
  P=/tmp/plugin
  stage 120 python3 benchmarks/plugin_setup.py --draft-config drafter_configs/qwen3.6-27b-dflash2.json \
    --context 64K --samples 7 --out $P --overwrite
  stage 250 env TORCH_LOGS=recompiles python3 benchmarks/profile_train.py --out $OUT/drafter --wait 3 --active 2 --syncs --trace -- \
    train --csbp -c examples/long_context/qwen3.6-27b-dflash2-256k.yaml deployment.trainer.nproc_per_node=1 \
    csbp.cp_size=1 model.target_model_path=$P/target data.hidden_states_path=$P/store data.max_length=65536 \
    output_dir=$P/output csbp.anchor_sampling=uniform training.log_interval=1 training.save_interval=100000
  rm -rf $P/output
  ;;
bench)
  mkdir -p $OUT/drafter
  stage 150 python3 benchmarks/drafter_bench.py --draft-config drafter_configs/qwen3.6-27b-dflash2.json \
    --modes dp --contexts 64K --anchors 512 --out $OUT/drafter/bench.jsonl
  stage 100 python3 benchmarks/drafter_bench.py --draft-config drafter_configs/qwen3.6-27b-dflash2.json \
    --modes dp --contexts 64K --anchors 512 --keep-logits-gib 6 --no-components --out $OUT/drafter/bench.jsonl
  ;;
eval)
  mkdir -p $OUT/eval
  stage 300 python3 benchmarks/eval_bench.py --contexts 32K,128K --max-new-tokens 64 --out $OUT/eval/eval.jsonl
  ;;
bdlm)
  stage 300 env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \
    python3 benchmarks/profile_train.py --out $OUT/bdlm --wait 2 --active 2 --syncs -- \
    train-bdlm -c benchmarks/configs/bdlm_qwen3-1.7b_64k.yaml train.steps=6
  ;;
flex)
  B=bdlm:static+divisible
  stage 360 python3 benchmarks/flex_layer_bench.py --context 64K --block-size 32 --iters 5 --variants \
$B,$B+USE_TMA=1,$B+fwd_BLOCK_N=128+fwd_num_stages=2,$B+fwd_BLOCK_N=128+fwd_num_stages=2+USE_TMA=1,\
$B+bwd_num_stages=2,$B+autotune
  ;;
esac
echo "== $(date -u +%T) done"

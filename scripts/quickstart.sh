#!/usr/bin/env bash
# The README's first command. From a fresh checkout: set up .venv (CPU torch, this package, stock SpecForge
# 0.2.0), then the whole CSBP drafter pipeline on 2 CPU ranks, using only files in the repository:
#   1. target   train the tiny Qwen3 target on a seeded synthetic grammar (specforge_csbp/assets/grammar.py)
#               and write its own greedy answers as the drafter's training data (cached under runs/quickstart)
#   2. capture  target hidden states over those answers -> feature store
#   3. train    `specforge train --csbp -c examples/quickstart.yaml`   (SpecForge's trainer, CSBP on 2 gloo ranks)
#   4. export   the checkpoint as an SGLang DFLASH drafter directory (checked against SGLang's loader contract)
#   5. eval     greedy speculative decoding on held-out prompts: tau of the trained drafter vs an untrained one
# Everything goes to runs/quickstart/ (rerunning replaces it, except the cached target and data). A few
# minutes on 2 CPU cores after set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
RUN=runs/quickstart
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning}   # library deprecation notices, not about this run

echo "== 1/5 train the tiny target on the synthetic grammar; its greedy answers become the training data"
$PY -m specforge_csbp.assets.quickstart --out "$RUN" --seed 0

echo "== 2/5 capture target features into $RUN/store"
$PY -m specforge_csbp capture \
  --target "$RUN/target" --data "$RUN/data/train.jsonl" --draft-config examples/quickstart_drafter.json \
  --dtype float32 --out "$RUN/store" --overwrite --no-progress

echo "== 3/5 specforge train --csbp -c examples/quickstart.yaml"
if ! $PY -c "import sys, specforge.cli as c; sys.exit(not getattr(c.main, '__specforge_csbp_wrapped__', False))"; then
  echo "error: the specforge-csbp start-up hook (site-packages/specforge-csbp-hook.pth) is not active;" \
       "reinstall with 'pip install -e .', or unset SPECFORGE_CSBP_DISABLE" >&2
  exit 1
fi
rm -rf "$RUN/output"
.venv/bin/specforge train --csbp -c examples/quickstart.yaml

echo "== 4/5 export for SGLang"
$PY -m specforge_csbp export --to sglang "$RUN/output" "$RUN/drafter-sglang" --overwrite --target "$RUN/target"

echo "== 5/5 eval: acceptance length (tau) on held-out prompts, trained drafter vs an untrained one"
mkdir -p "$RUN/eval"
EVAL=(--target "$RUN/target" --prompts "$RUN/data/prompts.jsonl" --num-prompts 8 --max-new-tokens 96 --device cpu)
$PY -m specforge_csbp eval --drafter "$RUN/drafter-sglang" "${EVAL[@]}" --out "$RUN/eval/trained.json"
$PY -m specforge_csbp eval --drafter "$RUN/drafter-sglang" "${EVAL[@]}" --untrained --out "$RUN/eval/untrained.json"

echo
echo "Done. Exported DFlash2 drafter: $(pwd)/$RUN/drafter-sglang   (provenance.json beside the weights)"
echo "Serve it next to its target with SGLang:"
echo "  python -m sglang.launch_server --model-path $(pwd)/$RUN/target --speculative-algorithm DFLASH \\"
echo "      --speculative-draft-model-path $(pwd)/$RUN/drafter-sglang --speculative-num-draft-tokens 4 --trust-remote-code"

# last lines: the trained drafter's tau beside the untrained one's
$PY - "$RUN/eval" <<'PYEOF'
import json, sys
t, u = (json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("trained", "untrained"))
print("\nAcceptance length on held-out prompts (tau: tokens per target verify step, bonus included):")
print(f"{'drafter':<11}{'tau':>6}{'verify steps':>14}{'generated':>11}")
for name, r in (("untrained", u), ("trained", t)):
    print(f"{name:<11}{r['tau']:>6.2f}{r['verify_steps']:>14}{r['generated_tokens']:>11}")
print(f"trained / untrained: {t['tau'] / u['tau']:.2f}x   (block size {t['block_size']}: at most "
      f"{t['block_size']} tokens per step)")
PYEOF

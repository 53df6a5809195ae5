#!/usr/bin/env bash
# The README's first command. From a fresh checkout: set up .venv (CPU torch, this package, stock SpecForge
# 0.2.0), then the whole CSBP drafter pipeline on 2 CPU ranks, using only files in the repository:
#   1. capture  target hidden states of a tiny random Qwen3 over the bundled chat dataset -> feature store
#   2. train    `specforge train --csbp -c examples/quickstart.yaml`   (SpecForge's trainer, CSBP on 2 gloo ranks)
#   3. export   the checkpoint as an SGLang DFLASH drafter directory (checked against SGLang's loader contract)
# Everything goes to runs/quickstart/ (rerunning replaces it). Takes about a minute after set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
RUN=runs/quickstart
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning}   # library deprecation notices, not about this run

echo "== 1/3 capture target features into $RUN/store"
$PY -m specforge_csbp capture \
  --target specforge_csbp/assets/tiny_qwen3 --seed 0 --save-target "$RUN/target" \
  --data specforge_csbp/assets/tiny_chat.jsonl --draft-config examples/quickstart_drafter.json \
  --dtype float32 --out "$RUN/store" --overwrite

echo "== 2/3 specforge train --csbp -c examples/quickstart.yaml"
if ! $PY -c "import sys, specforge.cli as c; sys.exit(not getattr(c.main, '__specforge_csbp_wrapped__', False))"; then
  echo "error: the specforge-csbp start-up hook (site-packages/specforge-csbp-hook.pth) is not active;" \
       "reinstall with 'pip install -e .', or unset SPECFORGE_CSBP_DISABLE" >&2
  exit 1
fi
rm -rf "$RUN/output"
.venv/bin/specforge train --csbp -c examples/quickstart.yaml

echo "== 3/3 export for SGLang"
$PY -m specforge_csbp export --to sglang "$RUN/output" "$RUN/drafter-sglang" --overwrite --target "$RUN/target"

echo
echo "Done. Exported DFlash2 drafter: $(pwd)/$RUN/drafter-sglang   (provenance.json beside the weights)"
echo "Serve it next to its target with SGLang:"
echo "  python -m sglang.launch_server --model-path $(pwd)/$RUN/target --speculative-algorithm DFLASH \\"
echo "      --speculative-draft-model-path $(pwd)/$RUN/drafter-sglang --speculative-num-draft-tokens 4 --trust-remote-code"

#!/usr/bin/env bash
# Creates .venv (if missing) with CPU torch 2.13.0, this package, test tools and stock SpecForge 0.2.0.
# SpecForge pins a CUDA torch and sglang, so it is installed with --no-deps plus the light deps it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/cpu.txt -e ".[test]"
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/cpu.txt -r requirements/specforge-cpu.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps specforge==0.2.0
# The real-loader contract test (tests/export/test_sglang_real_loaders.py) imports SGLang's own DFlash drafter code:
# sglang wheels without their dependencies, each in its own side dir (cached; a failed unpack is redone).
# 0.5.14 = SpecForge 0.2.0's pin (DFlash only), 0.5.17 / 0.5.18 = before / from a top-level is_causal: false,
# 0.5.19 = the first release with DFlash2, 0.5.23 = the newest.
# vLLM's wheel is only read (its DFlash model files cannot be imported without vLLM's GPU runtime).
for spec in sglang==0.5.14 sglang==0.5.17 sglang==0.5.18 sglang==0.5.19 sglang==0.5.23; do
  side=".venv/side/${spec/==/-}"
  if [ ! -f "$side/.complete" ]; then
    rm -rf "$side"
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$side" "$spec"
    touch "$side/.complete"
  fi
done
side=.venv/side/vllm-0.33.0
if [ ! -f "$side/.complete" ]; then
  rm -rf "$side" "$side.whl"
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps vllm==0.33.0 -d "$side.whl"
  .venv/bin/python -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])' "$side.whl"/vllm-0.33.0-*.whl "$side"
  rm -rf "$side.whl"
  touch "$side/.complete"
fi

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

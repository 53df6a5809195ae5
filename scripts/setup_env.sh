#!/usr/bin/env bash
# Builds a venv with CPU torch, this package, test tools and stock SpecForge 0.2.0.
#
#   bash scripts/setup_env.sh            .venv         SpecForge 0.2.0's pinned stack (constraints/pinned.txt:
#                                                      transformers 5.8.1, torch 2.13.0 CPU - the nearest CPU
#                                                      build to its torch 2.11.0)
#   bash scripts/setup_env.sh --latest   .venv-latest  the newest releases inside pyproject.toml's bounds
#
# SpecForge pins a CUDA torch and sglang, so it is installed with --no-deps plus the light deps it imports.
# A venv whose inputs (this script, pyproject.toml, constraints/, requirements/) are unchanged since its last
# complete build is left as it is (a stamp file holds their hash), so rerunning costs a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-}" in
  "") VENV=.venv; STACK=(-c constraints/pinned.txt) ;;
  --latest) VENV=.venv-latest; STACK=(-c constraints/cpu.txt --upgrade --upgrade-strategy eager) ;;
  *) echo "setup_env.sh: error: unknown argument '$1' (allowed: none for the pinned stack, --latest)" >&2; exit 2 ;;
esac
INPUTS=$(cat scripts/setup_env.sh pyproject.toml constraints/* requirements/* | sha256sum | cut -d' ' -f1)
STAMP="$VENV/.specforge-csbp-setup"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$INPUTS" ]; then
  exit 0
fi
if [ -L "$VENV" ] || [ ! -x "$VENV/bin/python" ]; then
  rm -f "$VENV" 2>/dev/null || true   # a symlink to another checkout's venv is replaced by this one's own
  "$PY" -m venv "$VENV"
fi
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "${STACK[@]}" -e ".[test]" -r requirements/specforge-cpu.txt
"${PIP[@]}" --no-deps specforge==0.2.0
if [ "$VENV" = .venv ]; then
  # The real-loader contract test (tests/export/test_sglang_real_loaders.py) imports SGLang's own DFlash drafter
  # code: sglang wheels without their dependencies, each in its own side dir (cached; a failed unpack is redone),
  # read by the tests of either venv from .venv/side.
  # 0.5.14 = SpecForge 0.2.0's pin (DFlash only), 0.5.17 / 0.5.18 = before / from a top-level is_causal: false,
  # 0.5.19 = the first release with DFlash2, 0.5.23 = the newest.
  # vLLM's wheel is only read (its DFlash model files cannot be imported without vLLM's GPU runtime).
  for spec in sglang==0.5.14 sglang==0.5.17 sglang==0.5.18 sglang==0.5.19 sglang==0.5.23; do
    side=".venv/side/${spec/==/-}"
    if [ ! -f "$side/.complete" ]; then
      rm -rf "$side"
      "${PIP[@]}" --no-deps --no-compile --target "$side" "$spec"
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
fi
echo "$INPUTS" > "$STAMP"

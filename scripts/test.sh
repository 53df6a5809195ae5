#!/usr/bin/env bash
# Sets up .venv from scratch if needed, then runs the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"

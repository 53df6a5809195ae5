#!/usr/bin/env bash
# The README's test command (CI runs it on both stacks, .ci/run). Sets up the venv if needed, then:
#   bash scripts/test.sh            the whole CPU test suite on SpecForge 0.2.0's pinned stack (.venv)
#   bash scripts/test.sh --latest   the plugin, eval, export, models and data tests on the newest releases
#                                   inside pyproject.toml's bounds (.venv-latest)
# Further arguments go to pytest. Tests run in parallel, one pytest-xdist worker per core (PYTEST_WORKERS=N
# overrides); a file's tests stay on one worker (--dist loadfile), so its module fixtures are built once, and
# files are handed out in collection order (--no-loadscope-reorder; tests/conftest.py puts the files of
# `slow` tests first, so no long file starts last).
set -euo pipefail
cd "$(dirname "$0")/.."
SELECT=()
if [ "${1:-}" = --latest ]; then
  shift
  bash scripts/setup_env.sh --latest
  PY=.venv-latest/bin/python
  SELECT=(tests/plugin tests/eval tests/export tests/models tests/data)
else
  bash scripts/setup_env.sh
  PY=.venv/bin/python
fi
exec "$PY" -m pytest -q -n "${PYTEST_WORKERS:-auto}" --dist loadfile --no-loadscope-reorder "${SELECT[@]}" "$@"

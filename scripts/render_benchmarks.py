#!/usr/bin/env python
"""Regenerate docs/benchmarks.md and docs/img/*.png from benchmarks/results/ (same as `specforge-csbp report`).

Runs from the repository root whatever the current directory, so paths given are relative to the root:

    python scripts/render_benchmarks.py [--results benchmarks/results] [--out docs/benchmarks.md] [--csv F]
"""

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from specforge_csbp.cli.main import main

if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main(["report", *sys.argv[1:]]))

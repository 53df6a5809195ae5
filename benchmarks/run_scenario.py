#!/usr/bin/env python
"""Run named GPU benchmark scenarios from benchmarks/scenarios.toml (specforge_csbp/bench/scenarios.py).

    python benchmarks/run_scenario.py --list
    python benchmarks/run_scenario.py drafter-27b --contexts 512K --dry-run   # the 512K comparison's commands
    source benchmarks/gpu_env.sh && python3 benchmarks/run_scenario.py drafter-27b --contexts 512K

Runs from the repository root whatever the current directory (the scripts' paths are relative to it).
"""

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from specforge_csbp.bench.scenarios import main

if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main(sys.argv[1:]))

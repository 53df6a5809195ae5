#!/usr/bin/env python
"""Benchmark sweep, the script form of `specforge-csbp sweep` (run from the repository root).

    python scripts/sweep.py --workload drafter --contexts 64K,128K,256K,512K,1M --modes cp,bp,csbp \
        --world-sizes 2 --out-dir benchmarks/results/sweep-drafter
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specforge_csbp.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))

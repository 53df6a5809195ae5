#!/usr/bin/env python
"""Regenerate docs/benchmarks.md (headline), docs/benchmarks_records.md (every record) and docs/img/*.png from
benchmarks/results/ (same as `specforge-csbp report`).

Runs from the repository root whatever the current directory, so paths given are relative to the root.
Without --predict it puts the planner's predictions (calibrated 2x H200 profile, benchmarks/configs/)
beside the measured records on the every-record page:

    python scripts/render_benchmarks.py [--results benchmarks/results] [--out docs/benchmarks.md] [--csv F]
"""

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from specforge_csbp.cli.main import main

#: the planner's prediction beside every measured record of these workloads (issue 6)
PREDICT = [
    "--predict",
    "drafter-qwen3.6-27b=benchmarks/configs/drafter-qwen3.6-27b.json",
    "drafter-qwen3-8b=benchmarks/configs/drafter-qwen3-8b.json",
    "sft=benchmarks/configs/qwen3-1.7b.json",
    "--profile",
    "h200x2-2026-11-30-c",  # the drafter's rates, calibrated with the code of the newest drafter records
    "sft=h200x2-2026-11-30-b",  # the only profile that measured Qwen3-1.7B's own SFT layer
    # the library digest of record files written before records carried one (benchmarks/README.md)
    "--code-by-file",
    "benchmarks/results-code.json",
]
#: the named scenario that reruns each headline row
SCENARIOS = ["--scenarios", "benchmarks/scenarios.toml"]

if __name__ == "__main__":
    os.chdir(ROOT)
    argv = sys.argv[1:]
    sys.exit(main(["report", *argv, *([] if "--predict" in argv else PREDICT),
                   *([] if "--scenarios" in argv else SCENARIOS)]))

#!/usr/bin/env python
"""The long-context study (docs/long_context.md): does a drafter trained on long sequences keep its acceptance
deep into the context, where one trained on short sequences does not?

    python scripts/long_context_study.py --scale cpu --stage all                 # the CPU miniature (~1 min)
    python scripts/long_context_study.py --scale gpu --stage target              # repeat until it says done
    python scripts/long_context_study.py --scale gpu --stage capture|train|eval|report [--records FILE]

Every stage is idempotent: it skips what its outputs already hold, and the target stage resumes its training.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specforge_csbp.studies.long_context.study import SCALES, STAGES, run_stage  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=(*STAGES, "all"), required=True)
    p.add_argument("--scale", choices=tuple(SCALES), required=True)
    p.add_argument("--run", default=None, help="run directory (default runs/long_context/<scale>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document family")
    p.add_argument("--records", default=None, help="report: records file (default RUN/records.jsonl)")
    p.add_argument("--target-minutes", type=float, default=None,
                   help="target: training time of this call before it saves and stops (default: the scale's)")
    p.add_argument("--gpus", type=int, default=None,
                   help="train: ranks, all in one CSBP group (cp_size = ranks; default: the scale's, 1)")
    args = p.parse_args(argv)
    run = args.run or os.path.join("runs", "long_context", args.scale)
    overrides = {} if args.target_minutes is None else {"target_minutes": args.target_minutes}
    if args.gpus is not None:
        overrides.update(nproc=args.gpus, cp_size=args.gpus)
    run_stage(args.stage, args.scale, run, seed=args.seed, records=args.records, overrides=overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The long-context study (docs/long_context.md): does a drafter trained on long sequences keep its acceptance
deep into the context, where one trained on short sequences does not?

    python scripts/long_context_study.py --scale cpu --stage all                 # the CPU miniature (~1 min)
    python scripts/long_context_study.py --scale gpu --stage target              # repeat until it says done
    python scripts/long_context_study.py --scale gpu --stage capture|train|eval|report [--records FILE]
    python scripts/long_context_study.py --scale gpu --stage all --drafters swa-short,swa-short-then-long
    python scripts/long_context_study.py --scale gpu --stage report --docs docs/long_context.md
    python scripts/long_context_study.py --scale gpu --stage report --docs docs/long_context.md \
        --from-records benchmarks/results/longctx_h200_2026-12-03.jsonl,benchmarks/results/longctx_h100_2026-12-07_b.jsonl

Every stage is idempotent: it skips what its outputs already hold, and the target stage resumes its training.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specforge_csbp.progress import quiet_library_bars  # noqa: E402
from specforge_csbp.studies.long_context.study import SCALES, STAGES, carry_paths, run_stage  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=(*STAGES, "all", "carry"), required=True,
                   help="carry: print what a fresh machine needs of RUN to continue (one path a line; no work)")
    p.add_argument("--scale", choices=tuple(SCALES), required=True)
    p.add_argument("--run", default=None, help="run directory (default runs/long_context/<scale>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document family")
    p.add_argument("--records", default=None, help="report: records file (default RUN/records.jsonl)")
    p.add_argument("--target-minutes", type=float, default=None,
                   help="target: training time of this call before it saves and stops (default: the scale's)")
    p.add_argument("--gpus", type=int, default=None,
                   help="train: ranks, all in one CSBP group (cp_size = ranks; default: the scale's, 1)")
    p.add_argument("--drafters", default=None,
                   help="train / eval: comma-separated drafters of the grid (studies/long_context/grid.py; their "
                   "warm-start sources are added), or all (default)")
    p.add_argument("--docs", default=None,
                   help="report: also write the tables into this markdown file's report block and the plot "
                   "beside it (docs/long_context.md)")
    p.add_argument("--from-records", default=None,
                   help="report: comma-separated record files to plot and tabulate instead of RUN's eval results")
    args = p.parse_args(argv)
    run = args.run or os.path.join("runs", "long_context", args.scale)
    if args.stage == "carry":
        print("\n".join(carry_paths(run)))
        return 0
    quiet_library_bars()  # the study's own model loads and saves; its commands quiet their own
    overrides = {} if args.target_minutes is None else {"target_minutes": args.target_minutes}
    if args.gpus is not None:
        overrides.update(nproc=args.gpus, cp_size=args.gpus)
    if args.drafters is not None:
        overrides["drafters"] = args.drafters
    try:
        run_stage(args.stage, args.scale, run, seed=args.seed, records=args.records, docs=args.docs,
                  from_records=tuple(f for f in (args.from_records or "").split(",") if f), overrides=overrides)
    except ValueError as err:  # bad input (--drafters, --docs): one line
        print(f"long_context_study: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

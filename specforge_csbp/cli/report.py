"""`specforge-csbp report`: regenerate docs/benchmarks.md (tables, speedups, plots) from benchmark records."""

from __future__ import annotations

import argparse

from ..bench.report import write_report

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="regenerate the benchmark report (markdown + PNG plots) from records")
    p.add_argument("--results", nargs="+", default=["benchmarks/results"],
                   help="record files or directories (*.json lists/objects, *.jsonl lines)")
    p.add_argument("--out", default="docs/benchmarks.md", help="markdown file to write")
    p.add_argument("--img-dir", default=None, help="where the PNGs go (default: <dir of --out>/img)")
    p.add_argument("--csv", default=None, help="also write every record as one CSV row here")
    p.add_argument("--title", default="Benchmarks")
    p.add_argument("--predict", nargs="*", default=[], metavar="WORKLOAD=CONFIG",
                   help="put the planner's prediction beside every ok record of WORKLOAD (model config.json)")
    p.add_argument("--profile", default="h200-nominal", help="machine profile for --predict (JSON or built-in)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    predictor, note, since = None, "", None
    if args.predict:
        from ..planner.profile import load_profile
        from ..planner.validate import record_predictor

        models = {}
        for item in args.predict:
            workload, sep, config = item.partition("=")
            if not sep or not workload or not config:
                raise ValueError(f"predict must be WORKLOAD=CONFIG; got {item!r}")
            models[workload] = config
        profile = load_profile(args.profile)
        predictor = record_predictor(models, profile)
        since = profile.date if profile.measured else None
        note = (f"Planner predictions use the profile `{args.profile}` ({profile.summary()}) and the model "
                "configs " + ", ".join(f"`{w}`: `{c}`" for w, c in sorted(models.items())) + ".")
    records = write_report(args.results, args.out, img_dir=args.img_dir, csv_path=args.csv, title=args.title,
                           predictor=predictor, predictor_note=note, predicted_since=since)
    print(f"report: {len(records)} records -> {args.out}")
    return 0

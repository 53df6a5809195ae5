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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    records = write_report(args.results, args.out, img_dir=args.img_dir, csv_path=args.csv, title=args.title)
    print(f"report: {len(records)} records -> {args.out}")
    return 0

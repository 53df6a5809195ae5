"""`specforge-csbp sweep`: context x mode x degree x block-size grid, one fresh process per point.

    specforge-csbp sweep --workload drafter --contexts 64K,128K,256K,512K,1M --modes cp,bp,csbp \
        --world-sizes 2 --block-sizes 16 --out-dir benchmarks/results/sweep-drafter-h200x2

Failing points are recorded (status oom / error) and the sweep goes on; re-running the same command skips
points already in <out-dir>/records.jsonl. Writes records.jsonl, sweep.csv, sweep.md and img/*.png there.
"""

from __future__ import annotations

import argparse
import sys

from ..bench.grid import (
    DEFAULT_TEMPLATE,
    LAUNCHERS,
    POINT_MODES,
    SWEEP_MODES,
    WORKLOADS,
    build_grid,
    parse_sizes,
    point_command,
)
from ..bench.runner import run_sweep, write_outputs
from ..preflight import check_writable_dir
from ..values import parse_ints

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run a benchmark grid, one fresh process per point (resumable)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--workload", nargs="+", default=["attention"],
                   help=f"workload names ({', '.join(WORKLOADS)}; any name with --script/--template)")
    p.add_argument("--contexts", default="64K,128K,256K", help="comma list of clean context lengths (64K, 1M, ...)")
    p.add_argument("--modes", default=",".join(SWEEP_MODES), help=f"comma list among {', '.join(POINT_MODES)}")
    p.add_argument("--world-sizes", default="2", help="comma list of degrees (ranks per point)")
    p.add_argument("--block-sizes", default="16", help="comma list of block sizes")
    p.add_argument("--out-dir", required=True, help="records.jsonl, sweep.csv, sweep.md, img/, logs/ go here")
    p.add_argument("--script", default=None, help="benchmark script for every workload (default: per workload)")
    p.add_argument("--args", default="", help="extra arguments appended to every point's command")
    p.add_argument("--launcher", choices=LAUNCHERS, default="torchrun",
                   help="torchrun: one process per rank; python: the script starts its own ranks")
    p.add_argument("--template", default=None,
                   help=f"command template (default: the workload's, else {DEFAULT_TEMPLATE!r}; see bench/grid.py)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per point before it counts as error")
    p.add_argument("--device", default=None, help="device name for the records (default: nvidia-smi / cpu)")
    p.add_argument("--date", default=None, help="date for the records (default: today, UTC)")
    p.add_argument("--retry-failed", action="store_true", help="re-run points recorded with status error")
    p.add_argument("--skip-after-oom", action="store_true",
                   help="record larger contexts of a (mode, degree, block) that OOMed as oom without running")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--report-only", action="store_true", help="only regenerate csv/md/png from records.jsonl")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _ints(text: str, field: str) -> list[int]:
    return sorted(set(parse_ints(text, field=field, minimum=1)))


def run(args: argparse.Namespace) -> int:
    check_writable_dir(args.out_dir, "--out-dir")
    if args.report_only:
        records = write_outputs(args.out_dir)
        print(f"sweep: {len(records)} records -> {args.out_dir}/sweep.md")
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    points, invalid = build_grid(
        args.workload, parse_sizes(args.contexts, field="--contexts"), modes, _ints(args.world_sizes, "--world-sizes"),
        _ints(args.block_sizes, "--block-sizes"), args.args,
    )  # fmt: skip

    def command_for(point, out):
        return point_command(point, out, template=args.template, script=args.script, launcher=args.launcher)

    for point in points:  # fail on a bad template / workload before anything runs
        command_for(point, "OUT")
    for point, why in invalid:
        print(f"sweep: not a valid point, skipped: {point.key} ({why})", file=sys.stderr)
    if args.dry_run:
        import shlex

        for point in points:
            print(shlex.join(command_for(point, f"<{point.slug}.jsonl>")))
        return 0
    summary = run_sweep(
        points, command_for, args.out_dir, device=args.device, date=args.date, timeout_s=args.timeout,
        retry_failed=args.retry_failed, skip_after_oom=args.skip_after_oom, progress=not args.no_progress,
    )  # fmt: skip
    print(summary.line())
    print(f"sweep: records, sweep.csv, sweep.md and img/ in {args.out_dir}")
    return 0

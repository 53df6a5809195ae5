#!/usr/bin/env python
"""A batch of short samples against one long sample, same tokens per optimizer step, through the real
trainer (`specforge train --csbp`, dflash-csbp, cp_size 1; benchmarks/trainer_bench.py runs each one):

    long    batch 1 x L tokens,            A anchors                 (--context L, --anchors A)
    short   batch B x L / B tokens,        A / B anchors each        (--batch-size B)
            same tokens, anchors per token and supervised tokens per step; only the sample length differs

    python3 benchmarks/batch_bench.py --draft-config drafter_configs/qwen3.6-27b-dflash2.json --no-dflash2 \\
        --context 64K --batch-size 16 --anchors 2048 --work /tmp/batch --out $OUT/batch.jsonl

Records: trainer_bench's (page cache warm), mode "csbp": workload "trainer-<config>-warm-cache" (long) and
"trainer-<config>-batch<B>-warm-cache" (short, field batch_size). Printed: each run's step, data wait and
compute per optimizer step, and `short_over_long` (step time ratio; 1.0 = a short batch runs as fast per token as a long sample) with
`per_sample_overhead_ms` ((short compute - long compute) / (B - 1): what each extra sample costs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainer_bench


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft-config", required=True, help="drafter config.json (drafter_configs/)")
    p.add_argument("--no-dflash2", action="store_true", help="train the config as DFlash v1")
    p.add_argument("--context", default="64K", help="tokens of the long sample (= tokens per optimizer step)")
    p.add_argument(
        "--batch-size", type=int, default=16, help="short samples per step (each context / B tokens)"
    )
    p.add_argument("--anchors", type=int, default=2048, help="anchors of the long sample (a short one: / B)")
    p.add_argument(
        "--batches", type=int, default=4, help="optimizer steps per epoch (long: this many samples)"
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--work", required=True, help="scratch directory (one sub-directory per run)")
    p.add_argument("--out", required=True, help="records file (JSON lines)")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--timeout", type=int, default=540, help="seconds per trainer run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from specforge_csbp.bench.grid import parse_size

    length = parse_size(args.context)
    if args.batch_size < 2:
        p.error(f"--batch-size must be >= 2 (the short batch); got {args.batch_size}")
    if length % args.batch_size or args.anchors % args.batch_size:
        p.error(
            f"--context {length} and --anchors {args.anchors} must both divide by --batch-size {args.batch_size}"
        )
    return args


def runs(args) -> dict[str, list[str]]:
    """trainer_bench arguments of the two runs (csbp only: the comparison is the plugin's own)."""
    from specforge_csbp.bench.grid import parse_size

    length, b = parse_size(args.context), args.batch_size
    # page cache warm: the comparison is the plugin's compute per token, not the disk (a cold first pass of
    # either run is bound by reading its samples: docs/performance.md, "The first pass")
    common = ["--draft-config", args.draft_config, "--modes", "csbp", "--cache", "warm", "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps), "--out", args.out,
              "--timeout", str(args.timeout), "--seed", str(args.seed)]  # fmt: skip
    common += ["--no-dflash2"] if args.no_dflash2 else []
    common += ["--trace-dir", args.trace_dir] if args.trace_dir else []
    return {
        "long": common + ["--context", str(length), "--batch-size", "1", "--samples", str(args.batches),
                          "--anchors", str(args.anchors), "--work", os.path.join(args.work, "long")],
        "short": common + ["--context", str(length // b), "--batch-size", str(b),
                           "--samples", str(args.batches * b), "--anchors", str(args.anchors // b),
                           "--work", os.path.join(args.work, "short")],
    }  # fmt: skip


def compare(long: dict, short: dict, batch_size: int) -> dict:
    """The printed comparison of two trainer_bench records."""
    keys = ("step_ms", "data_wait_ms", "train_compute_ms")
    out = {"long": {k: long.get(k) for k in keys}, "short": {k: short.get(k) for k in keys}}
    if long.get("step_ms") and short.get("step_ms"):
        out["short_over_long"] = round(short["step_ms"] / long["step_ms"], 3)
        out["per_sample_overhead_ms"] = round(
            (short["train_compute_ms"] - long["train_compute_ms"]) / (batch_size - 1), 2
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    before = 0
    if os.path.exists(args.out):
        with open(args.out) as f:
            before = sum(1 for line in f if line.strip())
    rcs = [trainer_bench.main(argv_) for argv_ in runs(args).values()]
    with open(args.out) as f:
        new = [json.loads(line) for line in f if line.strip()][before:]
    by_batch = {r.get("batch_size", 1): r for r in new}
    result = compare(by_batch.get(1, {}), by_batch.get(args.batch_size, {}), args.batch_size)
    print(
        f"batch_bench {args.context} 1 x {args.context} vs {args.batch_size} x short: {json.dumps(result)}",
        flush=True,
    )
    return 1 if any(rcs) else 0


if __name__ == "__main__":
    sys.exit(main())

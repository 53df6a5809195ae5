#!/usr/bin/env python
"""Profile the user's command itself: `specforge-csbp <train|train-bdlm> ...` in this process (one rank) under
torch.profiler, one profiled window of optimizer steps after a warm-up.

    python3 benchmarks/profile_train.py --out $OUT/prof --wait 3 --active 2 -- \\
        train --csbp -c examples/long_context/qwen3.6-27b-dflash2-256k.yaml deployment.trainer.nproc_per_node=1 ...

Steps are counted by a global optimizer step hook, so whatever optimizer the trainer builds is seen. Writes
`<out>/ops_cuda.txt` and `<out>/ops_cpu.txt` (key averages by device and host time), `<out>/steps.json`
(the wall time between consecutive optimizer steps, all of them) and, with `--trace`, a Chrome trace of the
active window. Only for one-rank runs: a multi-rank launch re-spawns workers this process does not profile.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import sys
import time
import traceback
import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: profile_train.py [options] -- <specforge-csbp subcommand and its arguments>")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the tables, step times and trace")
    p.add_argument("--wait", type=int, default=3, help="optimizer steps before the profiled window")
    p.add_argument("--active", type=int, default=2, help="optimizer steps profiled")
    p.add_argument("--trace", action="store_true", help="also write a gzipped Chrome trace of the window")
    p.add_argument("--syncs", action="store_true",
                   help="during the window, count the host syncs by Python stack (torch.cuda sync debug mode)")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    os.makedirs(args.out, exist_ok=True)

    stamps: list[float] = []
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def on_ready(prof: torch.profiler.profile) -> None:
        avg = prof.key_averages()
        device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        with open(os.path.join(args.out, "ops_cuda.txt"), "w") as f:
            f.write(avg.table(sort_by=device_key, row_limit=60))
        with open(os.path.join(args.out, "ops_cpu.txt"), "w") as f:
            f.write(avg.table(sort_by="self_cpu_time_total", row_limit=60))
        if args.trace:
            path = os.path.join(args.out, "trace.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(path)

    prof = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=args.wait, warmup=1, active=args.active, repeat=1),
        on_trace_ready=on_ready,
        record_shapes=False,
        with_stack=False,
    )

    syncs: collections.Counter = collections.Counter()
    window = range(args.wait + 1, args.wait + 1 + args.active)  # optimizer steps whose syncs are counted

    def record_sync(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-2] if "warnings.py" not in f.filename]
        syncs[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[::-1][:8])] += 1

    shown = warnings.showwarning

    def on_step(optimizer, *_):
        if torch.cuda.is_available():
            if args.syncs:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            if args.syncs and len(stamps) + 1 in window:
                torch.cuda.set_sync_debug_mode(1)  # warn on every synchronizing call until the next step
        stamps.append(time.perf_counter())
        prof.step()

    if args.syncs:
        warnings.simplefilter("always")
        warnings.showwarning = record_sync

    register_optimizer_step_post_hook(on_step)
    from specforge_csbp.cli.main import main as cli_main

    prof.start()
    try:
        rc = cli_main(command)
    finally:
        prof.stop()
        steps = [round(b - a, 4) for a, b in zip(stamps, stamps[1:])]
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        with open(os.path.join(args.out, "steps.json"), "w") as f:
            json.dump({"command": command, "step_s": steps, "peak_mem_gib": peak}, f, indent=1)
        if args.syncs:
            with open(os.path.join(args.out, "syncs.txt"), "w") as f:
                f.write(f"host syncs in {args.active} optimizer steps, by stack (innermost first)\n")
                for stack, n in syncs.most_common():
                    f.write(f"{n:6d}  {stack}\n")
        print(f"profile_train: step times {steps} s, peak {peak} GiB -> {args.out}")
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())

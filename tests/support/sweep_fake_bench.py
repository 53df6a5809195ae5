"""A tiny stand-in benchmark for the sweep tests (follows the contract of specforge_csbp/bench/grid.py).

Throughput and memory are simple functions of the point; behaviour flags make a point fail on purpose:
--oom-above N   (bp only) print a CUDA out-of-memory message and exit 1 when context > N
--fail-mode M   exit 3 with a RuntimeError for mode M
--calls FILE    append one line per invocation (to count what a resumed sweep re-runs)
"""

import argparse
import json
import sys

p = argparse.ArgumentParser()
p.add_argument("--mode", required=True)
p.add_argument("--world-size", type=int, required=True)
p.add_argument("--context-len", type=int, required=True)
p.add_argument("--block-size", type=int, required=True)
p.add_argument("--out", required=True)
p.add_argument("--oom-above", type=int, default=None)
p.add_argument("--fail-mode", default=None)
p.add_argument("--calls", default=None)
a = p.parse_args()
if a.calls:
    with open(a.calls, "a") as f:
        f.write(f"{a.mode} {a.context_len}\n")
if a.mode == "bp" and a.oom_above is not None and a.context_len > a.oom_above:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
    sys.exit(1)
if a.mode == a.fail_mode:
    print("Traceback (most recent call last):\nRuntimeError: deliberate failure", file=sys.stderr)
    sys.exit(3)
speed = {"dp": 1.0, "cp": 1.2, "bp": 1.4, "csbp": 2.0}[a.mode]
tps = 1e6 * speed * a.world_size / a.context_len
rec = dict(workload="attention", mode=a.mode, world_size=a.world_size, context_len=a.context_len,
           block_size=a.block_size, step_ms=1e3 * a.context_len / tps, tokens_per_s=tps,
           peak_mem_gib=a.context_len / 1024 / speed, status="ok", device="fake", date="fake", command="fake")
with open(a.out, "w") as f:
    json.dump([rec], f)

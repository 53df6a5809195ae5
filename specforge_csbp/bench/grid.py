"""The sweep grid: points (workload x mode x world size x context x block size) and their command lines.

A workload is a command template. Every benchmark script follows one contract, so the runner needs to know
nothing else about it:

    <launch> <script> --mode M --world-size P --context-len L --block-size S --out FILE [args]

    - it measures one point and writes BenchRecord JSON (a list, one object or JSON lines) to FILE;
    - under torchrun it takes the world size from the launch (--world-size then only has to agree);
    - a failure exits non-zero; an out-of-memory failure prints the usual CUDA message or exits non-zero
      after writing a record with status "oom".

benchmarks/attention_bench.py (issue 2) takes `--modes M --contexts L` instead (ATTENTION_TEMPLATE).

Placeholders of a template: {launch} {python} {script} {workload} {mode} {world_size} {context_len}
{block_size} {out} {args}. `{launch}` is `{python} -m torch.distributed.run --standalone --nproc-per-node P`
(launcher "torchrun") or `{python}` (launcher "python": the script starts its own ranks, e.g. gloo on CPU).
"""

from __future__ import annotations

import hashlib
import itertools
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ..values import parse_size, parse_sizes  # the one size parser (re-exported: the benchmarks import it here)

__all__ = [
    "DEFAULT_TEMPLATE",
    "LAUNCHERS",
    "SWEEP_MODES",
    "WORKLOADS",
    "SweepPoint",
    "build_grid",
    "parse_size",
    "parse_sizes",
    "point_command",
]

SWEEP_MODES = ("dp", "cp", "bp", "csbp")  # the default grid
POINT_MODES = ("reference", "dp", "cp", "bp", "csbp", "torch-cp", "specforge")  # any record mode
LAUNCHERS = ("torchrun", "python")
DEFAULT_TEMPLATE = (
    "{launch} {script} --mode {mode} --world-size {world_size} --context-len {context_len} "
    "--block-size {block_size} --out {out} {args}"
)
# benchmarks/attention_bench.py (issue 2) measures lists of modes and contexts in one launch; one point
# is a list of one. The world size is the torchrun launch's.
ATTENTION_TEMPLATE = (
    "{launch} {script} --modes {mode} --contexts {context_len} --block-size {block_size} --out {out} {args}"
)
# workload -> (benchmark script, fixed arguments, template); scripts are relative to the repository root.
WORKLOADS: dict[str, tuple[str, str, str]] = {
    "attention": ("benchmarks/attention_bench.py", "", ATTENTION_TEMPLATE),
    "drafter": ("benchmarks/drafter_bench.py", "", DEFAULT_TEMPLATE),
    # bdlm_bench.py takes the same list flags as attention_bench.py (one value each per point)
    "sft": ("benchmarks/bdlm_bench.py", "--objective sft", ATTENTION_TEMPLATE),
    "convert": ("benchmarks/bdlm_bench.py", "--objective convert", ATTENTION_TEMPLATE),
}
@dataclass(frozen=True, order=True)
class SweepPoint:
    workload: str
    block_size: int
    world_size: int
    context_len: int
    mode: str
    args: str = ""

    @property
    def key(self) -> str:
        """Identity used for resuming (stored in each record as `point`)."""
        base = f"{self.workload}/{self.mode}/P{self.world_size}/L{self.context_len}/S{self.block_size}"
        return base + (f"/{self.args}" if self.args else "")

    @property
    def slug(self) -> str:
        """Short file-name form (extra args become a hash: they can be long and hold paths)."""
        base = f"{self.workload}_{self.mode}_P{self.world_size}_L{self.context_len}_S{self.block_size}"
        if self.args:
            base += "_" + hashlib.sha1(self.args.encode()).hexdigest()[:8]
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", base)


def build_grid(
    workloads: Sequence[str],
    contexts: Sequence[int],
    modes: Sequence[str],
    world_sizes: Sequence[int],
    block_sizes: Sequence[int],
    args: str = "",
) -> tuple[list[SweepPoint], list[tuple[SweepPoint, str]]]:
    """All points in run order (small contexts first, so a mode's OOM boundary is found from below) and the
    points that no mode can run, each with the reason (B = L/S blocks < P, L not a multiple of S)."""
    for name, values, allowed in (("mode", modes, POINT_MODES),):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"{name} must be among {', '.join(allowed)}; got {', '.join(bad)}")
    for name, values in (("world_size", world_sizes), ("block_size", block_sizes), ("context", contexts)):
        if not values or any(v < 1 for v in values):
            raise ValueError(f"{name} needs one or more positive values; got {list(values)}")
    if not workloads:
        raise ValueError("workload needs one or more names")
    points, invalid = [], []
    for w, s, p, L, m in itertools.product(workloads, block_sizes, world_sizes, contexts, modes):
        point = SweepPoint(w, s, p, L, m, args)
        if L % s:
            invalid.append((point, f"context {L} is not a multiple of block size {s}"))
        elif m not in ("dp", "reference", "specforge") and L // s < p:
            invalid.append((point, f"{L // s} blocks < world size {p}"))
        else:
            points.append(point)
    order = {m: i for i, m in enumerate(POINT_MODES)}
    points.sort(key=lambda q: (q.workload, q.block_size, q.world_size, q.context_len, order[q.mode]))
    return points, invalid


def point_command(
    point: SweepPoint,
    out: str,
    *,
    template: str | None = None,
    script: str | None = None,
    launcher: str = "torchrun",
    python: str = sys.executable,
) -> list[str]:
    """The argv of one point (the template is formatted, then split like a shell would). Without a
    template: the built-in workload's own (WORKLOADS), else (another workload or a given script)
    DEFAULT_TEMPLATE."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    known = WORKLOADS.get(point.workload)
    if script is None and known is None:
        raise ValueError(
            f"workload must be one of {', '.join(WORKLOADS)} (or give --script/--template); got {point.workload!r}"
        )
    builtin = known is not None and script is None  # a given script follows the default contract
    fixed = known[1] if builtin else ""
    template = template or (known[2] if builtin else DEFAULT_TEMPLATE)
    script = script or known[0]
    q = shlex.quote
    launch = q(python)
    if launcher == "torchrun":
        launch += f" -m torch.distributed.run --standalone --nproc-per-node {point.world_size}"
    fields = dict(
        launch=launch, python=q(python), script=q(script), workload=q(point.workload), mode=point.mode,
        world_size=point.world_size, context_len=point.context_len, block_size=point.block_size, out=q(out),
        args=" ".join(a for a in (fixed, point.args) if a),
    )  # fmt: skip
    try:
        return shlex.split(template.format(**fields))
    except KeyError as err:
        raise ValueError(f"template has unknown placeholder {err}; allowed: {', '.join(sorted(fields))}") from None

"""Named GPU benchmark scenarios: benchmarks/scenarios.toml read, turned into command lines, and run.

A scenario is what a user asks to rerun by name ("the 512K comparison"): one or more launches of a
benchmark script, each with its own time limit, so one slow launch cannot take the others' time.

    [drafter-27b]                      a scenario: defaults for its runs
    bench = "drafter"                  drafter | attention | bdlm | sweep | command
    gpus = 2                           1: one GPU (CUDA_VISIBLE_DEVICES=0, python); >1: torchrun
    shape = "a"   anchors = 512   modes = ["cp", "csbp", "dp"]   args = ["--no-components"]
    runs = [ { contexts = ["512K"], limit_s = 130 }, ... ]      a run overrides any default

    run_scenario.py drafter-27b --contexts 512K --dry-run
      -> torchrun --nproc-per-node=2 benchmarks/drafter_bench.py --shape a --modes cp,csbp,dp \
           --contexts 512K --anchors 512 --out $OUT/drafter.jsonl

Records go where the benchmark puts them (`--out` under the output directory, default `$OUT` as
benchmarks/gpu_env.sh sets it, else benchmarks/results); `{out}` in `args` or `command` is that directory.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from ..preflight import check_writable_dir
from .grid import parse_size, parse_sizes
from .processes import run_group

__all__ = [
    "BENCHES", "Run", "Scenario", "build_command", "check_selection", "load_scenarios", "main", "rerun_command", "run_scenarios",
]  # fmt: skip

DEFAULT_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios.toml"
# bench -> (script, records file under the output directory)
BENCHES = {
    "drafter": ("benchmarks/drafter_bench.py", "drafter.jsonl"),
    "attention": ("benchmarks/attention_bench.py", "attention.jsonl"),
    "bdlm": ("benchmarks/bdlm_bench.py", "bdlm_sft.jsonl"),
    "sweep": ("", "sweep_{workload}.jsonl"),  # python -m specforge_csbp sweep; its records copied here
    "command": ("", ""),
}
RUN_FIELDS = {
    "bench": str, "gpus": int, "contexts": list, "modes": list, "shape": str, "anchors": int,
    "block_size": int, "workload": str, "args": list, "command": str, "limit_s": int, "point_timeout_s": int,
    "reproduces": (str, list),
}  # fmt: skip
# reproduces: the record workload(s) (drafter-qwen3.6-27b, sft, ...) whose headline rows a run remeasures; set on
# the scenario it holds for each of its runs, set on a run it holds for that run
SCENARIO_FIELDS = {"description": str, "runs": list, **RUN_FIELDS}


@dataclass(frozen=True)
class Run:
    """One launch: a benchmark script (or a literal `command`) with its own time limit."""

    bench: str
    gpus: int = 1
    contexts: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    shape: str | None = None
    anchors: int | None = None
    block_size: int | None = None
    workload: str | None = None  # sweep: the sweep's workload (drafter, sft, ...)
    args: tuple[str, ...] = ()
    command: str | None = None  # bench = "command": run through bash as written
    limit_s: int = 600  # the launch is stopped (its whole process group) after this many seconds
    point_timeout_s: int = 300  # sweep: each point's own limit
    reproduces: tuple[str, ...] = ()  # the record workloads whose points this run remeasures


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    runs: tuple[Run, ...] = field(default_factory=tuple)


def rerun_command(scenarios: dict[str, Scenario], workload: str, world_size: int, context_len: int,
                  anchors: int | None = None) -> str | None:  # fmt: skip
    """`NAME --contexts L` of the first scenario that remeasures CSBP at this point, None when none does."""
    for sc in scenarios.values():
        for run in sc.runs:
            if (workload in run.reproduces and run.gpus == world_size and "csbp" in run.modes
                    and (run.anchors is None or run.anchors == anchors)
                    and any(parse_size(c) == context_len for c in run.contexts)):  # fmt: skip
                return f"{sc.name} --contexts {next(c for c in run.contexts if parse_size(c) == context_len)}"
    return None


def _check(where: str, table: dict, allowed: dict[str, type]) -> None:
    for key, value in table.items():
        if key not in allowed:
            raise ValueError(f"{where}: unknown field {key!r}; allowed: {', '.join(sorted(allowed))}")
        if not isinstance(value, allowed[key]) or isinstance(value, bool):
            kinds = {int: "an integer", str: "a string", list: "a list"}
            kind = " or ".join(kinds[t] for t in allowed[key]) if isinstance(allowed[key], tuple) else kinds[allowed[key]]
            raise ValueError(f"{where}.{key}: must be {kind}; got {value!r}")


def _run(where: str, table: dict) -> Run:
    bench = table.get("bench")
    if bench not in BENCHES:
        raise ValueError(f"{where}.bench: must be one of {', '.join(BENCHES)}; got {bench!r}")
    if (bench == "command") != ("command" in table):
        raise ValueError(f"{where}.command: required with bench = 'command' and only there")
    if table.get("gpus", 1) < 1 or table.get("limit_s", 1) < 1:
        raise ValueError(f"{where}: gpus and limit_s must be >= 1")
    for ctx in table.get("contexts", []):
        parse_size(str(ctx), field=f"{where}.contexts")
    if bench not in ("command",) and not table.get("contexts"):
        raise ValueError(f"{where}.contexts: at least one context (64K, 1M, ...) for bench = {bench!r}")
    if bench == "sweep" and not table.get("workload"):
        raise ValueError(f"{where}.workload: required for bench = 'sweep' (drafter, sft, ...)")
    data = {k: tuple(str(x) for x in v) if isinstance(v, list) else v for k, v in table.items()}
    if isinstance(data.get("reproduces"), str):
        data["reproduces"] = (data["reproduces"],)
    return Run(**data)


def load_scenarios(path: str | Path = DEFAULT_FILE) -> dict[str, Scenario]:
    """Every scenario of the file, validated (one-line errors naming the scenario, run and field)."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    out = {}
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: {name!r} must be a table [{name}]")
        _check(name, table, SCENARIO_FIELDS)
        if not table.get("runs"):
            raise ValueError(f"{name}.runs: at least one run")
        defaults = {k: v for k, v in table.items() if k not in ("description", "runs")}
        runs = []
        for i, run in enumerate(table["runs"]):
            where = f"{name}.runs[{i}]"
            if not isinstance(run, dict):
                raise ValueError(f"{where}: must be a table {{ contexts = [...], ... }}")
            _check(where, run, RUN_FIELDS)
            runs.append(_run(where, {**defaults, **run}))
        out[name] = Scenario(name, str(table.get("description", "")), tuple(runs))
    return out


def build_command(
    run: Run, out_dir: str, *, python: str = "python3", torchrun: str = "torchrun"
) -> list[str]:
    """The argv of one run (bench = "command": bash -c with the command as written)."""
    sub = {"out": out_dir}
    args = [a.format(**sub) for a in run.args]
    if run.bench == "command":
        return ["bash", "-c", run.command.format(**sub)]
    if run.bench == "sweep":
        sweep_dir = f"/tmp/sweep-{run.workload}"
        cmd = [python, "-m", "specforge_csbp", "sweep", "--workload", run.workload,
               "--contexts", ",".join(run.contexts), "--modes", ",".join(run.modes),
               "--world-sizes", str(run.gpus), "--timeout", str(run.point_timeout_s),
               "--out-dir", sweep_dir, "--no-progress"]  # fmt: skip
        if run.block_size is not None:
            cmd += ["--block-sizes", str(run.block_size)]
        if args:
            cmd += ["--args", shlex.join(args)]
        return cmd
    script, records = BENCHES[run.bench]
    if run.gpus == 1:
        launch = ["env", "CUDA_VISIBLE_DEVICES=0", python, script]
    else:
        standalone = ["--standalone"] if run.bench == "bdlm" else []
        launch = [torchrun, *standalone, f"--nproc-per-node={run.gpus}", script]
    cmd = list(launch)
    if run.shape is not None:
        cmd += ["--shape", run.shape]
    if run.bench == "bdlm":  # argparse nargs="+": space separated, contexts in tokens
        cmd += ["--modes", *run.modes] if run.modes else []
        cmd += ["--contexts", *map(str, parse_sizes(list(run.contexts)))]
    else:
        cmd += ["--modes", ",".join(run.modes)] if run.modes else []
        contexts = list(run.contexts) if run.bench == "drafter" else map(str, parse_sizes(list(run.contexts)))
        cmd += ["--contexts", ",".join(contexts)]
    if run.anchors is not None:
        cmd += ["--anchors", str(run.anchors)]
    if run.block_size is not None:
        cmd += ["--block-size", str(run.block_size)]
    return cmd + args + ["--out", f"{out_dir}/{records}"]


def _selected(run: Run, contexts: set[int] | None) -> bool:
    return contexts is None or any(parse_size(c) in contexts for c in run.contexts)


def check_selection(scenarios: list[Scenario], contexts: set[int] | None) -> None:
    """Every scenario asked for must have a run at the contexts asked for: running nothing is not a result."""
    if contexts is None:
        return
    for sc in scenarios:
        if not any(_selected(r, contexts) for r in sc.runs):
            have = sorted({c for r in sc.runs for c in r.contexts}, key=parse_size)
            raise ValueError(
                f"--contexts: scenario {sc.name} has no run at {', '.join(map(str, sorted(contexts)))} tokens; "
                f"its runs are at {', '.join(have) or 'no listed context'} (leave --contexts out to run them all)"
            )


def _execute(argv: list[str], limit_s: int) -> tuple[int, bool]:
    """Run in a process group of its own; stop the whole group at the limit (like `timeout -k 15`).
    Returns (exit code, whether the limit stopped it)."""
    rc, stopped = run_group(argv, limit_s, grace_s=15)
    return (124, True) if stopped else (rc, False)


def run_scenarios(
    scenarios: list[Scenario], out_dir: str, *, dry_run: bool = False, contexts: set[int] | None = None,
    python: str = "python3", torchrun: str = "torchrun", echo=print,
) -> int:  # fmt: skip
    """Run (or with `dry_run` only print) every selected run in order; a failed or timed-out run does not
    stop the next one. Returns 0 when every run exited 0, else the number of runs that did not."""
    failed = 0
    for sc in scenarios:
        runs = [r for r in sc.runs if _selected(r, contexts)]
        if not runs:
            echo(f"# {sc.name}: no run at the contexts asked for")
        for run in runs:
            argv = build_command(run, out_dir, python=python, torchrun=torchrun)
            echo(f"# {sc.name} [limit {run.limit_s}s]")
            echo(shlex.join(argv))
            copy = run.bench == "sweep"
            target = f"{out_dir}/{BENCHES['sweep'][1].format(workload=run.workload)}"
            if copy:
                echo(shlex.join(["cp", f"/tmp/sweep-{run.workload}/records.jsonl", target]))
            if dry_run:
                continue
            if run.bench == "command":
                Path(out_dir).mkdir(parents=True, exist_ok=True)
            rc, stopped = _execute(argv, run.limit_s)
            if copy and Path(f"/tmp/sweep-{run.workload}/records.jsonl").exists():
                # what the sweep recorded, even when its limit cut it short
                shutil.copyfile(f"/tmp/sweep-{run.workload}/records.jsonl", target)
            if rc != 0:
                failed += 1
                why = f" (stopped at its {run.limit_s} s limit)" if stopped else ""
                echo(f"# {sc.name}: exit {rc}{why}")
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="run_scenario.py", description="Run named GPU benchmark scenarios.")
    p.add_argument("names", nargs="*", help="scenario names (see --list)")
    p.add_argument("--list", action="store_true", help="print every scenario's name and description")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--contexts", default=None, help="only the runs at these contexts (64K,512K, ...)")
    p.add_argument("--file", default=str(DEFAULT_FILE), help="scenarios file (TOML)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"),
                   help="where records go (default: $OUT, else benchmarks/results)")
    p.add_argument("--python", default="python3")
    p.add_argument("--torchrun", default="torchrun")
    args = p.parse_args(argv)
    try:
        scenarios = load_scenarios(args.file)
        if args.list or not args.names:
            for sc in scenarios.values():
                print(f"{sc.name}: {sc.description} ({len(sc.runs)} run(s), "
                      f"limit {sum(r.limit_s for r in sc.runs)} s)")  # fmt: skip
            return 0
        unknown = [n for n in args.names if n not in scenarios]
        if unknown:
            raise ValueError(f"scenario: unknown {', '.join(unknown)}; allowed: {', '.join(scenarios)}")
        contexts = set(parse_sizes(args.contexts, field="--contexts")) if args.contexts else None
        check_selection([scenarios[n] for n in args.names], contexts)
        if not args.dry_run:
            check_writable_dir(args.out, "--out")  # before the first run, not after its records are due
    except (ValueError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = run_scenarios([scenarios[n] for n in args.names], args.out, dry_run=args.dry_run,
                           contexts=contexts, python=args.python, torchrun=args.torchrun)  # fmt: skip
    return 1 if failed else 0

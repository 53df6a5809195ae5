"""Run a sweep: every point in a fresh process, failures recorded (never fatal), resumable.

    for point in grid (tqdm):
        recorded already (records.jsonl has its `point` key)?  -> skip   (resume)
        run `command` in a new process session, output -> logs/<point>.log, records -> a temp file
            exit 0 + records            -> the benchmark's records
            'out of memory' text / oom  -> one record, status "oom"
            other non-zero exit/timeout -> one record, status "error" (with the last log line)
        append to records.jsonl (atomic per point)
    regenerate sweep.csv, sweep.md and img/*.png from records.jsonl

One sweep is one session on one machine: every record gets the sweep's `device` and `date` (so its points
are compared side by side in the report) and the exact `command` that reproduces it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from .grid import SweepPoint
from ..progress import progress_bar
from .processes import run_group
from .provenance import library_digest
from .records import BenchRecord, load_records, write_records
from .report import render_markdown, write_csv

__all__ = ["OOM_PATTERN", "SweepSummary", "classify_failure", "detect_device", "run_point", "run_sweep", "today", "write_outputs"]

OOM_PATTERN = re.compile(
    r"out of (?:device )?memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|"
    r"std::bad_alloc|\bMemoryError\b|Cannot allocate memory",
    re.IGNORECASE,
)
ROOT = Path(__file__).resolve().parents[2]


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).date().isoformat()


def detect_device() -> str:
    """GPU name from nvidia-smi (no CUDA context in this process), else the CPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
        if out.returncode == 0 and names:
            return names[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return f"cpu ({platform.machine() or 'unknown'})"


def classify_failure(returncode: int, log: str, timed_out: bool) -> tuple[str, str]:
    """(status, reason) of a failed point: "oom" when the output or the exit says out of memory."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    if timed_out:
        return "error", "timeout"
    oom_lines = [ln for ln in lines if OOM_PATTERN.search(ln)]
    if oom_lines:
        return "oom", oom_lines[-1][:200]
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):  # the kernel's OOM killer sends SIGKILL
        return "oom", f"killed by SIGKILL (exit {returncode}): host out of memory?"
    return "error", (lines[-1][:200] if lines else f"exit {returncode}, no output")


def _run(cmd: list[str], log_path: Path, timeout_s: float | None, env: dict[str, str]) -> tuple[int, bool]:
    """Run in its own process group so a timeout kills the whole tree (torchrun and its ranks) at once."""
    with open(log_path, "w") as log:
        return run_group(cmd, timeout_s, stdout=log, env=env, cwd=os.getcwd())


def _read_records(path: Path) -> list[BenchRecord]:
    """A benchmark's output: a JSON list, one JSON object, or JSON lines (whatever the file is called)."""
    text = path.read_text()
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [BenchRecord.model_validate(item) for item in items]


def _one_line(err: Exception) -> str:
    if isinstance(err, ValidationError):
        e = err.errors()[0]
        return f"field {'.'.join(map(str, e['loc'])) or '?'}: {e['msg']}"[:160]
    return (str(err).splitlines() or [type(err).__name__])[0][:160]


def run_point(
    point: SweepPoint,
    command: Callable[[str], list[str]],
    *,
    log_path: Path,
    device: str,
    date: str,
    timeout_s: float | None = None,
) -> list[BenchRecord]:
    """Records of one point (its own, or one oom/error record); never raises for a failing benchmark."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sweep-point-") as tmp:
        out = Path(tmp) / "records.jsonl"
        cmd = command(str(out))
        start = time.monotonic()
        try:
            rc, timed_out = _run(cmd, log_path, timeout_s, env)
        except OSError as err:  # the command itself cannot start (missing script interpreter, ...)
            log_path.write_text(f"{err}\n")
            rc, timed_out = 127, False
        wall = time.monotonic() - start
        records: list[BenchRecord] = []
        bad = ""
        if out.exists() and out.stat().st_size:
            try:
                records = _read_records(out)
            except (ValueError, OSError) as err:
                bad = f"unreadable records: {_one_line(err)}"
    log = log_path.read_text(errors="replace")
    # The recorded command names a stable output file (not the temp one), so it can be re-run by hand.
    common = {"command": shlex.join(command(f"{point.slug}.jsonl")), "device": device, "date": date,
              "code": library_digest()}
    if rc == 0 and records and not bad:
        return [r.model_copy(update={**common, "point": point.key, "wall_s": round(wall, 2)}) for r in records]
    if bad:
        status, reason = "error", bad
    elif rc == 0:
        status, reason = "error", "exit 0 but no records written"
    elif any(r.status == "oom" for r in records):
        status, reason = "oom", "benchmark reported oom"
    else:
        status, reason = classify_failure(rc, log, timed_out)
    if timed_out:
        reason = f"timeout after {timeout_s:g} s"
    return [
        BenchRecord(
            workload=point.workload, mode=point.mode, world_size=point.world_size, context_len=point.context_len,
            block_size=point.block_size, status=status, error=reason, exit_code=rc, point=point.key,
            wall_s=round(wall, 2), **common,
        )  # fmt: skip
    ]


@dataclass
class SweepSummary:
    ran: Counter = field(default_factory=Counter)  # status -> points run now
    resumed: int = 0  # points skipped because already recorded
    not_run_oom: int = 0  # points skipped after an OOM at a smaller context (skip_after_oom)
    records_path: Path | None = None

    def line(self) -> str:
        ran = ", ".join(f"{n} {s}" for s, n in sorted(self.ran.items())) or "none"
        return f"sweep: ran {sum(self.ran.values())} points ({ran}); {self.resumed} already recorded" + (
            f"; {self.not_run_oom} not run (OOM at a smaller context)" if self.not_run_oom else ""
        )


def _family(p: SweepPoint) -> tuple:
    return (p.workload, p.mode, p.world_size, p.block_size, p.args)


def run_sweep(
    points: Sequence[SweepPoint],
    command_for: Callable[[SweepPoint, str], list[str]],
    out_dir: str | Path,
    *,
    device: str | None = None,
    date: str | None = None,
    timeout_s: float | None = None,
    retry_failed: bool = False,
    skip_after_oom: bool = False,
    progress: bool = True,
    title: str = "Sweep",
) -> SweepSummary:
    """Run the points not yet in `<out_dir>/records.jsonl`, then write sweep.csv, sweep.md and img/."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records_path = out_dir / "records.jsonl"
    device = device or detect_device()
    date = date or today()
    existing = load_records(records_path) if records_path.exists() else []
    if retry_failed and any(r.status == "error" for r in existing):
        existing = [r for r in existing if r.status != "error"]
        write_records(records_path, existing, append=False)
    done = {(r.model_extra or {}).get("point") for r in existing}
    oom_at: dict[tuple, int] = {}
    by_key = {p.key: p for p in points}
    for r in existing:
        p = by_key.get((r.model_extra or {}).get("point"))
        if p is not None and r.status == "oom":
            oom_at[_family(p)] = min(oom_at.get(_family(p), p.context_len), p.context_len)

    summary = SweepSummary(records_path=records_path)
    bar = progress_bar(points, desc="sweep", unit="pt", disable=not progress, dynamic_ncols=True)
    for point in bar:
        if point.key in done:
            summary.resumed += 1
            continue
        smallest_oom = oom_at.get(_family(point))
        if skip_after_oom and smallest_oom is not None and smallest_oom < point.context_len:
            recs = [
                BenchRecord(
                    workload=point.workload, mode=point.mode, world_size=point.world_size,
                    context_len=point.context_len, block_size=point.block_size, status="oom", device=device,
                    date=date, command="(not run)", point=point.key, error=f"not run: oom at context {smallest_oom}",
                )  # fmt: skip
            ]
            summary.not_run_oom += 1
        else:
            bar.set_postfix_str(point.key)
            recs = run_point(point, lambda out, p=point: command_for(p, out), log_path=out_dir / "logs" /
                             f"{point.slug}.log", device=device, date=date, timeout_s=timeout_s)  # fmt: skip
            status = "oom" if any(r.status == "oom" for r in recs) else recs[0].status
            summary.ran[status] += 1
            if status == "oom":
                oom_at[_family(point)] = min(oom_at.get(_family(point), point.context_len), point.context_len)
        write_records(records_path, recs)  # one atomic append per point: a crash loses at most this point
        done.add(point.key)
    bar.close()
    write_outputs(out_dir, title=title)
    return summary


def write_outputs(out_dir: str | Path, *, title: str = "Sweep") -> list[BenchRecord]:
    """sweep.csv, sweep.md and img/*.png from `<out_dir>/records.jsonl` (regenerable at any time)."""
    out_dir = Path(out_dir)
    path = out_dir / "records.jsonl"
    records = load_records(path) if path.exists() else []
    write_csv(records, out_dir / "sweep.csv")
    text = render_markdown(records, doc_path=out_dir / "sweep.md", img_dir=out_dir / "img", title=title,
                           source=f"{path.name}", generator="specforge-csbp sweep")  # fmt: skip
    (out_dir / "sweep.md").write_text(text)
    return records

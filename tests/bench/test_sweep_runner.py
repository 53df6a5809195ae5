"""`specforge-csbp sweep`: failing points are recorded without stopping, resume skips recorded points, and
CSV / markdown / plots are regenerated from the records (a fake benchmark script, no torch import)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from specforge_csbp.bench.grid import build_grid, parse_sizes, point_command
from specforge_csbp.bench.records import load_records
from specforge_csbp.bench.runner import classify_failure
from specforge_csbp.cli.main import main

FAKE = str(Path(__file__).resolve().parents[1] / "support" / "sweep_fake_bench.py")


def _sweep(out_dir: Path, calls: Path, *extra: str) -> int:
    return main([
        "sweep", "--workload", "attention", "--contexts", "1K,2K,4K", "--modes", "cp,bp,csbp",
        "--world-sizes", "2", "--block-sizes", "16", "--out-dir", str(out_dir), "--script", FAKE,
        "--launcher", "python", "--args", f"--oom-above 1024 --fail-mode cp --calls {calls}",
        "--device", "cpu-test", "--date", "2025-11-30", "--no-progress", "--timeout", "60", *extra,
    ])  # fmt: skip


def test_sweep_records_failures_resumes_and_writes_outputs(tmp_path):
    out, calls = tmp_path / "sweep", tmp_path / "calls.txt"
    assert _sweep(out, calls) == 0
    recs = load_records(out / "records.jsonl")
    status = {(r.mode, r.context_len): r.status for r in recs}
    assert len(recs) == 9 and len(calls.read_text().splitlines()) == 9  # every point ran, none stopped it
    assert status[("bp", 1024)] == "ok" and status[("bp", 2048)] == "oom" and status[("bp", 4096)] == "oom"
    assert all(status[("cp", c)] == "error" for c in (1024, 2048, 4096))
    assert all(status[("csbp", c)] == "ok" for c in (1024, 2048, 4096))
    err = next(r for r in recs if r.mode == "cp")
    assert "deliberate failure" in err.error and err.exit_code == 3
    oom = next(r for r in recs if r.status == "oom")
    assert "CUDA out of memory" in oom.error
    # every record carries the sweep's device/date and the exact command that reproduces it
    assert {r.device for r in recs} == {"cpu-test"} and {r.date for r in recs} == {"2025-11-30"}
    assert all(FAKE in r.command and f"--context-len {r.context_len}" in r.command for r in recs)

    # outputs regenerated from the records
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9 and {r["status"] for r in rows} == {"ok", "oom", "error"}
    md = (out / "sweep.md").read_text()
    assert md.count("| csbp | 2 |") == 3 and "cp error" in md and "bp oom" in md
    for kind in ("tokens_per_s", "peak_mem", "speedup"):
        assert (out / "img" / f"attention_{kind}.png").stat().st_size > 1000
    csbp1k = next(r for r in recs if (r.mode, r.context_len) == ("csbp", 1024))
    bp1k = next(r for r in recs if (r.mode, r.context_len) == ("bp", 1024))
    assert f"| {csbp1k.tokens_per_s / bp1k.tokens_per_s:.2f}x |" in md

    # resume: nothing re-runs; --retry-failed re-runs only the error points (oom points stay recorded)
    assert _sweep(out, calls) == 0
    assert len(calls.read_text().splitlines()) == 9 and len(load_records(out / "records.jsonl")) == 9
    assert _sweep(out, calls, "--retry-failed") == 0
    ran = calls.read_text().splitlines()[9:]
    assert sorted(ran) == ["cp 1024", "cp 2048", "cp 4096"]
    assert len(load_records(out / "records.jsonl")) == 9

    # a grown grid runs only the new points; --skip-after-oom records bp beyond its OOM boundary unrun
    assert _sweep(out, calls, "--contexts", "1K,2K,4K,8K", "--skip-after-oom") == 0
    recs = load_records(out / "records.jsonl")
    new = calls.read_text().splitlines()[12:]
    assert sorted(new) == ["cp 8192", "csbp 8192"]
    bp8k = next(r for r in recs if (r.mode, r.context_len) == ("bp", 8192))
    assert bp8k.status == "oom" and bp8k.error == "not run: oom at context 2048"


def test_sweep_timeout_missing_script_and_grid_errors(tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(30)\n")
    rc = main(["sweep", "--workload", "w", "--contexts", "64", "--modes", "csbp", "--world-sizes", "1",
               "--out-dir", str(tmp_path / "a"), "--script", str(slow), "--launcher", "python",
               "--timeout", "1", "--no-progress", "--device", "d", "--date", "x"])  # fmt: skip
    assert rc == 0
    (rec,) = load_records(tmp_path / "a" / "records.jsonl")
    assert rec.status == "error" and rec.error == "timeout after 1 s"
    rc = main(["sweep", "--workload", "w", "--contexts", "64", "--modes", "dp", "--world-sizes", "1",
               "--out-dir", str(tmp_path / "b"), "--script", str(tmp_path / "missing.py"), "--launcher",
               "python", "--no-progress", "--device", "d", "--date", "x"])  # fmt: skip
    (rec,) = load_records(tmp_path / "b" / "records.jsonl")
    assert rc == 0 and rec.status == "error" and "missing.py" in rec.error

    # grid: B < P points are reported invalid, not run; bad values are one-line errors naming the field
    points, invalid = build_grid(["attention"], [64, 128], ["cp", "csbp"], [8], [16])
    assert [p.context_len for p in points] == [128, 128] and len(invalid) == 2
    assert parse_sizes("1M,64K,65536") == [65536, 1 << 20]
    with pytest.raises(ValueError, match="context"):
        parse_sizes("64Q")
    with pytest.raises(ValueError, match="mode"):
        build_grid(["attention"], [64], ["ring"], [2], [16])
    with pytest.raises(ValueError, match="workload"):
        point_command(points[0].__class__("nope", 16, 2, 128, "cp"), "o")
    with pytest.raises(ValueError, match="placeholder"):
        point_command(points[0], "o", template="{python} {nope}")
    argv = point_command(points[0], "o x.jsonl", python=sys.executable)
    assert argv[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8"]
    assert argv[argv.index("--out") + 1] == "o x.jsonl"


def test_failure_classification():
    assert classify_failure(1, "RuntimeError: CUDA error: out of memory\n", False)[0] == "oom"
    assert classify_failure(1, "torch.OutOfMemoryError: Tried to allocate\nexit\n", False)[0] == "oom"
    assert classify_failure(-9, "", False)[0] == "oom"
    assert classify_failure(1, "ValueError: bad\n", False) == ("error", "ValueError: bad")
    assert classify_failure(-9, "", True) == ("error", "timeout")


def test_builtin_workload_commands():
    (att,), _ = build_grid(["attention"], [65536], ["csbp"], [2], [64])
    argv = point_command(att, "o.jsonl", python="python")
    assert argv[5:] == ["2", "benchmarks/attention_bench.py", "--modes", "csbp", "--contexts", "65536",
                        "--block-size", "64", "--out", "o.jsonl"]  # fmt: skip
    (sft,), _ = build_grid(["sft"], [65536], ["cp"], [2], [16])
    argv = point_command(sft, "o.jsonl", python="python", launcher="python")
    assert argv == ["python", "benchmarks/bdlm_bench.py", "--modes", "cp", "--contexts", "65536",
                    "--block-size", "16", "--out", "o.jsonl", "--objective", "sft"]  # fmt: skip
    (drafter,), _ = build_grid(["drafter"], [65536], ["csbp"], [2], [16])
    argv = point_command(drafter, "o.jsonl", python="python", launcher="python")
    assert argv == ["python", "benchmarks/drafter_bench.py", "--mode", "csbp", "--world-size", "2", "--context-len",
                    "65536", "--block-size", "16", "--out", "o.jsonl"]  # fmt: skip

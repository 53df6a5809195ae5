"""The drafter benchmark's --smoke run executes every code path on CPU (2 gloo ranks + 1-process points) and
writes valid shared benchmark records."""

import subprocess
import sys
from pathlib import Path

from specforge_csbp.bench.records import load_records

ROOT = Path(__file__).resolve().parents[1]


def test_drafter_bench_smoke(tmp_path):
    out = tmp_path / "drafter.jsonl"
    proc = subprocess.run([sys.executable, "benchmarks/drafter_bench.py", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = load_records(out)
    seen = {(r.mode, r.world_size) for r in records}
    assert {("csbp", 2), ("cp", 2), ("dp", 2), ("csbp", 1), ("specforge", 1)} <= seen
    for r in records:
        extra = r.model_extra or {}
        assert r.status == "ok" and r.step_ms > 0 and r.tokens_per_s > 0 and r.workload == "drafter-tiny"
        assert extra["anchors"] == 13 and extra["mfu"] > 0
        if r.mode != "specforge":  # ours: what the timed steps compiled / allocated (no compile on CPU)
            assert extra["timed_steps_health"] == {"compiled_graphs": 0.0}
        if r.mode in ("csbp", "cp") and r.world_size == 2:
            assert r.exposed_comm_ms is not None and extra["comm_bytes_per_step"] > 0
            assert extra["ceiling"] >= 1.0 and {"ctx_ms", "block_ms", "loss_ms", "prep_ms"} <= set(
                extra["components_ms"]
            )

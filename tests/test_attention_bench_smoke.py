"""The attention benchmark's --smoke run executes every mode on CPU (2 gloo ranks, dense backend) and writes
valid shared benchmark records, each mode checked against the reference first."""

import subprocess
import sys
from pathlib import Path

from specforge_csbp.bench.records import load_records

ROOT = Path(__file__).resolve().parents[1]


def test_attention_bench_smoke(tmp_path):
    out = tmp_path / "attention.jsonl"
    proc = subprocess.run([sys.executable, "benchmarks/attention_bench.py", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = load_records(out)
    assert {(r.mode, r.world_size) for r in records} == {("reference", 1), ("csbp", 2), ("cp", 2), ("bp", 2)}
    assert len({r.context_len for r in records}) >= 2
    pairs = {r.context_len: (r.model_extra or {})["visible_pairs"] for r in records if r.mode == "reference"}
    for r in records:
        extra = r.model_extra or {}
        assert r.status == "ok" and r.step_ms > 0 and r.workload == "attention", r
        assert extra["visible_pairs"] == pairs[r.context_len] and extra["schedule"] == "fused"
        if r.mode != "reference":
            assert extra["check_rel_err"] < 1e-5  # float32 against the single-process reference
        if r.mode in ("csbp", "cp"):
            assert r.exposed_comm_ms is not None

"""The attention benchmark's --smoke run executes every mode on CPU (2 gloo ranks, dense backend) and writes
valid shared benchmark records, each mode checked against the reference first."""

from tests.support.bench_smoke import run_bench_smoke


def test_attention_bench_smoke(tmp_path):
    records = run_bench_smoke("benchmarks/attention_bench.py", tmp_path / "attention.jsonl", timeout=300)
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

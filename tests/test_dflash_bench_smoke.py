"""The drafter benchmark's --smoke run executes every code path on CPU (2 gloo ranks + 1-process points) and
writes valid shared benchmark records."""

from bench_smoke import run_bench_smoke


def test_drafter_bench_smoke(tmp_path):
    records = run_bench_smoke("benchmarks/drafter_bench.py", tmp_path / "drafter.jsonl")
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

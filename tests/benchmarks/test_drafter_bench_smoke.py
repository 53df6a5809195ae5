"""The drafter benchmark's --smoke run executes every code path on CPU (2 gloo ranks + 1-process points) and
writes valid shared benchmark records."""

import subprocess
import sys

from specforge_csbp.bench.provenance import library_digest
from tests.support.bench_smoke import ROOT, run_bench_smoke


def test_drafter_bench_smoke(tmp_path):
    records = run_bench_smoke("benchmarks/drafter_bench.py", tmp_path / "drafter.jsonl")
    seen = {(r.mode, r.world_size) for r in records}
    assert {("csbp", 2), ("cp", 2), ("dp", 2), ("csbp", 1), ("specforge", 1)} <= seen
    for r in records:
        extra = r.model_extra or {}
        assert r.status == "ok" and r.step_ms > 0 and r.tokens_per_s > 0 and r.workload == "drafter-tiny"
        assert extra["anchors"] == 13 and extra["mfu"] > 0
        assert extra["code"] == library_digest()  # the library code that ran (bench/provenance.py)
        assert extra["warmup_steps"] == 1  # --smoke: one warm-up step, and nothing compiles on CPU to extend it
        assert extra.get("gather_ahead") is (None if r.mode == "specforge" else True)  # on by default
        if r.mode != "specforge":  # ours: what the timed steps compiled / allocated (no compile on CPU)
            assert extra["timed_steps_health"] == {"compiled_graphs": 0.0}
        if r.mode in ("csbp", "cp") and r.world_size == 2:
            assert r.exposed_comm_ms is not None and extra["comm_bytes_per_step"] > 0
            assert extra["ceiling"] >= 1.0 and {"ctx_ms", "block_ms", "loss_ms", "prep_ms"} <= set(
                extra["components_ms"]
            )


def test_drafter_bench_smoke_gather_in_front(tmp_path):
    """--no-gather-ahead reaches every rank (the smoke run's path check compares our modes with the dense seam
    gathering in place) and is recorded on our modes only (SpecForge runs its own attention); the default run
    (test above) records gather_ahead true."""
    records = run_bench_smoke("benchmarks/drafter_bench.py", tmp_path / "drafter.jsonl", "--no-gather-ahead")
    for r in records:
        extra = r.model_extra or {}
        assert r.status == "ok"
        assert "reverse_queries" not in extra
        assert extra.get("gather_ahead") is (None if r.mode == "specforge" else False)
        if r.mode != "specforge":  # against the dense seam, float32
            assert extra["check_rel_err"] < 1e-4


def test_drafter_bench_runs_a_drafter_config_file(tmp_path):
    """--draft-config: the drafter a recipe trains (benchmarks/plugin_setup.py's comparison), our modes on 2
    gloo ranks and one at a tiny context (no SpecForge point: that compares plain DFlash of a built-in shape)."""
    records = run_bench_smoke("benchmarks/drafter_bench.py", tmp_path / "r.jsonl",
                              "--draft-config", "examples/quickstart_drafter.json")  # fmt: skip
    assert {(r.mode, r.world_size) for r in records} == {("csbp", 2), ("cp", 2), ("dp", 2), ("csbp", 1)}
    for r in records:
        assert r.status == "ok" and r.workload == "drafter-quickstart_drafter" and r.block_size == 4
        assert (r.model_extra or {})["dflash2"] is True  # what the file says


def test_drafter_bench_refuses_a_dflash2_flag_that_contradicts_the_config_file():
    proc = subprocess.run([sys.executable, "benchmarks/drafter_bench.py", "--smoke", "--no-dflash2", "--draft-config",
                           "examples/quickstart_drafter.json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert proc.returncode != 0 and "is DFlash2DraftModel; drop --dflash2 / --no-dflash2" in proc.stdout + proc.stderr

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


def test_no_dflash2_runs_a_dflash2_config_file_as_plain_dflash(tmp_path):
    """--no-dflash2 with a DFlash2 config: the same layers, widths and block size without the convolutions and
    the selector (`plain_dflash`, what trainer_bench.py --no-dflash2 trains); --dflash2 with a plain config
    is refused in one line."""
    import argparse
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import drafter_bench

    from specforge_csbp.models.dflash.configuration import DFLASH2_FIELDS, plain_dflash

    src = ROOT / "drafter_configs" / "qwen3.6-27b-dflash2.json"
    args = argparse.Namespace(draft_config=str(src), dflash2=False, block_size=None, smoke=True, shape="a")
    name, config = drafter_bench.build_config(args)
    raw = json.loads(src.read_text())
    assert name == "qwen3.6-27b-dflash" and not config.is_dflash2
    assert (config.draft_block_size, config.num_hidden_layers, config.hidden_size) == (
        raw["dflash_config"]["block_size"], raw["num_hidden_layers"], raw["hidden_size"])  # fmt: skip
    assert not set(DFLASH2_FIELDS) & set(config.dflash)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(plain_dflash(raw)))
    proc = subprocess.run([sys.executable, "benchmarks/drafter_bench.py", "--smoke", "--dflash2", "--draft-config",
                           str(plain)], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode != 0 and "is DFlashDraftModel; drop --dflash2" in proc.stdout + proc.stderr

"""`specforge-csbp report --predict`: the planner's prediction and its error beside each measured record."""

from __future__ import annotations

import json

from specforge_csbp.bench.records import BenchRecord
from specforge_csbp.cli.main import main
from specforge_csbp.planner.profile import MachineProfile
from specforge_csbp.planner.validate import record_predictor

DRAFTER = {"architectures": ["DFlashDraftModel"], "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "vocab_size": 1000}  # fmt: skip
PROFILE = MachineProfile(device="test-gpu", date="2025-11-30", world_size=2, gemm_tflops=0.5, attn_tflops=0.2,
                         allgather_gbps=0.05, reduce_scatter_gbps=0.05, allreduce_gbps=0.05)  # fmt: skip


def test_report_puts_planner_predictions_and_errors_beside_records(tmp_path, capsys):
    (tmp_path / "d.json").write_text(json.dumps(DRAFTER))
    (tmp_path / "p.json").write_text(PROFILE.model_dump_json())
    base = dict(workload="drafter-tiny", world_size=2, context_len=4096, block_size=16, device="d", date="x",
                command="c", anchors=64)  # fmt: skip
    predict = record_predictor({"drafter-tiny": str(tmp_path / "d.json")}, PROFILE)
    recs = []
    for mode, off in (("csbp", 1.10), ("cp", 0.80)):  # measured = prediction x off
        p = predict(BenchRecord(mode=mode, status="ok", **base))
        recs.append(dict(base, mode=mode, status="ok", step_ms=p.step_ms / off, tokens_per_s=p.tokens_per_s * off,
                         peak_mem_gib=p.peak_gib * off))  # fmt: skip
    recs.append(dict(base, mode="bp", status="oom"))
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "r.json").write_text(json.dumps(recs))
    rc = main(["report", "--results", str(tmp_path / "res"), "--out", str(tmp_path / "b.md"),
               "--predict", f"drafter-tiny={tmp_path / 'd.json'}", "--profile", str(tmp_path / "p.json")])  # fmt: skip
    assert rc == 0
    md = (tmp_path / "b_records.md").read_text()  # the every-record page carries the predictions
    assert "planned tokens/s | error | planned GiB | error" in md
    row = {m: next(x for x in md.splitlines() if x.startswith(f"| {m} | 2 |")) for m in ("csbp", "cp", "bp")}
    assert row["csbp"].count("-9.1%") == 2 and row["cp"].count("+25.0%") == 2  # pred / measured - 1
    assert "| — | — | — | — |" in row["bp"]  # an oom point has nothing to compare
    assert "tokens/s error max 25.0%, mean 17.0%, 1/2 within 15%" in md
    assert "Planner predictions use the profile" in md and "test-gpu" in md
    assert main(["report", "--results", str(tmp_path / "res"), "--out", str(tmp_path / "c.md"),
                 "--predict", "nonsense"]) == 2  # fmt: skip
    assert "predict must be WORKLOAD=CONFIG" in capsys.readouterr().err


def test_report_takes_a_workloads_own_profile(tmp_path, capsys):
    """`--profile DEFAULT WORKLOAD=OWN`: that workload is predicted with its own calibration, others with the
    default (the drafter's and the SFT layer's rates come from different calibration runs)."""
    (tmp_path / "d.json").write_text(json.dumps(DRAFTER))
    (tmp_path / "p.json").write_text(PROFILE.model_dump_json())
    faster = PROFILE.model_copy(update={"device": "own-gpu", "gemm_tflops": 2.0, "attn_tflops": 0.8})
    (tmp_path / "own.json").write_text(faster.model_dump_json())
    models = {"drafter-tiny": str(tmp_path / "d.json"), "drafter-other": str(tmp_path / "d.json")}
    base = {"world_size": 2, "context_len": 4096, "block_size": 16, "device": "d", "date": "x", "command": "c",
            "anchors": 64, "mode": "csbp", "status": "ok"}  # fmt: skip
    default_only = record_predictor(models, PROFILE)
    mixed = record_predictor(models, PROFILE, {"drafter-other": faster})
    tiny, other = BenchRecord(workload="drafter-tiny", **base), BenchRecord(workload="drafter-other", **base)
    assert mixed(tiny).step_ms == default_only(tiny).step_ms
    assert mixed(other).step_ms < default_only(other).step_ms
    assert mixed(other).step_ms == record_predictor(models, faster)(other).step_ms

    (tmp_path / "res").mkdir()
    p = default_only(tiny)
    (tmp_path / "res" / "r.json").write_text(json.dumps([dict(base, workload="drafter-tiny", step_ms=p.step_ms,
                                                              tokens_per_s=p.tokens_per_s, peak_mem_gib=p.peak_gib)]))
    predict = ["--predict", f"drafter-tiny={tmp_path / 'd.json'}"]
    assert main(["report", "--results", str(tmp_path / "res"), "--out", str(tmp_path / "b.md"), *predict,
                 "--profile", str(tmp_path / "p.json"), f"drafter-tiny={tmp_path / 'own.json'}"]) == 0  # fmt: skip
    md = (tmp_path / "b_records.md").read_text()  # the every-record page carries the predictions
    assert "for `drafter-tiny` the profile" in md and "own-gpu" in md
    assert main(["report", "--results", str(tmp_path / "res"), "--out", str(tmp_path / "c.md"), *predict,
                 "--profile", str(tmp_path / "p.json"), str(tmp_path / "own.json")]) == 2  # fmt: skip
    assert "one default profile at most" in capsys.readouterr().err


def test_planner_error_leaves_out_records_that_compiled_while_timed(tmp_path):
    """A record whose median timed step compiled (2+ graphs in 3 timed steps) is no steady-state time: it
    stays in the table but not in the planner's error (which would otherwise be the compile's, not the
    planner's)."""
    (tmp_path / "d.json").write_text(json.dumps(DRAFTER))
    (tmp_path / "p.json").write_text(PROFILE.model_dump_json())
    predict = record_predictor({"drafter-tiny": str(tmp_path / "d.json")}, PROFILE)
    base = {"workload": "drafter-tiny", "world_size": 2, "context_len": 4096, "block_size": 16, "device": "d",
            "date": "x", "command": "c", "anchors": 64, "status": "ok"}  # fmt: skip
    recs = []
    for mode, off, compiled in (("csbp", 1.0, 1.0), ("cp", 0.5, 2.0)):  # cp: 100% off, but compiling
        p = predict(BenchRecord(mode=mode, **base))
        recs.append(dict(base, mode=mode, step_ms=p.step_ms / off, tokens_per_s=p.tokens_per_s * off,
                         peak_mem_gib=p.peak_gib, timed_steps_health={"compiled_graphs": compiled}))  # fmt: skip
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "r.json").write_text(json.dumps(recs))
    assert main(["report", "--results", str(tmp_path / "res"), "--out", str(tmp_path / "b.md"),
                 "--predict", f"drafter-tiny={tmp_path / 'd.json'}", "--profile", str(tmp_path / "p.json")]) == 0  # fmt: skip
    md = (tmp_path / "b_records.md").read_text()  # the every-record page carries the predictions
    assert "tokens/s error max 0.0%, mean 0.0%, 1/1 within 15%" in md
    assert "Left out of both: 1 record(s) whose timed steps compiled 2 or more graphs" in md and "cp L=4096 (x)" in md
    assert "+100.0%" in next(x for x in md.splitlines() if x.startswith("| cp | 2 |"))  # still in the table

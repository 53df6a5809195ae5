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
    md = (tmp_path / "b.md").read_text()
    assert "planned tokens/s | error | planned GiB | error" in md
    row = {m: next(x for x in md.splitlines() if x.startswith(f"| {m} | 2 |")) for m in ("csbp", "cp", "bp")}
    assert row["csbp"].count("-9.1%") == 2 and row["cp"].count("+25.0%") == 2  # pred / measured - 1
    assert "| — | — | — | — |" in row["bp"]  # an oom point has nothing to compare
    assert "tokens/s error max 25.0%, mean 17.0%, 1/2 within 15%" in md
    assert "Planner predictions use the profile" in md and "test-gpu" in md
    assert main(["report", "--results", str(tmp_path / "res"), "--out", str(tmp_path / "c.md"),
                 "--predict", "nonsense"]) == 2  # fmt: skip
    assert "predict must be WORKLOAD=CONFIG" in capsys.readouterr().err

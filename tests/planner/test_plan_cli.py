"""`specforge-csbp plan`: deterministic recommendation, memory feasibility, the scaling table next to its
calibration, CPU calibration, and one-line errors."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from specforge_csbp.bench.provenance import library_digest
from specforge_csbp.cli.main import main
from specforge_csbp.planner.cost import Layout, Options, predict
from specforge_csbp.planner.pairs import bdlm_rank_stats
from specforge_csbp.planner.profile import calibrate, load_profile
from specforge_csbp.planner.search import TIE, enumerate_layouts, plan_layouts, recommend
from specforge_csbp.planner.shapes import load_shape
from tests.support.planner_fixtures import DRAFTER, LM, PROFILE


@pytest.fixture
def files(tmp_path):
    (tmp_path / "lm.json").write_text(json.dumps(LM))
    (tmp_path / "drafter.json").write_text(json.dumps(DRAFTER))
    (tmp_path / "profile.json").write_text(PROFILE.model_dump_json())
    return tmp_path


def test_recommendation_is_deterministic_and_follows_its_rule():
    shape = load_shape(LM)
    for gpu_mem in (1.0, 0.1, 0.08, 1e-4):
        a = plan_layouts(shape, "sft", 4096, 8, gpu_mem, PROFILE)
        b = plan_layouts(shape, "sft", 4096, 8, gpu_mem, PROFILE)
        assert [asdict(p) for p in a.predictions] == [asdict(p) for p in b.predictions]
        assert [p.layout for p in a.predictions] == enumerate_layouts(8)
        fits = [p for p in a.predictions if p.fits]
        assert all(p.peak_gib <= gpu_mem for p in fits)
        assert all("GiB" in p.reason for p in a.predictions if not p.fits and p.step_ms is not None)
        if not fits:
            assert a.recommended is None
            continue
        rec = a.recommended
        best = max(p.tokens_per_s for p in fits)
        assert rec.fits and rec.tokens_per_s >= best * (1 - TIE)
        assert all(rec.peak_gib <= p.peak_gib for p in fits if p.tokens_per_s >= best * (1 - TIE))
        assert recommend(list(reversed(a.predictions))).layout == rec.layout  # order does not matter


def test_cost_model_follows_the_layouts():
    shape = load_shape(LM)
    L, S = 8192, 16
    csbp, cp, bp = (predict(shape, "sft", L, Layout(1, 4, m), PROFILE, 1e9) for m in ("csbp", "cp", "bp"))
    s_csbp, s_cp = bdlm_rank_stats("csbp", L, S, 4)[0], bdlm_rank_stats("cp", L, S, 4)[0]
    assert s_cp.gathered_rows == 2 * s_csbp.gathered_rows  # CP ships both copies
    assert cp.breakdown_ms["exposed_comm"] > csbp.breakdown_ms["exposed_comm"] > 0
    assert csbp.step_ms < cp.step_ms and csbp.peak_gib < cp.peak_gib
    assert bp.breakdown_ms["exposed_comm"] == 0 and bp.breakdown_ms["attention"] > csbp.breakdown_ms["attention"]
    one = predict(shape, "sft", L, Layout(1, 1, "dp"), PROFILE, 1e9)
    assert csbp.breakdown_ms["attention"] == pytest.approx(one.breakdown_ms["attention"] / 4, rel=0.02)
    conv = predict(shape, "convert", L, Layout(1, 4, "csbp"), PROFILE, 1e9)
    assert conv.breakdown_ms["gemm"] == pytest.approx(2 * csbp.breakdown_ms["gemm"])  # two views
    d = load_shape(DRAFTER)
    opts = Options(anchors=64)
    dc, dcp = (predict(d, "drafter", 16384, Layout(1, 4, m), PROFILE, 1e9, opts) for m in ("csbp", "cp"))
    assert dcp.breakdown_ms["loss"] == pytest.approx(4 * dc.breakdown_ms["loss"], rel=0.05)  # CP duplicates


def test_tokens_per_s_counts_what_the_trainer_and_benchmarks_count():
    """BDLM: the sequence's tokens (BDLMWorkload.tokens_per_step, bdlm_bench's denominator on fully supervised
    data), not the E[t] share the SFT loss masks; drafter: supervised draft tokens N x (S - 1)."""
    from specforge_csbp.models.bdlm.workload import BDLMWorkload

    shape, L = load_shape(LM), 8192
    for workload in ("sft", "convert"):
        for layout in (Layout(1, 1, "dp"), Layout(2, 2, "csbp")):
            p = predict(shape, workload, L, layout, PROFILE, 1e9)
            assert p.tokens_per_s == pytest.approx(layout.dp * L / (p.step_ms / 1e3))
    ctx = type("Ctx", (), {"global_batch": 3})()
    assert BDLMWorkload.tokens_per_step(type("W", (), {"seq_len": L})(), ctx) == 3 * L  # the trainer's count
    d, opts = load_shape(DRAFTER), Options(anchors=64)
    p = predict(d, "drafter", 16384, Layout(2, 2, "csbp"), PROFILE, 1e9, opts)
    assert p.tokens_per_s == pytest.approx(2 * 64 * (opts.block_size - 1) / (p.step_ms / 1e3))


def test_plan_cli_prints_every_layout_and_is_deterministic(files, capsys):
    args = ["plan", "--model", str(files / "lm.json"), "--context", "4K", "--gpus", "4", "--gpu-mem", "0.1",
            "--profile", str(files / "profile.json"), "--no-scaling", "--json", str(files / "p.json")]  # fmt: skip
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    data = json.loads((files / "p.json").read_text())
    for lay in enumerate_layouts(4):
        assert lay.label in first
    rec = data["recommended"]["layout"]
    assert f"recommended: {rec} - " in first and "calibration: test-gpu, measured 2025-11-30" in first
    assert any(not p["fits"] for p in data["predictions"])  # 0.1 GiB keeps some layouts out


def test_plan_scaling_table_next_to_its_calibration(files, capsys):
    assert main(["plan", "--model", str(files / "drafter.json"), "--context", "4K", "--gpus", "2",
                 "--gpu-mem", "80", "--profile", str(files / "profile.json"), "--anchors", "32",
                 "--json", str(files / "s.json")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    table = out[out.index("predicted scaling"):].splitlines()
    assert "calibration: test-gpu, measured 2025-11-30 on 2 rank(s)" in table[0]
    rows = json.loads((files / "s.json").read_text())["scaling"]
    assert [(r["gpus"], r["context"]) for r in rows] == [(8, 512 << 10), (16, 512 << 10), (8, 1 << 20), (16, 1 << 20)]
    for r, line in zip(rows, table[2:], strict=True):
        c, o = r["csbp"], r["other"]
        assert r["speedup_over_other"] == pytest.approx(c["tokens_per_s"] / o["tokens_per_s"])
        assert c["mode"] == "csbp" and o["mode"] != "csbp" and c["fits"] and o["fits"]
        assert line.split()[:2] == [str(r["gpus"]), "512K" if r["context"] == 512 << 10 else "1M"]
        assert c["layout"] in line and o["layout"] in line and f"{r['speedup_over_other']:.2f}" in line


def test_calibrate_on_cpu_and_plan_with_it(files, capsys):
    prof = calibrate(1)
    assert prof.measured and prof.world_size == 1 and prof.gemm_tflops > 0 and prof.attn_tflops > 0
    assert prof.allgather_gbps is None and prof.attention_backend == "dense"
    work = ("layer_tflops", "loss_tflops", "loss_topk_tflops", "adamw_gbps")  # planner/rates.py, toy sizes
    assert all(getattr(prof, k) > 0 for k in work) and prof.calibration_s > 0
    assert prof.code == library_digest()  # which code it timed: the report pairs records with it by this
    with pytest.raises(ValueError, match="allgather_gbps was not measured"):
        predict(load_shape(LM), "sft", 4096, Layout(1, 2, "csbp"), prof, 80)
    out = files / "cpu2.json"
    assert main(["plan", "--calibrate", "--world-size", "2", "--profile-out", str(out)]) == 0
    prof2 = load_profile(out)
    assert prof2.world_size == 2 and prof2.allgather_gbps > 0 and prof2.reduce_scatter_gbps > 0
    assert prof2.code == library_digest()  # written to the profile file and read back
    assert all(getattr(prof2, k) > 0 for k in work)
    assert "calibrated: cpu" in capsys.readouterr().out
    assert main(["plan", "--model", str(files / "lm.json"), "--context", "2K", "--gpus", "2", "--profile",
                 str(out), "--no-scaling"]) == 0  # fmt: skip
    assert "recommended:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--gpus", "0"], "gpus"),
        (["--context", "12Q"], "context"),
        (["--gpu-mem", "0"], "gpu_mem"),
        (["--workload", "drafter"], "workload"),
        (["--profile", "nope.json"], "profile"),
        (["--block-size", "4096", "--context", "4K", "--gpus", "2"], None),  # layouts report, not fail
    ],
)
def test_plan_bad_inputs_are_one_line_errors(files, capsys, extra, field):
    base = ["plan", "--model", str(files / "lm.json"), "--context", "4K", "--gpus", "2", "--no-scaling",
            "--profile", str(files / "profile.json")]  # fmt: skip
    rc = main(base + extra)
    err = capsys.readouterr()
    if field is None:
        assert rc == 0 and "blocks < world_size" in err.out
        return
    assert rc == 2
    line = err.err.strip()
    assert "\n" not in line and line.startswith("specforge-csbp plan: error: ") and field in line

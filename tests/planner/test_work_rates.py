"""Work rates of the machine profile (planner/rates.py, profile.py, cost.py): what calibration measures, that
the cost model charges token-wise work, loss and optimizer at them when present, and that profiles without
them (the built-in ones) predict exactly what the GEMM rate predicts."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from importlib import resources

import pytest
import torch

from specforge_csbp.planner import rates
from specforge_csbp.planner.cost import Layout, Options, predict
from specforge_csbp.planner.profile import BUILTIN_PROFILES, MachineProfile, load_profile
from specforge_csbp.planner.search import enumerate_layouts, plan_layouts
from specforge_csbp.planner.shapes import ModelShape, load_shape
from specforge_csbp.planner.validate import record_options
from tests.support.planner_fixtures import DRAFTER, LM, PROFILE

BASE = PROFILE
NEW_FIELDS = ("layer_tflops", "loss_tflops", "loss_topk_tflops", "adamw_gbps")
MEASURED = NEW_FIELDS + ("loss_top1_tflops",)  # what calibration measures now (top-1 since h200x2-2026-11-30-c)


def _cases():
    """(shape, workload, context, options) covering BDLM SFT/conversion and a drafter, several layouts."""
    lm, dr = load_shape(LM), load_shape(DRAFTER)
    return [(lm, "sft", 8192, Options()), (lm, "convert", 4096, Options()),
            (dr, "drafter", 16384, Options(anchors=64))]  # fmt: skip


def test_cpu_measurement_counts_flops_as_the_cost_model_does(monkeypatch):
    """With every timed call taking "1 s", each rate is exactly the FLOPs (bytes) the cost model charges for
    that work; each measured function runs the real code once (gradients reach the inputs)."""
    ran = []

    def one_second(fn, device, reps, warmup=2):
        fn()
        ran.append(fn.__name__)
        return 1.0

    monkeypatch.setattr(rates, "timed", one_second)
    z = rates.WORK_SIZES["cpu"]
    got = rates.measure_work_rates(torch.device("cpu"))
    assert ran == ["step", "trainable_head", "frozen_head_topk", "frozen_head_top1", "step"]
    shape = ModelShape(name="calib", hidden=z["hidden"], intermediate=z["intermediate"], layers=1,
                       heads=z["heads"], kv_heads=z["kv_heads"], head_dim=z["head_dim"], vocab=z["vocab"],
                       tied_embeddings=True, windows=(None,))  # fmt: skip
    layer, _ = rates.qwen3_layer(torch.device("cpu"), z)
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert linear == shape.layer_params  # the measured layer has the weights the model counts
    rows, pass_flops = z["rows"], z["rows"] * 2 * z["hidden"] * z["vocab"]
    assert got["layer_tflops"] == pytest.approx(rows * shape.layer_gemm_flops_per_row() * 3 / 1e12, rel=1e-12)
    assert got["loss_tflops"] == pytest.approx(pass_flops * 4 / 1e12, rel=1e-12)
    assert got["loss_topk_tflops"] == pytest.approx(pass_flops * 3 / 1e12, rel=1e-12)
    assert got["loss_top1_tflops"] == pytest.approx(pass_flops * 3 / 1e12, rel=1e-12)
    parts = 4 * (z["adamw_params"] // 4)
    assert got["adamw_gbps"] == pytest.approx(parts * rates.ADAMW_BYTES_PER_PARAM / 1e9, rel=1e-12)


def test_cpu_measurement_is_real_and_fast():
    import time

    t = time.perf_counter()
    got = rates.measure_work_rates(torch.device("cpu"))
    elapsed = time.perf_counter() - t
    assert set(got) == set(MEASURED)
    assert all(math.isfinite(v) and v > 0 for v in got.values())
    assert elapsed < 30  # toy sizes: ~1-3 s on 2 cores (generous bound for a loaded machine)
    MachineProfile(**{**BASE.model_dump(), **got})  # valid profile fields


def test_rates_are_used_when_present():
    full = BASE.model_copy(update={"layer_tflops": 0.25, "loss_tflops": 0.125, "loss_topk_tflops": 0.1,
                                   "adamw_gbps": 2.0})  # fmt: skip
    for shape, wl, ctx, opt in _cases():
        for lay in (Layout(1, 2, "csbp"), Layout(1, 2, "cp"), Layout(2, 1, "dp")):
            old = predict(shape, wl, ctx, lay, BASE, 1e9, opt)
            new = predict(shape, wl, ctx, lay, full, 1e9, opt)
            a, b = old.breakdown_ms, new.breakdown_ms
            assert b["gemm"] == pytest.approx(2 * a["gemm"], rel=1e-12)  # token work at half the GEMM rate
            assert b["attention"] == a["attention"]
            loss_rate = full.loss_topk_tflops if wl == "drafter" else full.loss_tflops
            assert b["loss"] == pytest.approx(a["loss"] * BASE.gemm_tflops / loss_rate, rel=1e-12)
            adamw = shape.trainable_params * rates.ADAMW_BYTES_PER_PARAM / 2e9 * 1e3
            assert "optimizer" not in a and b["optimizer"] == pytest.approx(adamw, rel=1e-12)
            assert new.step_ms == pytest.approx(sum(b.values()), rel=1e-12)
            assert new.step_ms > old.step_ms and new.peak_gib == old.peak_gib
            off = predict(shape, wl, ctx, lay, full, 1e9, replace(opt, optimizer_step=False))
            assert "optimizer" not in off.breakdown_ms
            assert off.step_ms == pytest.approx(new.step_ms - b["optimizer"], rel=1e-12)
    # one loss rate measured: both workloads use it before falling back to the GEMM rate
    only = BASE.model_copy(update={"loss_tflops": 0.125})
    assert only.loss_rate_tflops(True) == 0.125 == only.loss_rate_tflops(False)
    topk = BASE.model_copy(update={"loss_topk_tflops": 0.1})
    assert topk.loss_rate_tflops(False) == 0.1 == topk.loss_rate_tflops(True)
    assert topk.loss_rate_tflops(True, top1=True) == 0.1  # no top-1 rate (profiles before h200x2-2026-11-30-c): top-k's
    assert BASE.loss_rate_tflops(frozen_head_topk=True) == BASE.token_tflops == BASE.gemm_tflops


def test_top1_rate_charges_drafters_without_a_selector_only():
    """DFlash (no selector) takes linear_ce_topk's top-1 path, DFlash2 with a selector the top-k path: the
    planner charges each at its own measured rate."""
    prof = BASE.model_copy(update={"loss_topk_tflops": 0.1, "loss_top1_tflops": 0.4})
    dr = load_shape(DRAFTER)
    plain, with_selector = dr.without_dflash2(), replace(dr, selector_rank=8, selector_top_k=4)
    assert plain.selector_top_k == 0 and with_selector.selector_top_k == 4
    opt, lay = Options(anchors=64), Layout(1, 2, "csbp")
    for shape, rate in ((plain, 0.4), (with_selector, 0.1)):
        base = predict(shape, "drafter", 16384, lay, BASE, 1e9, opt).breakdown_ms["loss"]
        got = predict(shape, "drafter", 16384, lay, prof, 1e9, opt).breakdown_ms["loss"]
        assert got == pytest.approx(base * BASE.gemm_tflops / rate, rel=1e-12)
    assert prof.loss_rate_tflops(False, top1=True) == prof.loss_rate_tflops(False)  # the BDLM's loss: no top-1


def test_profiles_without_the_rates_predict_as_before():
    """A profile without the new fields predicts exactly what the same profile with every new rate set to
    the GEMM rate (and no optimizer rate) predicts - the GEMM-rate model these profiles always had."""
    older = 0
    for name in BUILTIN_PROFILES:
        prof = load_profile(name)
        text = resources.files("specforge_csbp.planner").joinpath(f"profiles/{name}.json").read_text()
        raw = json.loads(text)
        assert prof.gemm_tflops == raw["gemm_tflops"] and prof.attn_tflops == raw["attn_tflops"]
        if set(NEW_FIELDS) & set(raw):  # calibrated since the rates exist: what the file says, shown
            assert all(getattr(prof, k) == raw[k] > 0 for k in NEW_FIELDS)
            assert "decoder layer" in prof.summary() and "AdamW" in prof.summary()
            continue
        older += 1
        assert all(getattr(prof, k) is None for k in NEW_FIELDS)
        assert "decoder layer" not in prof.summary() and "AdamW" not in prof.summary()
    assert older >= 1  # h200-nominal and h200x2-2026-11-29 predate the rates
    for prof in (BASE, load_profile("h200x2-2026-11-29")):
        g = prof.gemm_tflops
        same = prof.model_copy(update={"layer_tflops": g, "loss_tflops": g, "loss_topk_tflops": g})
        for shape, wl, ctx, opt in _cases():
            for lay in enumerate_layouts(4):
                a = predict(shape, wl, ctx, lay, prof, 80, opt)
                b = predict(shape, wl, ctx, lay, same, 80, opt)
                assert asdict(a) == asdict(b)
                assert a.step_ms is None or set(a.breakdown_ms) == {
                    "gemm", "attention", "loss", "exposed_comm", "launch", "exposed_grad_sync"}


def test_recommendation_with_rates_is_deterministic_and_benchmark_options_match():
    full = BASE.model_copy(update={"layer_tflops": 0.3, "loss_tflops": 0.2, "loss_topk_tflops": 0.1,
                                   "adamw_gbps": 1.0})  # fmt: skip
    for shape, wl, ctx, opt in _cases():
        a = plan_layouts(shape, wl, ctx, 8, 1.0, full, opt)
        b = plan_layouts(shape, wl, ctx, 8, 1.0, full, opt)
        assert [asdict(p) for p in a.predictions] == [asdict(p) for p in b.predictions]
        assert (a.recommended is None) == (b.recommended is None)
        assert a.recommended is None or a.recommended.layout == b.recommended.layout

    class Rec:  # the drafter benchmark runs no optimizer step, the BDLM benchmark one fused AdamW step
        block_size, model_extra = 16, {}

    assert not record_options(Rec(), "drafter").optimizer_step and record_options(Rec(), "sft").optimizer_step


def test_bad_rate_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="layer_tflops"):
        MachineProfile(**{**BASE.model_dump(), "layer_tflops": 0.0})

"""Drafter attention rates of the machine profile (planner/rates.py, profile.py, cost.py): what calibration
counts for the sliding-window and full-context draft-block layers, that the cost model charges each drafter
layer at the rate of its window, and that profiles without the rates (the built-in ones) predict as before."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from importlib import resources

import pytest
import torch

from specforge_csbp.planner import rates
from specforge_csbp.planner.cost import Layout, Options, predict
from specforge_csbp.planner.pairs import drafter_rank_stats
from specforge_csbp.planner.profile import BUILTIN_PROFILES, MachineProfile, calibrate, load_profile
from specforge_csbp.planner.search import enumerate_layouts
from specforge_csbp.planner.shapes import load_shape
from tests.support.planner_fixtures import DRAFTER, LM, PROFILE

FIELDS = ("attn_window_tflops", "attn_draft_tflops")
CONTEXT, OPT = 16384, Options(anchors=64)


def _rank_attention_ms(
    shape, layout: Layout, window_rate: float, draft_rate: float
) -> list[tuple[float, float]]:
    """Per rank: (sliding-window part, full part) of the drafter's attention ms, from the documented formula
    visible pairs x 4 H D x 3.5 / rate, summed over the layers of each kind."""
    mode = "dp" if layout.mode == "dp" else layout.mode
    stats = {w: drafter_rank_stats(mode, CONTEXT, OPT.anchors, OPT.block_size, layout.cp, w)
             for w in set(shape.windows)}  # fmt: skip
    out = []
    for r in range(len(next(iter(stats.values())))):
        parts = [0.0, 0.0]
        for w in shape.windows:
            rate = window_rate if w is not None else draft_rate
            parts[w is None] += (
                stats[w][r].pairs * shape.attention_flops_per_pair() * 3.5 / (rate * 1e12) * 1e3
            )
        out.append((parts[0], parts[1]))
    return out


def test_calibration_counts_the_pairs_the_rule_makes_visible(monkeypatch):
    """With every timed call taking "1 s", each rate is exactly visible pairs x 4 H D x 3.5 / 1e12, the
    pairs counted here in closed form from the anchors: a draft slot j of the block at anchor a sees
    min(a, W-1-j) context keys in a window of W and j+1 keys of its block (causal), or all a context keys
    and the S keys of its block in a full layer. The timed calls are real forward + backward passes."""
    ran = []

    def one_second(fn, device, reps, warmup=2):
        fn()
        q, k, v = fn.__defaults__[1:4]
        assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))
        ran.append(fn.__name__)
        return 1.0

    monkeypatch.setattr(rates, "timed", one_second)
    z = rates.DRAFTER_ATTN_SIZES["cpu"]
    got = rates.measure_drafter_attention(torch.device("cpu"))
    assert ran == ["sliding_attention_step", "full_attention_step"]
    anchors = rates.drafter_attention_anchors(z).tolist()
    S, W = z["block"], z["window"]
    assert len(set(anchors)) == len(anchors) == z["anchors"] and max(anchors) < z["context"] - 1
    assert min(anchors) < W - 1  # some window is cut by the start of the sequence (min(a, ...) matters)
    window_pairs = sum(min(a, W - 1 - j) + j + 1 for a in anchors for j in range(S))
    full_pairs = sum(S * (a + S) for a in anchors)
    flops_per_pair = 4 * z["heads"] * z["head_dim"] * 3.5
    assert got["attn_window_tflops"] == pytest.approx(window_pairs * flops_per_pair / 1e12, rel=1e-12)
    assert got["attn_draft_tflops"] == pytest.approx(full_pairs * flops_per_pair / 1e12, rel=1e-12)


def test_calibrate_on_cpu_fills_both_rates():
    prof = calibrate(1)
    assert all(math.isfinite(getattr(prof, f)) and getattr(prof, f) > 0 for f in FIELDS)
    assert prof.calibration_s < 30  # toy sizes: ~2 s on 2 cores (generous bound for a loaded machine)
    assert "drafter attention window" in prof.summary()


def test_drafter_layers_are_charged_at_their_windows_rate():
    shape = load_shape(DRAFTER)
    assert None in shape.windows and any(w is not None for w in shape.windows)
    base = PROFILE.model_copy(update={"attn_window_tflops": 0.04, "attn_draft_tflops": 0.1})
    half = base.model_copy(update={"attn_window_tflops": 0.02})
    for layout in enumerate_layouts(4):
        for prof in (base, half):
            pred = predict(shape, "drafter", CONTEXT, layout, prof, 1e9, OPT)
            expect = _rank_attention_ms(shape, layout, prof.attn_window_tflops, prof.attn_draft_tflops)
            # the prediction is the slowest rank's: its attention is that rank's formula value
            assert any(pred.breakdown_ms["attention"] == pytest.approx(s + f, rel=1e-12) for s, f in expect)
            assert pred.step_ms == pytest.approx(sum(pred.breakdown_ms.values()), rel=1e-12)
    # one rank: halving the window rate doubles exactly the sliding-window part, nothing else moves
    one = Layout(1, 1, "dp")
    a, b = (predict(shape, "drafter", CONTEXT, one, p, 1e9, OPT).breakdown_ms for p in (base, half))
    ((sliding, full),) = _rank_attention_ms(shape, one, base.attn_window_tflops, base.attn_draft_tflops)
    assert sliding > 0 and full > 0
    assert a["attention"] == pytest.approx(sliding + full, rel=1e-12)
    assert b["attention"] == pytest.approx(2 * sliding + full, rel=1e-12)
    assert {k: v for k, v in a.items() if k != "attention"} == {
        k: v for k, v in b.items() if k != "attention"
    }
    # the helper: each window its rate, None fields fall back to the BDLM-measured attn_tflops
    assert base.drafter_attn_tflops(256) == 0.04 and base.drafter_attn_tflops(None) == 0.1
    only = PROFILE.model_copy(update={"attn_window_tflops": 0.04})
    assert only.drafter_attn_tflops(None) == PROFILE.attn_tflops == PROFILE.drafter_attn_tflops(256)


def test_profiles_without_the_rates_predict_as_before_and_bdlm_never_uses_them():
    """No drafter rates = both at attn_tflops (the model these profiles always had), field for field; BDLM
    workloads predict the same whatever the drafter rates are."""
    older = 0
    for name in BUILTIN_PROFILES:
        raw = json.loads(resources.files("specforge_csbp.planner").joinpath(f"profiles/{name}.json").read_text())
        prof = load_profile(name)
        if set(FIELDS) & set(raw):  # calibrated since the rates exist: what the file says, shown
            assert all(getattr(prof, f) == raw[f] > 0 for f in FIELDS) and "drafter attention" in prof.summary()
        else:
            older += 1
            assert all(getattr(prof, f) is None for f in FIELDS) and "drafter attention" not in prof.summary()
    assert older >= 1  # h200-nominal and h200x2-2026-11-29 predate the rates
    drafter, lm = load_shape(DRAFTER), load_shape(LM)
    for prof in (PROFILE, load_profile("h200x2-2026-11-29")):
        same = prof.model_copy(update={f: prof.attn_tflops for f in FIELDS})
        other = prof.model_copy(
            update={"attn_window_tflops": prof.attn_tflops / 7, "attn_draft_tflops": 1e-3}
        )
        for layout in enumerate_layouts(4):
            a = predict(drafter, "drafter", CONTEXT, layout, prof, 80, OPT)
            assert asdict(a) == asdict(predict(drafter, "drafter", CONTEXT, layout, same, 80, OPT))
            if a.step_ms is not None:
                slower = predict(drafter, "drafter", CONTEXT, layout, other, 80, OPT)
                assert slower.breakdown_ms["attention"] > a.breakdown_ms["attention"]
            for wl, ctx in (("sft", 8192), ("convert", 4096)):
                ref = predict(lm, wl, ctx, layout, prof, 80)
                assert asdict(ref) == asdict(predict(lm, wl, ctx, layout, other, 80))


def test_bad_drafter_rate_is_rejected_naming_the_field():
    for field in FIELDS:
        with pytest.raises(ValueError, match=field):
            MachineProfile(**{**PROFILE.model_dump(), field: 0.0})

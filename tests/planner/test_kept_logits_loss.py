"""The planner's drafter loss with kept logits (`Options.keep_logits_gib`, objectives/linear_ce_topk.py):
two [rows, V] GEMMs instead of three and the [rows, V] logits held - only when all of a rank's rows fit the
budget, as the objective decides - and a record's `keep_logits_gib` reaches the prediction."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specforge_csbp.bench.records import BenchRecord
from specforge_csbp.planner.cost import Layout, Options, predict
from specforge_csbp.planner.profile import load_profile
from specforge_csbp.planner.shapes import load_shape
from specforge_csbp.planner.validate import record_options

CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "drafter-qwen3.6-27b.json"
GIB = 2**30


def _predict(layout: Layout, keep: float):
    shape, profile = load_shape(CONFIG), load_profile("h200x2-2026-11-30-b")
    opt = Options(block_size=16, anchors=512, keep_logits_gib=keep)
    return predict(shape, "drafter", 65536, layout, profile, float("inf"), opt), shape


@pytest.mark.parametrize("layout", [Layout(1, 1, "dp"), Layout(1, 2, "csbp"), Layout(1, 2, "cp")])
def test_kept_logits_cost_two_thirds_of_the_loss_and_their_bytes(layout):
    base, shape = _predict(layout, 0.0)
    kept, _ = _predict(layout, 64.0)
    assert kept.breakdown_ms["loss"] == pytest.approx(base.breakdown_ms["loss"] * 2 / 3, rel=1e-12)
    assert kept.step_ms < base.step_ms
    # this rank's supervised rows: all 512 anchors' 15 rows on one GPU and under CP, about half under CSBP
    rows = 512 * 15 if layout.mode != "csbp" else None
    extra_gib = kept.memory.loss - base.memory.loss
    if rows is not None:
        assert extra_gib == pytest.approx(rows * shape.vocab * 2 / GIB, rel=1e-12)
    else:
        assert 0.4 * 512 * 15 * shape.vocab * 2 / GIB < extra_gib < 0.6 * 512 * 15 * shape.vocab * 2 / GIB


def test_logits_over_the_budget_are_recomputed():
    base, shape = _predict(Layout(1, 1, "dp"), 0.0)
    need = 512 * 15 * shape.vocab * 2 / GIB
    short, _ = _predict(Layout(1, 1, "dp"), need * 0.99)
    enough, _ = _predict(Layout(1, 1, "dp"), need * 1.01)
    assert short.step_ms == base.step_ms and short.memory.loss == base.memory.loss
    assert enough.step_ms < base.step_ms


def test_record_keep_logits_reaches_the_options():
    rec = dict(workload="drafter-qwen3.6-27b", mode="csbp", world_size=1, context_len=65536, block_size=16,
               step_ms=412.1, tokens_per_s=18638.0, peak_mem_gib=34.6, status="ok", device="NVIDIA H200",
               date="2026-11-30", command="x", anchors=512)  # fmt: skip
    assert record_options(BenchRecord(**rec), "drafter").keep_logits_gib == 0.0
    opts = record_options(BenchRecord(**rec, keep_logits_gib=6.0), "drafter")
    assert opts.keep_logits_gib == 6.0 and dataclasses.replace(opts, keep_logits_gib=0.0) == record_options(
        BenchRecord(**rec), "drafter"
    )

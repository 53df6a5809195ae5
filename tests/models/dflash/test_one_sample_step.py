"""One per-sample drafter step: the plugin's training module and the drafter benchmark run the same
`models/dflash/step.sample_terms` (and `plan_sample`), and every drafter forward of either happens inside it;
the acceptance estimate it sums is the one defined in objectives/dflash.py."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from specforge_csbp.models.dflash import step as dflash_step
from specforge_csbp.models.dflash.modeling import DFlashDraftModel
from specforge_csbp.objectives.dflash import LossIndex, acceptance_stats

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_acceptance_stats_by_hand():
    # 3 blocks of S = 4; supervised rows (block * 4 + slot) and whether the argmax was right
    #   block 0: slots 1 2 3 right, wrong, right  -> run 1 -> accepted 2
    #   block 1: slots 1 2 right, right; slot 3 unsupervised -> run 2 -> accepted 3
    #   block 2: slot 1 wrong, 2 3 right           -> run 0 -> accepted 1
    supervised = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    rows = torch.nonzero(supervised.reshape(-1)).flatten()
    hit = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    index = LossIndex(rows, torch.zeros_like(rows), torch.zeros_like(rows), supervised)
    stats = acceptance_stats(hit, index, 3, 4, torch.float64)
    assert float(stats["accepted"]) == 2 + 3 + 1 and float(stats["blocks"]) == 3
    assert stats["slot_correct"].tolist() == [0, 2, 2, 2]
    assert stats["slot_supervised"].tolist() == [0, 3, 3, 2]
    # brute force over random grids: 1 + leading run of right and supervised slots 1.., summed over blocks
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        sup = torch.rand(6, 5, generator=g) > 0.2
        sup[:, 0] = False
        rows = torch.nonzero(sup.reshape(-1)).flatten()
        hit = torch.rand(rows.numel(), generator=g) > 0.4
        right = torch.zeros(30, dtype=torch.bool)
        right[rows] = hit
        right = right.view(6, 5)
        expected = 0
        for b in range(6):
            run = 0
            while run + 1 < 5 and right[b, run + 1]:
                run += 1
            expected += 1 + run
        got = acceptance_stats(hit, LossIndex(rows, rows, rows, sup), 6, 5, torch.float64)
        assert float(got["accepted"]) == expected


def _bench_module():
    spec = importlib.util.spec_from_file_location("drafter_bench", os.path.join(ROOT, "benchmarks", "drafter_bench.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["drafter_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_plugin_and_benchmark_run_the_same_step(tmp_path, monkeypatch):
    from tests.plugin.test_eval_during_training import _store, _training_model, make_stores  # noqa: F401 - a tiny plugin setup

    calls = {"plugin": 0, "bench": 0}
    where = {"path": None, "inside": False}
    forwards = {"inside": 0, "outside": 0}
    shared, model_forward = dflash_step.sample_terms, DFlashDraftModel.forward

    def recorded(*args, **kwargs):
        calls[where["path"]] += 1
        where["inside"] = True
        try:
            return shared(*args, **kwargs)
        finally:
            where["inside"] = False

    def counted_forward(self, *args, **kwargs):
        forwards["inside" if where["inside"] else "outside"] += 1
        return model_forward(self, *args, **kwargs)

    from specforge_csbp.plugin import training_model

    assert training_model.sample_terms is dflash_step.sample_terms  # the plugin imports the one step function
    monkeypatch.setattr(dflash_step, "sample_terms", recorded)
    monkeypatch.setattr(training_model, "sample_terms", recorded)  # its module-level name, seen by forward
    monkeypatch.setattr(DFlashDraftModel, "forward", counted_forward)  # DFlash2DraftModel inherits it

    # the plugin: one micro-step of the module SpecForge wraps (one process, the store's first sample)
    where["path"] = "plugin"
    make_stores(str(tmp_path))
    tm = _training_model(str(tmp_path))
    try:
        numerator, denominator, stats = tm(sample_index=torch.tensor([0]), global_step=0)
        numerator.backward()
    finally:
        tm.close()
    assert calls["plugin"] == 1 and float(denominator) > 0 and "accepted" in stats

    # the benchmark: its timed step (run_ours: prefetched plans, drafter_step), one process, tiny shape
    where["path"] = "bench"
    bench = _bench_module()
    args = bench.parse_args(["--smoke", "--warmup", "1", "--max-warmup", "1", "--iters", "1", "--no-components"])
    env = bench.Env(args)
    _, config = bench.build_config(args)
    model = bench.make_model(config, env, args.seed)
    head, embed = bench.frozen_target(config, env, args.seed)
    record = bench.run_ours("csbp", 256, 13, config, model, head, embed, env, args)
    assert record["step_ms"] > 0 and calls["bench"] >= 2  # warm-up + timed steps, one sequence each
    assert forwards["outside"] == 0 and forwards["inside"] == calls["plugin"] + calls["bench"]

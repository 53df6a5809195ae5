"""`csbp.keep_logits_gib` unset: chosen from the GPU's free memory (mocked here) and the planner's memory model;
an explicit value is kept; a launcher of several ranks leaves the choice to its workers; no GPU -> 0."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from specforge_csbp.plugin import keep_logits
from specforge_csbp.plugin.keep_logits import HEADROOM_GIB, HEADROOM_SHARE, choose_keep_logits_gib, predicted_step
from specforge_csbp.plugin.options import prepare_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRAFTER = os.path.join(ROOT, "examples", "quickstart_drafter.json")
GiB = float(1 << 30)


def _write(tmp_path, nproc=1, csbp=None, max_length=2048, anchors=64):
    raw = {
        "model": {"target_model_path": str(tmp_path / "target"), "draft_model_config": DRAFTER, "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(tmp_path / "store"), "max_length": max_length},
        "training": {"strategy": "dflash2", "fsdp_sharding": "NO_SHARD", "num_anchors": anchors},
        "deployment": {"trainer": {"nproc_per_node": nproc}},
    }  # fmt: skip
    if csbp is not None:
        raw["csbp"] = csbp
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


class FakeGPU:
    """torch.cuda's free-memory query, mocked: `free_gib` on every device; records the devices asked."""

    def __init__(self, monkeypatch, free_gib: float, count: int = 1):
        self.asked: list[int] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

        def mem_get_info(device=None):
            self.asked.append(int(device))
            return int(free_gib * GiB), int(141 * GiB)

        monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)


def test_choice_is_the_budget_left_when_the_logits_fit():
    step = 40.0
    budget = 139.0 - step - (HEADROOM_GIB + HEADROOM_SHARE * step)
    assert choose_keep_logits_gib(139.0, step, 3.6) == pytest.approx(budget, abs=0.01)
    assert choose_keep_logits_gib(139.0, step, budget + 0.1) == 0.0  # do not fit: recompute
    assert choose_keep_logits_gib(step + 1.0, step, 0.5) == 0.0  # no budget after the headroom
    assert choose_keep_logits_gib(139.0, step, 0.0) == 0.0  # nothing to keep


def test_prediction_follows_the_planner(tmp_path):
    run = prepare_run(_write(tmp_path), [], csbp=True, cp_size=1)  # CPU: resolved to 0, no query
    small, logits = predicted_step(run.config, run.options, 1, "csbp")
    # this rank's logits: every anchor's S - 1 supervised rows x vocab, bf16 (quickstart: S = 4, V = 512)
    assert logits == pytest.approx(64 * 3 * 512 * 2 / GiB)
    longer = prepare_run(_write(tmp_path, max_length=8192), [], csbp=True, cp_size=1)
    assert predicted_step(longer.config, longer.options, 1, "csbp")[0] > small > 0
    no_prefetch = prepare_run(_write(tmp_path), ["csbp.prefetch_features=false"], csbp=True, cp_size=1)
    assert predicted_step(no_prefetch.config, no_prefetch.options, 1, "csbp")[0] < small


def test_unset_or_auto_is_chosen_from_free_memory(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gpu = FakeGPU(monkeypatch, free_gib=100.0)
    run = prepare_run(_write(tmp_path), [], csbp=True, cp_size=1)
    step, logits = predicted_step(run.config, run.options, 1, "csbp")
    assert run.options.keep_logits_gib == choose_keep_logits_gib(100.0, step, logits) > 0
    assert gpu.asked == [0]
    assert "csbp.keep_logits_gib auto ->" in capsys.readouterr().out
    for spelled in (["csbp.keep_logits_gib=auto"], []):
        path = _write(tmp_path, csbp={"keep_logits_gib": "auto"}) if not spelled else _write(tmp_path)
        assert prepare_run(path, spelled, csbp=True, cp_size=1).options.keep_logits_gib == run.options.keep_logits_gib
    # too little free memory for the step and its headroom: recompute
    FakeGPU(monkeypatch, free_gib=step + HEADROOM_GIB)
    assert prepare_run(_write(tmp_path), [], csbp=True, cp_size=1).options.keep_logits_gib == 0.0


def test_explicit_value_is_kept_and_nothing_is_queried(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gpu = FakeGPU(monkeypatch, free_gib=100.0)
    assert prepare_run(_write(tmp_path), ["csbp.keep_logits_gib=0"], csbp=True, cp_size=1).options.keep_logits_gib == 0.0
    assert prepare_run(_write(tmp_path, csbp={"keep_logits_gib": 6}), [], csbp=True).options.keep_logits_gib == 6.0
    assert gpu.asked == []


def test_launcher_of_several_ranks_leaves_it_to_the_workers(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gpu = FakeGPU(monkeypatch, free_gib=100.0, count=2)
    assert prepare_run(_write(tmp_path, nproc=2), [], csbp=True).options.keep_logits_gib == 0.0
    assert gpu.asked == []  # no CUDA context in the launching process
    monkeypatch.setenv("LOCAL_RANK", "1")  # a torchrun worker: its own GPU
    assert prepare_run(_write(tmp_path, nproc=2), [], csbp=True).options.keep_logits_gib > 0
    assert gpu.asked == [1]


def test_no_gpu_recomputes(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert prepare_run(_write(tmp_path), [], csbp=True, cp_size=1).options.keep_logits_gib == 0.0
    assert keep_logits.resolve_keep_logits(None, None, 1, "csbp").reason == "no GPU: recomputed"


def test_prediction_counts_the_samples_the_look_ahead_builds(tmp_path):
    """A batch of short samples is read ahead as a whole while it fits AHEAD_TOKENS (plugin/training_model.py):
    its features count once per sample it holds, never more than AHEAD_TOKENS of them."""
    from specforge_csbp.plugin.training_model import AHEAD_TOKENS

    def features_part(*overrides):
        run = prepare_run(_write(tmp_path), list(overrides), csbp=True, cp_size=1)
        off = prepare_run(_write(tmp_path), [*overrides, "csbp.prefetch_features=false"], csbp=True, cp_size=1)
        return predicted_step(run.config, run.options, 1, "csbp")[0] - predicted_step(off.config, off.options, 1, "csbp")[0]

    one = features_part()
    assert one > 0
    assert features_part("training.batch_size=4") == pytest.approx(4 * one)
    assert features_part("training.batch_size=1000") == pytest.approx(AHEAD_TOKENS // 2048 * one)

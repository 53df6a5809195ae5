"""Exact resume: a run whose rank is SIGKILLed mid-step, or whose saving rank is SIGKILLed mid-checkpoint,
resumed from its last checkpoint repeats the uninterrupted run's trajectory: loss, lr and gradient norm of
every step to 1e-12, and the final weights and AdamW state (CPU, float64, CSBP over 2 gloo ranks).

The workload draws from the global torch RNG in every loss, so RNG state matters as much as the weights,
the optimizer moments, the schedule and the data position (the step).

    uninterrupted   1 2 3 4 5                       (steps; checkpoint after each)
    killed rank 1     1 2 3x           resumed from step_2:  3 4 5
    killed saver      1 2 3 [save 3x]  resumed from step_2:  3 4 5   (latest still names step_2)
"""

from __future__ import annotations

import pytest
import torch

from specforge_csbp.distributed import spawn
from specforge_csbp.distributed.launch import RankFailure
from tests.support.reliability_runs import log, max_rel, run_recipe, weights

STEPS = 5
COMMON = [f"train.steps={STEPS}", "parallel.mode=csbp", "parallel.cp_degree=2"]
TOL = 1e-12


def _run(rank, world, out, fault):
    run_recipe(COMMON + [f"train.output_dir={out}"], fault=fault, jitter=True)


def _uninterrupted_then_resume(rank, world, runs):
    for out in runs:  # the first has no checkpoint yet (a fresh run); the others resume from `latest`
        run_recipe(COMMON + [f"train.output_dir={out}"], jitter=True)


def _optimizer(run):
    state = torch.load(run / (run / "latest").read_text() / "optimizer.pt")
    return state["optimizer"]["state"], state["scheduler"]


def test_killed_runs_resume_on_the_uninterrupted_trajectory(tmp_path):
    killed, saver, ref = tmp_path / "killed", tmp_path / "saver", tmp_path / "ref"
    with pytest.raises(RankFailure, match="^rank 1 was killed by signal SIGKILL$") as err:
        spawn(_run, 2, str(killed), {"kind": "kill", "rank": 1, "step": 2})
    assert err.value.rank == 1
    assert (killed / "latest").read_text() == "step_00000002"
    assert [m["step"] for m in log(killed)] == [1, 2]
    with open(killed / "log.jsonl", "a") as f:  # as if the kill had also cut a log line short
        f.write('{"step": 3, "loss": 4.1')

    with pytest.raises(RankFailure, match="^rank 0 was killed by signal SIGKILL$"):
        spawn(_run, 2, str(saver), {"kind": "kill_save", "rank": 0, "step": 3})
    # the save was cut after the model files: a temporary directory no pointer names
    assert (saver / "latest").read_text() == "step_00000002"
    partial = saver / ".step_00000003.tmp"
    assert (partial / "model.safetensors").exists() and not (partial / "manifest.json").exists()
    assert not (saver / "step_00000003").exists()
    assert [m["step"] for m in log(saver)] == [1, 2, 3]  # step 3 ran and was logged, its save was not

    spawn(_uninterrupted_then_resume, 2, [str(ref), str(killed), str(saver)])
    expected = log(ref)
    assert [m["step"] for m in expected] == list(range(1, STEPS + 1))
    assert not (saver / ".step_00000003.tmp").exists()  # the next save removed the partial one
    for run in (killed, saver):
        got = log(run)
        assert [m["step"] for m in got] == list(range(1, STEPS + 1)), run  # one line per step
        for a, b in zip(got, expected):
            for key in ("loss", "lr", "grad_norm"):
                assert abs(a[key] - b[key]) <= TOL * abs(b[key]), (run.name, a["step"], key, a[key], b[key])
        assert max_rel(weights(run), weights(ref)) <= TOL
        # what resuming needed was restored, not re-derived: the moments and the schedule position
        moments, sched = _optimizer(run)
        ref_moments, ref_sched = _optimizer(ref)
        assert sched == ref_sched
        for i, s in ref_moments.items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(moments[i][k], s[k], rtol=TOL, atol=0), (run.name, i, k)
    assert max_rel(weights(ref), weights(ref, 4)) > 1e-4  # the last step moved the weights

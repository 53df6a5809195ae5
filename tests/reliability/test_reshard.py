"""Resharding: a checkpoint written under CSBP with P = 4 resumes under CSBP P = 2, a single process
(P = 1), DP 2 x CSBP 2 and DP 2 x reference (other data-parallel degrees, same global batch) with the
exact checkpoint weights and the next-step loss, learning rate, gradient norm and weights of the P = 4
continuation (float64; relative 1e-10).

    P = 4 run:  step 1 -> step_1 -> step 2 (the continuation)
                             \\-> resume under P = 2 | P = 1 | dp 2 x cp 2 | dp 2 x cp 1  -> step 2
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from specforge_csbp.distributed import spawn
from tests.support.reliability_runs import log, max_rel, run_recipe, seed_resume, weights
from tests.support.spawned import one_rank_group

TOL = 1e-10
BATCH = 2  # sequences per step (global batch), kept in every layout
LAYOUTS = {
    "p4": ["parallel.cp_degree=4", f"train.micro_batch_size={BATCH}"],
    "dp2cp2": ["parallel.cp_degree=2", "parallel.dp_degree=2", f"train.micro_batch_size={BATCH // 2}"],
    "p2": ["parallel.cp_degree=2", f"train.micro_batch_size={BATCH}"],
    "dp2": ["parallel.cp_degree=1", "parallel.dp_degree=2", f"train.micro_batch_size={BATCH // 2}"],
    "p1": ["parallel.cp_degree=1", "parallel.mode=reference", f"train.micro_batch_size={BATCH}"],
}
COMMON = ["train.steps=2", "parallel.mode=csbp"]


def _resume(root, name):
    out = root / name
    run_recipe(COMMON + LAYOUTS[name] + [f"train.output_dir={out}"], record_load=str(out / "loaded.pt"))


def _four_ranks(rank, world, root):
    from pathlib import Path

    root = Path(root)
    run_recipe(COMMON + LAYOUTS["p4"] + [f"train.output_dir={root / 'p4'}"])
    if rank == 0:
        seed_resume(root / "p4", 1, root / "dp2cp2")
    dist.barrier()
    _resume(root, "dp2cp2")


def _two_ranks(rank, world, root):
    from pathlib import Path

    for name in ("p2", "dp2"):
        _resume(Path(root), name)


def test_p4_checkpoint_resumes_under_other_layouts(tmp_path):
    spawn(_four_ranks, 4, str(tmp_path))
    for name in ("p2", "dp2", "p1"):
        seed_resume(tmp_path / "p4", 1, tmp_path / name)
    spawn(_two_ranks, 2, str(tmp_path))
    with one_rank_group():
        _resume(tmp_path, "p1")

    checkpoint = weights(tmp_path / "p4", 1)
    continuation = log(tmp_path / "p4")[1]
    assert continuation["step"] == 2
    assert max_rel(weights(tmp_path / "p4", 2), checkpoint) > 1e-4  # step 2 moved the weights
    for name in ("dp2cp2", "p2", "dp2", "p1"):
        run = tmp_path / name
        loaded = torch.load(run / "loaded.pt")
        assert all(torch.equal(loaded[k], checkpoint[k]) for k in checkpoint), name  # identical weights
        (step2,) = log(run)
        assert step2["step"] == 2
        for key in ("loss", "lr", "grad_norm", "denominator"):
            assert abs(step2[key] - continuation[key]) <= TOL * abs(continuation[key]), (name, key)
        assert max_rel(weights(run), weights(tmp_path / "p4", 2)) <= TOL, name

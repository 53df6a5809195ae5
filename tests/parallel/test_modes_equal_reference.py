"""CSBP, CP and BP equal the single-process reference (out, lse, dq, dk, dv) on gloo ranks, float64.

One spawn per world size runs the whole case matrix; results come back as JSON.
"""

import json
import os

import pytest

from specforge_csbp.distributed import spawn
from specforge_csbp.layout.zigzag import ZigzagShards
from specforge_csbp.parallel.check import CheckCase, run_check
from tests.support.spawned import save_results, spawn_results

# (L, S): B = L/S blocks chosen per P to include B % P != 0 and P <= B < 2P.
SHAPES = {
    1: [(12, 4), (40, 8)],
    2: [(12, 4), (40, 8), (36, 4)],  # B = 3 (P <= B < 2P), 5 (odd), 9
    3: [(16, 4), (40, 4), (28, 4)],  # B = 4 (P <= B < 2P), 10, 7
    4: [(20, 4), (56, 8), (36, 4)],  # B = 5, 7, 9
}
HEADS = [(4, 2), (3, 3)]  # GQA and MHA
TOL = 1e-10


def _cases(world):
    for mode in ("csbp", "cp", "bp"):
        for i, (L, S) in enumerate(SHAPES[world]):
            for rule in ("causal", "bidirectional"):
                h, k = HEADS[i % 2]
                # the fused schedule (one seam call, no merge) on alternating cases; BP has no gather;
                # GQA head packing (a layout transform inside the seam) on the GQA causal cases
                schedule = "fused" if (i + (rule == "causal")) % 2 and mode != "bp" else "overlap"
                yield CheckCase(mode, L, S, heads=h, kv_heads=k, head_dim=8, clean_within_block=rule, batch=2,
                                seed=i, schedule=schedule, regather=schedule == "overlap" and i == 1,
                                pack_gqa=True if h != k and rule == "causal" else None)  # fmt: skip


def _worker(rank, world, out_dir):
    results = []
    for case in _cases(world):
        r = run_check(case)
        if rank == 0:
            results.append({"case": repr(case), "errors": r.errors, "bytes": r.bytes_sent})
    if rank == 0:
        save_results(out_dir, results)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_mode_equals_the_reference(world, tmp_path):
    results = spawn_results(_worker, world, tmp_path)
    assert len(results) == len(list(_cases(world)))
    for res in results:
        for name, err in res["errors"].items():
            assert err <= TOL, f"{res['case']}: {name} max relative error {err:.3e}"


def _bytes_worker(rank, world, out_dir):
    out = {}
    for mode in ("csbp", "cp", "bp"):
        r = run_check(CheckCase(mode, 48, 4, heads=4, kv_heads=2, head_dim=8, batch=1))
        if rank == 0:
            out[mode] = r.bytes_sent
    if rank == 0:
        with open(os.path.join(out_dir, "bytes.json"), "w") as f:
            json.dump(out, f)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_csbp_moves_only_clean_kv_and_cp_moves_both_copies(world, tmp_path):
    spawn(_bytes_worker, world, str(tmp_path))
    sent = json.loads((tmp_path / "bytes.json").read_text())
    L, S, kv_heads, head_dim, fp64 = 48, 4, 2, 8, 8
    zig = ZigzagShards(L, S, world)
    shard = zig.rank_positions(0).numel()  # 12 blocks: equal shards for P = 2, 3, 4
    assert all(zig.rank_positions(r).numel() == shard for r in range(world))
    clean_kv_bytes = 2 * shard * kv_heads * head_dim * fp64  # K and V of one clean shard
    for rank in range(world):
        # forward: my clean K/V to each other rank; backward: their dK/dV shards back to their owners
        assert sent["csbp"][rank] == {"all_gather": (world - 1) * clean_kv_bytes, "reduce_scatter": (world - 1) * clean_kv_bytes}
        assert sent["cp"][rank] == {k: 2 * v for k, v in sent["csbp"][rank].items()}  # both copies
        assert sent["bp"][rank] == {}


def _regather_worker(rank, world, out_dir):
    """Is the gathered K/V buffer still alive after forward (held for backward)?"""
    import gc
    import time
    import weakref

    import torch

    from specforge_csbp.distributed import collectives
    from specforge_csbp.layout import bdlm_plan
    from specforge_csbp.parallel import AttentionOptions, ShardedAttention

    buffers = []  # a weak reference to each gather's buffer: what the all-gather's start returned
    start = collectives._Start.apply

    def recording(shard, pending):
        out = start(shard, pending)
        buffers.append(weakref.ref(out))
        return out

    collectives._Start.apply = recording  # this spawned process only
    alive = {}
    for schedule, regather in (("overlap", False), ("overlap", True), ("fused", False)):
        plan = bdlm_plan("csbp", 32, 4, world)[rank]
        attn = ShardedAttention(plan, 4, options=AttentionOptions(regather=regather, schedule=schedule))
        q = torch.randn(1, 2, len(plan.q_rows), 8, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, 2, len(plan.kv_rows), 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
        out, lse = attn(q, k, v)
        # a finished gloo collective's worker thread may hold the buffer a moment longer: a buffer nothing in
        # the graph holds is gone within the second, one held for backward stays
        deadline = time.monotonic() + 1.0
        while buffers[-1]() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        alive[f"{schedule}-{regather}"] = buffers[-1]() is not None
        out.sum().backward()  # still runs (and re-gathers) after the buffer is gone
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(alive, f)


def test_regather_frees_the_gathered_kv_after_forward(tmp_path):
    spawn(_regather_worker, 2, str(tmp_path))
    for rank in range(2):
        # overlap keeps the gathered buffer for backward unless it re-gathers; fused keeps the concatenation
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == {
            "overlap-False": True, "overlap-True": False, "fused-False": False
        }


def test_schedule_choice_and_its_errors():
    from specforge_csbp.parallel.sharded_attention import resolve_schedule

    assert resolve_schedule(None) == "fused" and resolve_schedule(None, regather=True) == "overlap"
    assert resolve_schedule("overlap") == "overlap"
    with pytest.raises(ValueError, match="^schedule must be one of fused, overlap; got 'ring'$"):
        resolve_schedule("ring")
    with pytest.raises(ValueError, match="^regather needs schedule 'overlap'"):
        resolve_schedule("fused", regather=True)

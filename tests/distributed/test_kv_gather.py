"""KVGather against ground truth on 3 gloo ranks (float64, bit for bit): every rank can regenerate every
rank's K, V, shared rows and upstream gradients from seeds, so the gathered segments, the fused schedule's
concatenation and the gradients that come back to each rank's own K and V (through the reduce-scatter) are
checked against values computed without any collective. Shared rows as an index (padded to the widest
shard) and as a slice; the own segment sits first, in the middle and last."""

import pytest
import torch

from specforge_csbp.distributed.collectives import CommStats, KVGather
from tests.support.spawned import save_results, spawn_results

WORLD = 3


def _rank_data(r, rows_kind):
    g = torch.Generator().manual_seed(100 + r)
    local = 7 + r
    k, v = (torch.randn(1, 2, local, 4, generator=g, dtype=torch.float64) for _ in "kv")
    rows = slice(0, local - 1) if rows_kind == "slice" else torch.randperm(local, generator=g)[: 3 + r]
    return k, v, rows


def _row_index(rows):
    return torch.arange(*rows.indices(1 << 20)) if isinstance(rows, slice) else rows


def _width(rows_kind):
    return max(len(_row_index(_rank_data(r, rows_kind)[2])) for r in range(WORLD))


def _segment(r, rows_kind, width):
    k, v, rows = _rank_data(r, rows_kind)
    out = []
    for t in (k, v):
        sel = t[:, :, rows]
        out.append(torch.cat([sel, sel.new_zeros(1, 2, width - sel.shape[2], 4)], dim=2))
    return out


def _weights(r, shape, salt):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + r), dtype=torch.float64)


def _expected(rank, rows_kind, how):
    """(outputs, dk, dv) of `rank` computed from every rank's regenerated data, no collective."""
    width = _width(rows_kind)
    k, v, rows = _rank_data(rank, rows_kind)
    segs = [_segment(r, rows_kind, width) for r in range(WORLD)]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    if how == "concat":
        outs = [torch.cat([t] + [segs[r][i] for r in range(WORLD) if r != rank], dim=2) for i, t in enumerate((k, v))]
        mine = [_weights(rank, o.shape, salt=1 + i) for i, o in enumerate(outs)]
        dk += mine[0][:, :, : k.shape[2]]
        dv += mine[1][:, :, : v.shape[2]]
    else:
        outs = [t for seg in segs for t in seg]
    # the gradient every rank sent back for my segment
    for r in range(WORLD):
        if how == "concat":
            if r == rank:
                continue
            r_local = _rank_data(r, rows_kind)[0].shape[2]
            slot = [o for o in range(WORLD) if o != r].index(rank)
            lo = r_local + slot * width
            r_outs = [r_local + (WORLD - 1) * width] * 2
            grads = [_weights(r, (1, 2, n, 4), salt=1 + i)[:, :, lo : lo + width] for i, n in enumerate(r_outs)]
        else:
            grads = [_weights(r, (1, 2, width, 4), salt=10 * (rank + 1) + i) for i in range(2)]
        idx = _row_index(rows)
        n = len(idx)
        dk.index_add_(2, idx, grads[0][:, :, :n])
        dv.index_add_(2, idx, grads[1][:, :, :n])
    return outs, dk, dv


def _worker(rank, world, out_dir):
    import torch.distributed as dist

    results = {}
    for rows_kind in ("index", "slice"):
        for how in ("concat", "segments"):
            k, v, rows = _rank_data(rank, rows_kind)
            k.requires_grad_(), v.requires_grad_()
            handle = KVGather(dist.group.WORLD, stats=CommStats()).start(k, v, rows, _width(rows_kind))
            if how == "concat":
                outs = list(handle.concat(k, v, rank))
                loss = sum((o * _weights(rank, o.shape, salt=1 + i)).sum() for i, o in enumerate(outs))
            else:
                segs = handle.segments()
                outs = [t for seg in segs for t in seg]
                # every segment weighted with weights seeded by (this rank, segment)
                loss = sum((t * _weights(rank, t.shape, salt=10 * (s + 1) + i)).sum()
                           for s, seg in enumerate(segs) for i, t in enumerate(seg))  # fmt: skip
            loss.backward()
            want, dk, dv = _expected(rank, rows_kind, how)
            results[f"{rows_kind}-{how}"] = [bool(torch.equal(a.detach(), b)) for a, b in zip(outs, want)] + [
                bool(torch.allclose(k.grad, dk, rtol=0, atol=1e-12)), bool(torch.allclose(v.grad, dv, rtol=0, atol=1e-12))
            ]  # fmt: skip
    every = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:
        save_results(out_dir, every)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, WORLD, tmp_path_factory.mktemp("kv_gather"))


@pytest.mark.parametrize("case", ["index-concat", "slice-concat", "index-segments", "slice-segments"])
def test_gathered_kv_and_returned_gradients_equal_ground_truth(results, case):
    for rank, res in enumerate(results):
        assert res[case] and all(res[case]), (rank, case, res[case])

"""KVGather's two buffer layouts carry the same rows: the fused schedule's "heads" concat() equals the
"tokens" layout's wait() views concatenated with torch.cat, forward and backward, bit for bit (float64, gloo,
3 ranks so the own segment sits first, in the middle and last; shared rows as an index with padding and as a
slice)."""

import pytest
import torch
from spawned import save_results, spawn_results

from specforge_csbp.distributed.collectives import CommStats, KVGather


def _case(rank, world, rows_kind):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(100 + rank)
    local = 7 + rank  # unequal local rows: segments are padded to the widest shard
    k, v = (torch.randn(1, 2, local, 4, generator=g, dtype=torch.float64) for _ in "kv")
    if rows_kind == "slice":
        n, rows = local - 1, slice(0, local - 1)
    else:
        n = 3 + rank
        rows = torch.randperm(local, generator=g)[:n]
    width = (6 if rows_kind == "slice" else 3) + world - 1  # the last rank shares the most rows
    grads = torch.Generator().manual_seed(7)
    out = {}
    for layout in ("tokens", "heads"):
        kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
        handle = KVGather(dist.group.WORLD, stats=CommStats(), layout=layout).start(kk, vv, rows, width)
        if layout == "tokens":
            k_all, v_all = handle.wait()
            lo, hi = rank * width, (rank + 1) * width
            k_cat = torch.cat([kk, k_all[:, :, :lo], k_all[:, :, hi:]], dim=2)
            v_cat = torch.cat([vv, v_all[:, :, :lo], v_all[:, :, hi:]], dim=2)
        else:
            k_cat, v_cat = handle.concat(kk, vv, rank)
        wk = torch.randn(k_cat.shape, generator=grads.manual_seed(11 + rank), dtype=torch.float64)
        wv = torch.randn(v_cat.shape, generator=grads.manual_seed(13 + rank), dtype=torch.float64)
        ((k_cat * wk).sum() + (v_cat * wv).sum()).backward()
        out[layout] = (k_cat.detach(), v_cat.detach(), kk.grad, vv.grad)
    return out


def _worker(rank, world, out_dir):
    results = {}
    for rows_kind in ("index", "slice"):
        out = _case(rank, world, rows_kind)
        results[rows_kind] = [bool(torch.equal(a, b)) for a, b in zip(out["tokens"], out["heads"])]
        results[rows_kind + "_grad_nonzero"] = bool(out["heads"][2].abs().sum() > 0)
    # the wrong accessor for a layout is a one-line error
    import torch.distributed as dist

    k = torch.zeros(1, 1, 2, 2)
    errors = []
    for layout, call in (("heads", lambda h: h.wait()), ("tokens", lambda h: h.concat(k, k, rank))):
        try:
            call(KVGather(dist.group.WORLD, layout=layout).start(k, k, slice(0, 2), 2))
        except ValueError as e:
            errors.append(str(e))
    try:
        KVGather(dist.group.WORLD, layout="rows")
    except ValueError as e:
        errors.append(str(e))
    results["errors"] = errors
    every = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:
        save_results(out_dir, every)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, 3, tmp_path_factory.mktemp("gather_layouts"))


def test_heads_concat_equals_tokens_views_concatenated(results):
    for rank, res in enumerate(results):  # own segment first, in the middle, last
        for rows_kind in ("index", "slice"):
            # k_cat, v_cat, dk, dv identical
            assert res[rows_kind] == [True, True, True, True], (rank, rows_kind)
            assert res[rows_kind + "_grad_nonzero"]


def test_wrong_layout_accessors_are_one_line_errors(results):
    wait_err, concat_err, layout_err = results[0]["errors"]
    assert "wait() needs layout 'tokens'" in wait_err and "\n" not in wait_err
    assert "concat() needs layout 'heads'" in concat_err
    assert layout_err == "layout must be one of tokens, heads; got 'rows'"

"""Reversed query order (attention/order.py) computes the same function as row order.

Dense backend, float64, with autograd: out, lse and dq/dk/dv with REVERSE_QUERIES on equal it off over BDLM
and drafter plans (every mode, GQA packed and unpacked, row counts not multiples of a tile); eager
FlexAttention on CPU (forward) checks the reversed block masks; the reversed view is cached and is the
documented permutation.
"""

import pytest
import torch

from specforge_csbp.attention import order, partial_attention
from specforge_csbp.attention.order import reversed_queries
from specforge_csbp.masks import Visibility
from tests.attention.test_gqa_packing import (
    HEAD_DIM,
    KV_HEADS,
    _bdlm_visibilities,
    _drafter_visibilities,
    _rel,
    _run,
)


@pytest.fixture
def reverse(monkeypatch):
    def set_to(on: bool):
        monkeypatch.setattr(order, "REVERSE_QUERIES", on)

    return set_to


@pytest.mark.parametrize("source", ["bdlm", "drafter"])
def test_reversed_equals_row_order_dense_float64_with_grads(source, reverse):
    g = torch.Generator().manual_seed(3)
    cases = list(_bdlm_visibilities() if source == "bdlm" else _drafter_visibilities())[::2]
    for name, vis in cases:
        for groups, pack in ((1, False), (2, True), (4, False), (4, True)):
            q = torch.randn(2, KV_HEADS * groups, len(vis.q), HEAD_DIM, generator=g, dtype=torch.float64)
            k, v = torch.randn(2, 2, KV_HEADS, len(vis.k), HEAD_DIM, generator=g, dtype=torch.float64)
            reverse(False)
            plain = _run(vis, q, k, v, pack)
            reverse(True)
            flipped = _run(vis, q, k, v, pack)
            lse, lse_r = plain[1], flipped[1]
            assert torch.equal(lse.isinf(), lse_r.isinf()), name
            fin = lse.isfinite()
            assert fin.any() and _rel(lse_r[fin], lse[fin]) <= 1e-12, name
            for what, a, b in zip(("out", "dq", "dk", "dv"), flipped[:1] + flipped[2:], plain[:1] + plain[2:]):
                assert _rel(a, b) <= 1e-12, f"{name} G={groups} pack={pack} {what}: {_rel(a, b)}"


def test_reversed_view_is_the_documented_permutation():
    vis = next(iter(_drafter_visibilities()))[1]
    rev = reversed_queries(vis)
    assert rev is reversed_queries(vis)  # cached on the Visibility object
    n = len(vis.q)
    assert torch.equal(rev.q.pos, vis.q.pos.flip(0)) and torch.equal(rev.q.kind, vis.q.kind.flip(0))
    assert rev.k is vis.k and (rev.window, rev.noisy_causal, rev.block_size) == (vis.window, vis.noisy_causal, vis.block_size)
    fresh = Visibility(rev.q, rev.k, rev.block_size, rev.clean_within_block, rev.window, rev.noisy_causal)
    assert torch.equal(rev.dense(), fresh.dense())  # the seeded ranges are the rule's own
    assert torch.equal(rev.dense(), vis.dense().flip(0)) and rev.dense().shape[0] == n


def test_flex_reversed_forward_equals_dense(eager_flex, reverse):
    g = torch.Generator().manual_seed(4)
    cases = [c for i, c in enumerate(_drafter_visibilities()) if i % 4 == 0] + list(_bdlm_visibilities())[::7]
    for name, vis in cases:
        for groups, pack in ((2, True), (4, False)):
            q = torch.randn(1, KV_HEADS * groups, len(vis.q), HEAD_DIM, generator=g)
            k, v = torch.randn(2, 1, KV_HEADS, len(vis.k), HEAD_DIM, generator=g)
            reverse(False)
            with torch.no_grad():
                out_d, lse_d = partial_attention(q, k, v, vis, backend="dense", pack_gqa=False)
            reverse(True)
            with torch.no_grad():
                out_f, lse_f = partial_attention(q, k, v, vis, backend="flex", pack_gqa=pack)
            seen = lse_d.isfinite()
            assert torch.equal(seen, lse_f.isfinite()), name
            assert torch.allclose(out_f, out_d, atol=2e-6, rtol=0), name
            assert torch.allclose(lse_f[seen], lse_d[seen], atol=2e-6, rtol=0), name

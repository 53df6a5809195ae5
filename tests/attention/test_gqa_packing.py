"""GQA head packing (attention/packing.py) computes the same function as the unpacked seam.

Dense backend, float64, with autograd: out, lse and dq/dk/dv of pack_gqa=True equal pack_gqa=False over
BDLM plans (every mode, both clean rules, uneven sizes) and DFlash drafter plans (sliding + full layers,
causal and bidirectional draft blocks, row buckets), G in {1, 2, 3, 4}, row counts not multiples of the
chunk. Eager FlexAttention on CPU (forward: the compiled CPU kernel cannot return the LSE) checks the
packed block masks. The automatic rule packs a drafter sliding-window plan because its tile count drops.
"""

import pytest
import torch

from specforge_csbp.attention import partial_attention, prepare_attention
from specforge_csbp.attention.flex import block_mask_for, tile_visits
from specforge_csbp.attention.packing import (
    TILE,
    chunk_rows,
    pack_q,
    packed_visibility,
    should_pack,
    tile_counts,
    unpack,
)
from specforge_csbp.layout import bdlm_plan
from specforge_csbp.masks import Visibility
from specforge_csbp.models.dflash import drafter_plans, make_dflash_config
from specforge_csbp.objectives.dflash import DFlashObjective, sample_anchors

KV_HEADS, HEAD_DIM = 2, 8


def _bdlm_visibilities():
    # uneven: 13 or 27 blocks over 3 ranks; row counts are no multiples of c in {32, 64, 128}
    for mode, L, S, P in [
        ("reference", 13 * 5, 5, 1),
        ("csbp", 27 * 4, 4, 3),
        ("cp", 13 * 8, 8, 3),
        ("bp", 27 * 4, 4, 2),
    ]:
        for rule in ("causal", "bidirectional"):
            for plan in bdlm_plan(mode, L, S, P):
                yield f"{mode}/{rule}/r{plan.rank}", Visibility(plan.q_tokens, plan.kv_tokens, S, rule)
                if plan.communicates:
                    yield (
                        f"{mode}/{rule}/r{plan.rank}/remote",
                        Visibility(plan.q_tokens, plan.remote_kv_tokens, S, rule),
                    )


def _drafter_config(is_causal, *, heads=4, kv_heads=2, window=37, block=4):
    return make_dflash_config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=HEAD_DIM, vocab_size=61, num_target_layers=6,
        target_layer_ids=[1, 4], mask_token_id=60, block_size=block,
        layer_types=["sliding_attention", "full_attention"], sliding_window=window, is_causal=is_causal,
    )  # fmt: skip


def _drafter_visibilities():
    L = 300
    for is_causal in (None, False):
        cfg = _drafter_config(is_causal)
        anchors = sample_anchors(torch.ones(L), DFlashObjective(num_anchors=13), block_size=4)
        for mode, P, bucket in [("reference", 1, 1), ("csbp", 2, 64), ("cp", 3, 1), ("csbp", 3, 1)]:
            for plan in drafter_plans(mode, L, anchors, cfg, P, bucket=bucket):
                for kind, lp in plan.layers.items():
                    sh, rule = lp.shard, {"window": lp.window, "noisy_causal": lp.noisy_causal}
                    name = f"{mode}/{kind}/causal={is_causal}/r{plan.rank}"
                    yield name, Visibility(sh.q_tokens, sh.kv_tokens, 4, **rule)
                    if sh.communicates:
                        yield name + "/remote", Visibility(sh.q_tokens, sh.remote_kv_tokens, 4, **rule)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _run(vis, q, k, v, pack):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = partial_attention(q, k, v, vis, backend="dense", pack_gqa=pack)
    # a loss through out and the finite lse (the lse gradient path is what the LSE merge uses)
    loss = (out * torch.cos(out)).sum() + torch.where(lse.isfinite(), lse, 0).square().sum()
    return (out, lse, *torch.autograd.grad(loss, (q, k, v)))


@pytest.mark.parametrize("source", ["bdlm", "drafter"])
def test_packed_equals_unpacked_dense_float64_with_grads(source):
    g = torch.Generator().manual_seed(0)
    cases = list(_bdlm_visibilities() if source == "bdlm" else _drafter_visibilities())
    chunks_seen = set()
    for i, (name, vis) in enumerate(cases):
        for groups in (1, 2, 4) if i % 4 else (1, 2, 3, 4):  # G = 3: c = tile, exact but never automatic
            h, nq, nk = KV_HEADS * groups, len(vis.q), len(vis.k)
            q = torch.randn(2, h, nq, HEAD_DIM, generator=g, dtype=torch.float64)
            k, v = torch.randn(2, 2, KV_HEADS, nk, HEAD_DIM, generator=g, dtype=torch.float64)
            plain, packed = _run(vis, q, k, v, False), _run(vis, q, k, v, True)
            out, lse = plain[0], plain[1]
            assert out.shape == packed[0].shape and lse.shape == packed[1].shape, name
            assert torch.equal(lse.isinf(), packed[1].isinf()), name  # rows that see nothing: same rows
            fin = lse.isfinite()
            assert fin.any(), name
            assert _rel(packed[1][fin], lse[fin]) <= 1e-12, name
            for what, a, b in zip(("out", "dq", "dk", "dv"), packed[:1] + packed[2:], plain[:1] + plain[2:]):
                assert _rel(a, b) <= 1e-12, f"{name} G={groups} {what}: {_rel(a, b)}"
            c = chunk_rows(groups)
            chunks_seen.add((c, nq % c != 0))
    assert {(128, True), (64, True), (32, True)} <= chunks_seen  # padded rows exercised for every c


def test_pack_layout_is_the_documented_permutation():
    b, kv, groups, rows, d, c = 2, 3, 4, 37, 5, 8
    q = torch.arange(b * kv * groups * rows * d, dtype=torch.float64).view(b, kv * groups, rows, d)
    p = pack_q(q, kv, c)
    n = -(-rows // c)
    assert p.shape == (b, kv, n * groups * c, d)
    for kh, j, gi, i in [(0, 0, 0, 0), (1, 2, 3, 5), (2, 4, 1, 4), (2, 4, 3, 7)]:
        row = j * c + i
        expect = q[:, kh * groups + gi, row] if row < rows else torch.zeros(b, d, dtype=q.dtype)
        assert torch.equal(p[:, kh, (j * groups + gi) * c + i], expect)
    assert torch.equal(unpack(p, groups, c, rows), q)
    assert torch.equal(unpack(p[..., 0], groups, c, rows), q[..., 0])
    vis = next(iter(_bdlm_visibilities()))[1]
    pv = packed_visibility(vis, 4)
    assert pv is packed_visibility(vis, 4)  # cached on the Visibility object
    assert pv.chunk == 32 and len(pv.vis.q) == 4 * 32 * -(-len(vis.q) // 32) and pv.vis.k is vis.k
    assert pv.vis.window == vis.window and pv.vis.clean_within_block == vis.clean_within_block
    assert pv.vis._cache is not vis._cache
    assert [chunk_rows(gr) for gr in (1, 2, 3, 4, 8, 16)] == [128, 64, 128, 32, 16, 8]


def test_tile_counts_masks_equal_block_mask_for():
    """One pass over chunks of c rows gives the same block masks as building each one from the rule."""
    for _, vis in list(_drafter_visibilities())[::5] + list(_bdlm_visibilities())[::7]:
        for groups in (2, 3, 4):
            fresh = Visibility(
                vis.q, vis.k, vis.block_size, vis.clean_within_block, vis.window, vis.noisy_causal
            )
            counts = tile_counts(fresh, groups, "cpu", tile=16)
            ours = (fresh._cache[("block_mask", "cpu", 16)], packed_visibility(fresh, groups, tile=16).vis)
            ours = (ours[0], ours[1]._cache[("block_mask", "cpu", 16)])
            pv = packed_visibility(fresh, groups, tile=16).vis
            for mine, src in zip(ours, (vis, pv)):
                again = Visibility(
                    src.q, src.k, src.block_size, src.clean_within_block, src.window, src.noisy_causal
                )
                ref = block_mask_for(again, torch.device("cpu"), tile=16)
                for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                    assert torch.equal(getattr(mine, f), getattr(ref, f)), f
            assert (counts.unpacked, counts.packed) == (tile_visits(ours[0]), tile_visits(ours[1]))


@pytest.mark.parametrize("pack", [True, None])
def test_flex_packed_forward_equals_dense(eager_flex, pack):
    g = torch.Generator().manual_seed(1)
    cases = [c for i, c in enumerate(_drafter_visibilities()) if i % 3 == 0] + list(_bdlm_visibilities())[::6]
    for name, vis in cases:
        for groups in (2, 4):
            q = torch.randn(1, KV_HEADS * groups, len(vis.q), HEAD_DIM, generator=g)
            k, v = torch.randn(2, 1, KV_HEADS, len(vis.k), HEAD_DIM, generator=g)
            with torch.no_grad():
                out_d, lse_d = partial_attention(q, k, v, vis, backend="dense", pack_gqa=False)
                out_f, lse_f = partial_attention(q, k, v, vis, backend="flex", pack_gqa=pack)
            seen = lse_d.isfinite()
            assert torch.equal(seen, lse_f.isfinite()), name
            assert torch.allclose(out_f, out_d, atol=2e-6, rtol=0), name
            assert torch.allclose(lse_f[seen], lse_d[seen], atol=2e-6, rtol=0), name


def test_auto_rule_packs_drafter_sliding_window_plan(eager_flex):
    """Sliding-window draft blocks (S = 16, 8 per 128-row tile) visit the union of 8 windows unpacked; packed
    with G = 4, a tile holds 2 blocks x 4 heads: fewer tiles x heads, so the automatic rule packs."""
    heads, kv_heads, L = 8, 2, 4096
    cfg = _drafter_config(None, heads=heads, kv_heads=kv_heads, window=256, block=16)
    anchors = sample_anchors(torch.ones(L), DFlashObjective(num_anchors=48), block_size=16)
    plan = drafter_plans("reference", L, anchors, cfg, 1)[0]
    lp = plan.layers["sliding_attention"]
    vis = Visibility(
        lp.shard.q_tokens, lp.shard.kv_tokens, 16, window=lp.window, noisy_causal=lp.noisy_causal
    )
    groups = heads // kv_heads
    counts = tile_counts(vis, groups, "cpu")
    assert counts.packed * kv_heads < counts.unpacked * heads  # tiles x heads drop ...
    assert counts.packed * kv_heads <= 0.6 * counts.unpacked * heads, counts  # ... by a lot here
    assert should_pack(vis, groups, "cpu") and not should_pack(vis, 1, "cpu")
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, heads, len(vis.q), HEAD_DIM, generator=g)
    k, v = torch.randn(2, 1, kv_heads, len(vis.k), HEAD_DIM, generator=g)
    with torch.no_grad():
        out, lse = partial_attention(q, k, v, vis, backend="flex")  # auto
        ref, ref_lse = partial_attention(q, k, v, vis, backend="dense", pack_gqa=False)
    packed = vis._cache[("gqa_packed", groups, TILE)].vis
    assert ("block_mask", "cpu", TILE) in packed._cache  # the packed path ran (and cached its mask)
    assert torch.allclose(out, ref, atol=2e-6, rtol=0) and torch.allclose(lse, ref_lse, atol=2e-6, rtol=0)
    # dense never packs by itself: its packed view is not even built
    fresh = Visibility(vis.q, vis.k, 16, window=lp.window, noisy_causal=lp.noisy_causal)
    partial_attention(q[..., :64, :], k, v, Visibility(vis.q.select(torch.arange(64)), vis.k, 16,
                      window=lp.window, noisy_causal=lp.noisy_causal), backend="dense")  # fmt: skip
    partial_attention(q, k, v, fresh, backend="dense")
    assert not any(key[0].startswith("gqa") for key in fresh._cache)


def test_packing_never_visits_more_tiles_and_auto_keeps_already_dense_tiles():
    """A packed tile (c rows x G heads) sees a subset of the keys of the 128-row tile holding its rows, so
    packed tiles never exceed G x unpacked ones. A BDLM reference plan with S = 128 already has tiles of one
    block each: packing changes nothing, and the automatic rule (strictly fewer) keeps it unpacked."""
    for _, vis in list(_bdlm_visibilities())[::3] + list(_drafter_visibilities())[::4]:
        for groups in (2, 4):
            counts = tile_counts(vis, groups, "cpu")
            assert counts.packed <= groups * counts.unpacked
    for rule in ("causal", "bidirectional"):
        plan = bdlm_plan("reference", 1024, 128, 1)[0]
        vis = Visibility(plan.q_tokens, plan.kv_tokens, 128, rule)
        counts = tile_counts(vis, 4, "cpu")
        assert counts.packed == 4 * counts.unpacked > 0
        assert not should_pack(vis, 4, "cpu")


def test_bad_pack_gqa_is_a_value_error():
    vis = next(iter(_bdlm_visibilities()))[1]
    q = torch.randn(1, 2, len(vis.q), 4)
    k = torch.randn(1, 1, len(vis.k), 4)
    with pytest.raises(ValueError, match="pack_gqa must be one of None, True, False"):
        partial_attention(q, k, k, vis, backend="dense", pack_gqa="yes")


@pytest.mark.parametrize("backend,pack", [("dense", False), ("dense", True), ("flex", None), ("flex", False)])
def test_prepare_builds_what_the_call_needs_and_nothing_changes(eager_flex, backend, pack):
    """prepare_attention (and ShardedAttention.prepare, which the drafter benchmark times as prep_ms) leaves
    every mask the seam needs in the caches: the call after it adds no cache entry, and computes exactly
    what an unprepared call computes."""
    heads, kv_heads, L = 8, 2, 1024
    cfg = _drafter_config(None, heads=heads, kv_heads=kv_heads, window=128, block=16)
    anchors = sample_anchors(torch.ones(L), DFlashObjective(num_anchors=24), block_size=16)
    lp = drafter_plans("reference", L, anchors, cfg, 1)[0].layers["sliding_attention"]

    def fresh():
        return Visibility(lp.shard.q_tokens, lp.shard.kv_tokens, 16, window=lp.window, noisy_causal=lp.noisy_causal)

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, len(lp.shard.q_tokens), HEAD_DIM, generator=g)
    k, v = torch.randn(2, 1, kv_heads, len(lp.shard.kv_tokens), HEAD_DIM, generator=g)
    prepared, unprepared = fresh(), fresh()
    chosen = prepare_attention(prepared, groups=heads // kv_heads, device="cpu", backend=backend, pack_gqa=pack)
    assert chosen[0] == backend and chosen[1] == (should_pack(fresh(), 4, "cpu") if pack is None else pack)
    built = {key: id(val) for key, val in prepared._cache.items()}
    with torch.no_grad():
        out, lse = partial_attention(q, k, v, prepared, backend=backend, pack_gqa=pack)
        ref, ref_lse = partial_attention(q, k, v, unprepared, backend=backend, pack_gqa=pack)
    assert {key: id(val) for key, val in prepared._cache.items()} == built  # nothing built in the call
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    if chosen[1]:  # the packed view's own mask was prepared too
        target = prepared._cache[("gqa_packed", 4, TILE)].vis
        assert chosen[2] is target and len(target._cache) > 0


def test_sharded_attention_prepares_the_visibilities_of_its_schedule():
    from specforge_csbp.models.dflash.sharding import reference_attention
    from specforge_csbp.parallel import AttentionOptions

    cfg = _drafter_config(None, heads=4, kv_heads=2, window=37, block=4)
    anchors = sample_anchors(torch.ones(300), DFlashObjective(num_anchors=13), block_size=4)
    attention = reference_attention(cfg, anchors, torch.arange(300), options=AttentionOptions(backend="dense"))
    for layer in attention.values():
        sharded = layer.attend
        assert sharded.visibilities == (sharded.local,)  # one process: no gathered keys
        sharded.prepare("cpu", 2)
        assert any(key[0] == "dense" for key in sharded.local._cache)


def test_packed_view_reuses_the_keys_coordinates_and_derives_its_query_ranges_exactly():
    """packed_visibility seeds its Visibility with the original's key coordinates and the query ranges picked
    row by row (PAD rows empty); that seed equals computing them afresh from the packed token sets."""
    for name, vis in list(_bdlm_visibilities())[::2] + list(_drafter_visibilities())[::3]:
        for groups in (2, 3, 4):
            packed = packed_visibility(vis, groups).vis
            fresh = Visibility(packed.q, packed.k, packed.block_size, vis.clean_within_block,
                               window=vis.window, noisy_causal=vis.noisy_causal)  # fmt: skip
            assert packed.coordinates() is vis.coordinates(), name  # shared, not recomputed
            assert torch.equal(packed.ranges(), fresh.ranges()), f"{name} G={groups}"
            assert torch.equal(packed.coordinates(), fresh.coordinates()), name
            for got, want in zip(packed.tables("cpu", torch.int32, q_len=len(packed.q) + 7),
                                 fresh.tables("cpu", torch.int32, q_len=len(packed.q) + 7)):  # fmt: skip
                assert torch.equal(got, want), name

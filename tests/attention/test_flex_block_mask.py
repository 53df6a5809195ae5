"""The chunked BlockMask builder equals torch's create_block_mask on the same rule (CPU, forward)."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import specforge_csbp.attention.flex as flex_backend
from specforge_csbp.attention import partial_attention
from specforge_csbp.attention.flex import block_mask_for, tile_status
from specforge_csbp.layout import bdlm_plan
from specforge_csbp.masks import Visibility
from tests.support.mask_cases import drafter_shards


def _visibilities():
    for mode, L, S, P in [("reference", 200, 8, 1), ("csbp", 320, 16, 3), ("cp", 256, 64, 2), ("bp", 192, 8, 2)]:
        for rule in ("causal", "bidirectional"):
            for plan in bdlm_plan(mode, L, S, P):
                yield Visibility(plan.q_tokens, plan.kv_tokens, S, rule)
                yield Visibility(plan.q_tokens, plan.remote_kv_tokens, S, rule) if len(plan.remote_kv_tokens) else None


@pytest.mark.parametrize("budget", [1 << 14, 1 << 27])  # many chunks, one chunk
def test_chunked_block_mask_equals_create_block_mask(budget):
    for vis in filter(None, _visibilities()):
        ours = block_mask_for(vis, torch.device("cpu"), budget=budget)
        vis._cache.clear()
        theirs = create_block_mask(vis.mask_mod("cpu"), None, None, len(vis.q), len(vis.k), device="cpu")
        assert torch.equal(ours.to_dense(), theirs.to_dense())
        assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks)
        assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)


def test_flex_forward_with_our_block_mask_equals_the_dense_seam(eager_flex):
    """Lengths that are not multiples of 128 (320 tokens over 3 ranks): the block mask covers whole tiles, the
    inputs are padded to them (PAD rows) and the outputs cut back - the dense seam's result (eager flex)."""
    torch.manual_seed(0)
    plan = bdlm_plan("csbp", 320, 16, 3)[1]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, 16)
    nq, nk = len(plan.q_rows), len(plan.kv_rows)
    assert nq % 128 and nk % 128  # the padded path
    assert block_mask_for(vis, torch.device("cpu")).seq_lengths == (-(-nq // 128) * 128, -(-nk // 128) * 128)
    q = torch.randn(1, 4, nq, 16)
    k, v = torch.randn(2, 1, 2, nk, 16)
    out, lse = flex_backend.flex_attention_partial(q, k, v, vis, 16**-0.5)
    ref, ref_lse = partial_attention(q, k, v, vis, backend="dense")
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse)) and torch.allclose(lse[seen], ref_lse[seen], atol=1e-5, rtol=0)


def _drafter_visibilities():
    # a window of one block: late slots see little context
    for q, keys, window, causal in drafter_shards(700, 40, 8, 8, (("reference", 1), ("csbp", 2), ("cp", 3)), 64):
        yield Visibility(q, keys, 8, window=window, noisy_causal=causal)
        # a window shorter than the block (the rule allows it): late slots' ranges are empty
        yield Visibility(q, keys, 8, window=3, noisy_causal=causal)


@pytest.mark.parametrize("q_tile,budget", [(128, 1 << 27), (32, 1 << 27), (128, 1 << 10)])
def test_counted_tile_status_equals_the_dense_mask(q_tile, budget):
    """tile_status counts visible keys per tile by binary search; the dense mask is the rule pair by pair."""
    n = 0
    big = bdlm_plan("csbp", 1024, 64, 2)[1]  # many full tiles
    extra = [Visibility(big.q_tokens, big.kv_tokens, 64), Visibility(big.q_tokens, big.remote_kv_tokens, 64)]
    for vis in filter(None, [*_visibilities(), *_drafter_visibilities(), *extra]):
        if not len(vis.k):
            continue
        nq, nk = len(vis.q), len(vis.k)
        n_qt, n_kt = -(-nq // q_tile), -(-nk // 128)
        dense = torch.zeros(n_qt * q_tile, n_kt * 128, dtype=torch.bool)
        dense[:nq, :nk] = vis.dense()
        tiles = dense.view(n_qt, q_tile, n_kt, 128)
        any_visible, all_visible = tile_status(vis, torch.device("cpu"), q_tile=q_tile, budget=budget)
        assert torch.equal(any_visible, tiles.any(3).any(1))
        assert torch.equal(all_visible, tiles.all(3).all(1))
        n += int(all_visible.sum())
    assert n > 10  # full tiles occur, so the 'all' count is exercised


def test_kernel_options_per_length_and_device():
    from specforge_csbp.attention.flex import kernel_options

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert kernel_options(256, 384) == {"IS_DIVISIBLE": True}  # no device: the lengths alone
    assert kernel_options(256, 384, cpu) == {"IS_DIVISIBLE": True}
    assert kernel_options(256, 300, cpu) is None  # a partial tile keeps the bounds checks
    # CUDA: the forward kernel's TMA loads whatever the lengths (inductor drops them where TMA cannot run)
    assert kernel_options(256, 384, gpu) == {"IS_DIVISIBLE": True, "fwd_USE_TMA": True}
    assert kernel_options(200, 384, gpu) == {"fwd_USE_TMA": True}

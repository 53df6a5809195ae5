"""CSBP's drafter plans make the attention kernels visit no more tiles than CP's for the same pairs.

The work of a block-sparse kernel is the 128 x 128 tiles it visits, full or partial, not the visible pairs.
CSBP owns anchors in runs of consecutive anchors (`own_anchors_near_context`, else `own_anchor_runs`) so that
a rank's query tile holds neighbouring draft blocks, as CP's tiles do; owning every P-th anchor spread each
tile's blocks (and their sliding windows) P times wider. Counted on CPU from the block masks the GPU kernels
use. Runs placed near their context also shrink what sliding-window layers gather.
"""

import pytest
import torch

from specforge_csbp.attention.flex import block_mask_for
from specforge_csbp.masks import Visibility
from specforge_csbp.models.dflash import drafter_plans, make_dflash_config
from specforge_csbp.objectives.dflash import DFlashObjective, sample_anchors


def _tiles(vis: Visibility) -> int:
    bm = block_mask_for(vis, torch.device("cpu"))
    return int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum())


def _tiles_per_kind(mode, L, anchors, cfg, P) -> dict[str, int]:
    total: dict[str, int] = {}
    for plan in drafter_plans(mode, L, anchors, cfg, P, bucket=256):
        for kind, lp in plan.layers.items():
            rule = dict(window=lp.window, noisy_causal=lp.noisy_causal)
            sh = lp.shard
            n = _tiles(Visibility(sh.q_tokens, sh.kv_tokens, plan.block_size, **rule))
            if sh.communicates:
                n += _tiles(Visibility(sh.q_tokens, sh.remote_kv_tokens, plan.block_size, **rule))
            total[kind] = total.get(kind, 0) + n
    return total


@pytest.mark.parametrize("world", [2, 3])
def test_csbp_visits_no_more_tiles_than_cp(world):
    cfg = make_dflash_config(
        hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, num_target_layers=4, target_layer_ids=[1, 2], mask_token_id=63,
        block_size=16, layer_types=["sliding_attention", "full_attention"], sliding_window=1024,
    )  # fmt: skip
    L = 32768
    anchors = sample_anchors(torch.ones(L), DFlashObjective(num_anchors=256), block_size=16)
    csbp, cp = _tiles_per_kind("csbp", L, anchors, cfg, world), _tiles_per_kind("cp", L, anchors, cfg, world)
    for kind in cp:
        assert csbp[kind] <= 1.05 * cp[kind], (kind, csbp, cp)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_anchors", [9, 130, 512])
def test_anchor_runs_own_every_anchor_once_and_stay_balanced(world, num_anchors):
    from specforge_csbp.layout.assignment import assign_dual_end
    from specforge_csbp.models.dflash.sharding import RUN_LOAD_SLACK, anchor_costs, own_anchor_runs

    cfg = make_dflash_config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=1000, num_target_layers=4, target_layer_ids=[1, 2], mask_token_id=999,
        block_size=16, layer_types=["sliding_attention", "full_attention"], sliding_window=512,
    )  # fmt: skip
    if num_anchors < world:
        return
    anchors = sample_anchors(torch.ones(65536), DFlashObjective(num_anchors=num_anchors), block_size=16)
    owned = own_anchor_runs(anchors, cfg, world)
    assert sorted(torch.cat(owned).tolist()) == list(range(num_anchors))
    assert all(len(o) for o in owned)
    costs = anchor_costs(anchors, cfg)
    loads = [sum(costs[i] for i in o.tolist()) for o in owned]
    assert max(loads) <= max(assign_dual_end(costs, world).loads) * (1 + RUN_LOAD_SLACK) + 1e-6
    if num_anchors == 512 and world in (2, 4, 8):  # runs fill whole 128-row tiles (8 blocks of 16)
        for o in owned:
            starts = o[::8]
            assert torch.equal(o.reshape(-1, 8) - starts[:, None], torch.arange(8).expand(len(starts), 8))


def test_fewer_anchors_than_ranks_is_a_one_line_error():
    from specforge_csbp.models.dflash.sharding import own_anchor_runs

    cfg = make_dflash_config(
        hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64, num_target_layers=2, target_layer_ids=[1], mask_token_id=63, block_size=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="^anchors: 2 anchors cannot be spread over 3 ranks"):
        own_anchor_runs(torch.tensor([3, 9]), cfg, 3)


def _window_cfg(window=512):
    return make_dflash_config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=1000, num_target_layers=4, target_layer_ids=[1, 2], mask_token_id=999,
        block_size=16, layer_types=["sliding_attention", "full_attention"], sliding_window=window,
    )  # fmt: skip


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("num_anchors", [3, 9, 130, 512])
def test_anchors_near_context_own_every_anchor_once_balanced_and_tile_aligned(world, num_anchors):
    """Every anchor once, every rank some, the load within RUN_LOAD_SLACK of single-anchor ownership, and a
    rank's anchors as whole runs first, then the rest, each in order (with 512 anchors, mostly runs of 8
    consecutive, run-aligned anchors: one query tile each); or None - the fallback to own_anchor_runs."""
    from specforge_csbp.layout.assignment import assign_dual_end
    from specforge_csbp.models.dflash.sharding import RUN_LOAD_SLACK, anchor_costs, own_anchors_near_context

    if num_anchors < world:
        return
    cfg, L = _window_cfg(), 65536
    anchors = sample_anchors(torch.ones(L), DFlashObjective(num_anchors=num_anchors), block_size=16)
    owned = own_anchors_near_context(anchors, cfg, world, L)
    if owned is None:
        assert num_anchors < 512  # 512 uniform anchors always balance without falling back
        return
    assert sorted(torch.cat(owned).tolist()) == list(range(num_anchors)) and all(len(o) for o in owned)
    costs = anchor_costs(anchors, cfg)
    loads = [sum(costs[i] for i in o.tolist()) for o in owned]
    assert max(loads) <= max(assign_dual_end(costs, world).loads) * (1 + RUN_LOAD_SLACK) + 1e-6
    in_runs = 0
    for o in owned:
        assert int((o[1:] < o[:-1]).sum()) <= 1  # whole runs in order, then the rest in order
        k = 0
        while k + 8 <= len(o) and int(o[k]) % 8 == 0 and torch.equal(o[k : k + 8] - o[k], torch.arange(8)):
            k += 8
        in_runs += k
    if num_anchors == 512:
        assert in_runs >= 0.75 * num_anchors  # most query tiles hold one run of neighbouring blocks


@pytest.mark.parametrize("world", [2, 3, 4])
def test_csbp_gathers_fewer_window_rows_with_anchors_near_their_context(world):
    """The sliding-window layers' gathered rows (and so the fused call's keys and the traffic) shrink when
    anchors live where their windows are; full-attention layers gather the whole context either way."""
    from specforge_csbp.models.dflash import sharding

    cfg, L = _window_cfg(window=1024), 131072
    anchors = sample_anchors(torch.ones(L), DFlashObjective(num_anchors=256), block_size=16)
    near = sharding.drafter_plans("csbp", L, anchors, cfg, world, bucket=256)
    original = sharding.own_anchors_near_context
    sharding.own_anchors_near_context = lambda *args: None
    try:
        runs = sharding.drafter_plans("csbp", L, anchors, cfg, world, bucket=256)
    finally:
        sharding.own_anchors_near_context = original
    sliding = [p.layers["sliding_attention"].shard.gather_len for p in (near[0], runs[0])]
    full = [p.layers["full_attention"].shard.gather_len for p in (near[0], runs[0])]
    assert sliding[0] * 3 <= sliding[1], sliding
    assert full[0] == full[1], full

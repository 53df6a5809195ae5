"""Properties of the pure layout math over many (L, S, P)."""

import itertools

import pytest
import torch

from specforge_csbp.layout import (
    CLEAN,
    NOISY,
    ZigzagShards,
    assign_dual_end,
    bdlm_plan,
    check_bdlm_shape,
    check_block_shape,
    check_mode,
)
from specforge_csbp.layout.plans import block_assignment

SHAPES = [(b * s, s, p) for s in (1, 4, 16) for b in range(1, 41) for p in range(1, 9) if b >= p]


@pytest.mark.parametrize("s", [1, 4, 16])
def test_zigzag_every_clean_token_has_one_owner_and_ranks_are_balanced(s):
    for b, p in itertools.product(range(1, 41), range(1, 9)):
        zig = ZigzagShards(b * s, s, p)
        owners = torch.zeros(b * s, dtype=torch.long)
        counts = []
        for r in range(p):
            pos = zig.rank_positions(r)
            owners[pos] += 1
            counts.append(pos.numel())
            chunks = zig.chunk_bounds()
            assert zig.rank_intervals(r) == [chunks[c] for c in (r, 2 * p - 1 - r) if chunks[c][1] > chunks[c][0]]
            for lo, hi in zig.rank_intervals(r):
                assert lo % s == 0 and hi % s == 0  # chunks are block aligned
        assert torch.equal(owners, torch.ones_like(owners))
        assert max(counts) - min(counts) <= s  # at most one block apart
        if b % p == 0:
            assert len(set(counts)) == 1  # equal shards: the all-gather needs no padding
        bounds = zig.chunk_bounds()
        assert bounds[0][0] == 0 and bounds[-1][1] == b * s
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(2 * p - 1))


def test_zigzag_is_the_standard_layout_when_2p_divides_b():
    zig = ZigzagShards(8 * 4, 4, 2)
    assert [zig.rank_intervals(r) for r in range(2)] == [[(0, 8), (24, 32)], [(8, 16), (16, 24)]]


def test_dual_end_pairs_block_b_with_its_mirror():
    for b, p in [(8, 2), (16, 4), (12, 3), (24, 4)]:
        a = block_assignment(b, p)
        for items in a.items:
            assert sorted(items) == sorted({i for x in items for i in (x, b - 1 - x)})
        assert a.imbalance == pytest.approx(1.0)


def test_assignment_owns_every_block_once_and_every_rank_something():
    for b, p in itertools.product(range(1, 41), range(1, 9)):
        if b < p:
            with pytest.raises(ValueError, match="blocks >= world_size"):
                block_assignment(b, p)
            continue
        a = block_assignment(b, p)
        flat = sorted(i for items in a.items for i in items)
        assert flat == list(range(b))
        assert all(len(items) >= 1 for items in a.items)
        costs = [i + 1 for i in range(b)]
        assert list(a.loads) == [sum(costs[i] for i in items) for items in a.items]
        # never worse than placing whole mirror pairs round-robin, the naive dual-end
        naive = [0.0] * p
        for k in range((b + 1) // 2):
            naive[k % p] += costs[k] + (costs[b - 1 - k] if b - 1 - k != k else 0)
        if (b + 1) // 2 >= p:
            assert max(a.loads) <= max(naive)
        # greedy bound: max load <= mean + the heaviest item
        assert max(a.loads) <= sum(costs) / p + max(costs)


def test_assignment_handles_p_le_b_lt_2p_by_splitting_pairs():
    a = assign_dual_end([1, 2, 3, 4, 5], 4)
    assert sorted(len(i) for i in a.items) == [1, 1, 1, 2]
    assert max(a.loads) == 5 and a.imbalance == pytest.approx(5 / 3.75)  # the best possible max load


def test_assignment_error_names_what_and_rule():
    with pytest.raises(ValueError, match=r"anchors: 2 anchors cannot be spread over 3 ranks"):
        assign_dual_end([1.0, 2.0], 3, what="anchors")


@pytest.mark.parametrize("mode", ["csbp", "cp", "bp"])
def test_plans_cover_every_row_once_and_shard_as_the_mode_says(mode):
    for seq_len, s, p in SHAPES[::7]:
        plans = bdlm_plan(mode, seq_len, s, p)
        primary_rows = torch.cat([pl.q_rows[pl.q_primary] for pl in plans])
        assert sorted(primary_rows.tolist()) == list(range(2 * seq_len))
        for pl in plans:
            kinds = pl.kv_tokens.kind[pl.shared]
            noisy_pos = pl.q_tokens.pos[pl.q_tokens.kind == NOISY]
            if mode == "csbp":
                assert bool((kinds == CLEAN).all()) and len(pl.shared) == int((pl.kv_tokens.kind == CLEAN).sum())
            if mode == "cp":
                assert len(pl.shared) == len(pl.kv_rows)
            if mode == "bp":
                assert len(pl.shared) == 0 and not pl.communicates
            if mode in ("csbp", "bp"):  # corrupted blocks are whole on their owner
                blocks = torch.div(noisy_pos, s, rounding_mode="floor")
                for blk in blocks.unique().tolist():
                    assert int((blocks == blk).sum()) == s
            assert bool(pl.q_primary.all()) or mode == "bp"


def test_bp_replicates_exactly_the_clean_prefix_each_rank_needs():
    plans = bdlm_plan("bp", 10 * 4, 4, 3)
    owned = block_assignment(10, 3).items
    for pl, blocks in zip(plans, owned):
        clean = pl.q_tokens.pos[pl.q_tokens.kind == CLEAN]
        last = max(blocks)
        end = (last + 1) * 4 if last == 9 else last * 4
        assert torch.equal(clean, torch.arange(end))


@pytest.mark.parametrize(
    "args, message",
    [
        (("csbp", 30, 4, 2), "seq_len must be a positive multiple of block_size=4"),
        (("csbp", 12, 4, 4), "3 blocks < world_size = 4"),
        (("ring", 16, 4, 2), "mode must be one of reference, cp, bp, csbp"),
        (("reference", 16, 4, 2), "mode 'reference' runs on world_size 1"),
        (("cp", 16, 0, 2), "block_size must be >= 1"),
    ],
)
def test_bad_shapes_give_one_line_errors(args, message):
    with pytest.raises(ValueError, match=message) as err:
        bdlm_plan(*args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((16, 0, 2), "block_size must be >= 1, got 0"),
        ((0, 4, 2), "seq_len must be a positive multiple of block_size=4, got 0"),
        ((18, 4, 2), "seq_len must be a positive multiple of block_size=4, got 18"),
        ((16, 4, 0), "world_size must be >= 1, got 0"),
    ],
)
def test_zigzag_and_every_mode_refuse_a_bad_shape_with_the_same_line(shape, message):
    """One shape check (check_block_shape) behind ZigzagShards and check_bdlm_shape."""
    for build in (lambda: check_block_shape(*shape), lambda: ZigzagShards(*shape),
                  *[lambda m=m: check_bdlm_shape(m, *shape) for m in ("cp", "bp", "csbp")]):  # fmt: skip
        with pytest.raises(ValueError) as err:
            build()
        assert str(err.value) == message


def test_one_mode_check_names_the_modes_its_caller_allows():
    check_mode("csbp")
    check_mode("dp", ("reference", "dp", "cp", "csbp"))
    with pytest.raises(ValueError) as err:
        check_mode("dp")
    assert str(err.value) == "mode must be one of reference, cp, bp, csbp; got 'dp'"
    with pytest.raises(ValueError) as err:
        check_mode("bp", ("reference", "dp", "cp", "csbp"))
    assert str(err.value) == "mode must be one of reference, dp, cp, csbp; got 'bp'"


def test_assign_near_home_keeps_runs_home_and_balances_within_slack():
    """Pure layout: runs go home when that balances; an unbalanced home split moves the unit nearest half the
    gap (runs, then single items) until within slack of dual-end; whole runs come first on each rank."""
    from specforge_csbp.layout import assign_dual_end, assign_near_home

    # homes 0 0 0 0 | 1 1 1 1 | 1 1 1 1 | 0 0 0 0, equal costs: every run stays home, nothing moves
    home = [0] * 4 + [1] * 8 + [0] * 4
    assert assign_near_home([1.0] * 16, home, 2, run=4, slack=0.0) == (
        (0, 1, 2, 3, 12, 13, 14, 15),
        (4, 5, 6, 7, 8, 9, 10, 11),
    )
    # everything calls rank 0 home: half must move, rank 1 gets whole runs (tile-aligned) first
    costs = [1.0 + 0.01 * i for i in range(24)]
    items = assign_near_home(costs, [0] * 24, 2, run=4, slack=0.01)
    assert items is not None and sorted(items[0] + items[1]) == list(range(24))
    loads = [sum(costs[i] for i in r) for r in items]
    assert max(loads) <= max(assign_dual_end(costs, 2).loads) * 1.01
    for r in items:
        k = 0
        while k + 4 <= len(r) and r[k] % 4 == 0 and list(r[k : k + 4]) == list(range(r[k], r[k] + 4)):
            k += 4
        assert list(r[k:]) == sorted(r[k:])
    # greedy moves cannot reach dual-end's (3, 3) here: loads (4, 2) and no unit below the gap -> None
    assert assign_near_home([1.0, 1.0, 2.0, 2.0], [0, 0, 0, 0], 2, run=2, slack=0.0) is None
    with pytest.raises(ValueError, match="^anchors: 1 anchors cannot be spread over 2 ranks"):
        assign_near_home([1.0], [0], 2, run=4, slack=0.01)

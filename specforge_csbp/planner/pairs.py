"""Exact per-rank work of a layout: rows, shared rows, and visible (query, key) pairs, without a dense mask.

The rule (`masks/visibility.py`) decides visibility pair by pair, which is O(N^2) - fine for tests, far too
slow at 1M tokens. `count_visible` counts the same pairs in O(N log N) from sorted key positions:

    clean query   causal:        # clean keys with pos <= q.pos
                  bidirectional: # clean keys with pos <  q.start + S
    noisy query:                 # clean keys with pos <  q.start   (and >= q.start - window, if windowed)
                               + # noisy keys with block == q.block

tests/planner/test_pairs_equal_visibility.py checks it equals `Visibility(q, k).dense().sum()` for every mode's plans.

BDLM layouts are block aligned (zigzag chunks and owned blocks are whole blocks), so a plan of L tokens in
blocks of S has exactly the block structure of the plan of B = L/S tokens in blocks of 1. `bdlm_rank_stats`
counts on that small plan and scales: every visible block pair is S*S token pairs, except a clean block
against itself under the causal rule, which is S(S+1)/2:

    pairs(L, S) = S^2 * pairs(B, 1) - S(S-1)/2 * (# clean query blocks whose own block is a local key)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..layout.assignment import assign_dual_end, assign_near_home
from ..layout.plans import ShardPlan, bdlm_plan, check_bdlm_shape, check_mode
from ..layout.tokens import CLEAN, NOISY, TokenSet
from ..layout.zigzag import ZigzagShards
from ..masks.visibility import CLEAN_RULES

__all__ = [
    "DrafterRankStats",
    "RankStats",
    "bdlm_rank_stats",
    "count_visible",
    "drafter_anchors",
    "drafter_rank_stats",
    "drafter_tokens",
]


def _count_less(sorted_keys: torch.Tensor, bound: torch.Tensor, *, inclusive: bool = False) -> torch.Tensor:
    """For each bound: # keys < bound (or <= bound)."""
    return torch.searchsorted(sorted_keys, bound, right=inclusive)


def _sorted(x: torch.Tensor) -> torch.Tensor:
    """x sorted (layouts usually hand over sorted positions: the O(N) check skips the sort)."""
    return x if x.numel() < 2 or bool((x[1:] >= x[:-1]).all()) else torch.sort(x).values


def count_visible(
    q: TokenSet,
    k: TokenSet,
    block_size: int,
    clean_within_block: str = "causal",
    *,
    window: int | None = None,
    noisy_causal: bool = False,
) -> int:
    """Number of pairs `Visibility(q, k, block_size, clean_within_block, window, noisy_causal)` makes visible
    (see module docstring; the window keeps clean keys with pos > q.pos - window)."""
    if clean_within_block not in CLEAN_RULES:
        raise ValueError(f"clean_within_block must be one of {', '.join(CLEAN_RULES)}; got {clean_within_block!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1, got {window}")
    clean_k = _sorted(k.pos[k.kind == CLEAN])
    noisy = k.kind == NOISY
    # noisy keys sorted by (block, pos): one searchsorted finds "same block" and "same block, pos <= p"
    span = int(max(int(k.pos.max()) if len(k) else 0, int(q.pos.max()) if len(q) else 0)) + 1
    noisy_k = _sorted(k.block[noisy] * span + k.pos[noisy])
    total = 0
    qc = q.kind == CLEAN
    if qc.any():
        pos = q.pos[qc]
        if clean_within_block == "causal":
            seen = _count_less(clean_k, pos, inclusive=True)
        else:
            seen = _count_less(clean_k, q.start[qc] + block_size)
        if window is not None:
            seen = seen - _count_less(clean_k, pos - window, inclusive=True)
        total += int(seen.clamp_min(0).sum())
    qn = q.kind == NOISY
    if qn.any():
        pos, start, block = q.pos[qn], q.start[qn], q.block[qn]
        seen = _count_less(clean_k, start)
        if window is not None:
            seen = (seen - _count_less(clean_k, pos - window, inclusive=True)).clamp_min(0)
        hi = block * span + (pos if noisy_causal else span - 1)
        same = _count_less(noisy_k, hi, inclusive=True) - _count_less(noisy_k, block * span)
        total += int(seen.sum() + same.sum())
    return total


@dataclass(frozen=True)
class RankStats:
    """One rank's share of one BDLM attention layer (token units, full resolution)."""

    rank: int
    q_rows: int  # rows through this rank's token-wise layers (queries)
    kv_rows: int  # local key/value rows
    primary_rows: int  # rows this rank owns uniquely (replicas excluded)
    noisy_rows: int  # corrupted rows it owns (where its block losses are)
    shared_rows: int  # own rows whose K/V every rank gathers
    gather_width: int  # rows per rank segment of the gathered buffer (padded to the largest shard)
    world: int
    pairs_local: int  # visible pairs against local keys
    pairs_remote: int  # visible pairs against the gathered keys of other ranks

    @property
    def pairs(self) -> int:
        return self.pairs_local + self.pairs_remote

    @property
    def gathered_rows(self) -> int:
        """Rows of the gathered buffer (all segments, own segment included) when the plan communicates."""
        return self.world * self.gather_width if self.world > 1 and self.gather_width else 0


def _diag(q: TokenSet, k: TokenSet) -> int:
    """# clean query tokens whose position is also a clean key (block-resolution: same block)."""
    keys = _sorted(k.pos[k.kind == CLEAN])
    pos = q.pos[q.kind == CLEAN]
    return int((_count_less(keys, pos, inclusive=True) - _count_less(keys, pos)).sum())


def _scaled_pairs(q: TokenSet, k: TokenSet, s: int, rule: str) -> int:
    n1 = count_visible(q, k, 1, rule)
    return s * s * n1 - (s * (s - 1) // 2) * _diag(q, k) if rule == "causal" else s * s * n1


@functools.lru_cache(maxsize=256)
def bdlm_rank_stats(
    mode: str, seq_len: int, block_size: int, world_size: int, clean_within_block: str = "causal"
) -> tuple[RankStats, ...]:
    """Per-rank stats of `bdlm_plan(mode, seq_len, block_size, world_size)`, computed on its block plan."""
    if mode == "dp":  # data parallel: every rank runs the whole sequence alone (the reference layout)
        mode, world_size = "reference", 1
    check_bdlm_shape(mode, seq_len, block_size, world_size)
    plans = bdlm_plan(mode, seq_len // block_size, 1, world_size)
    return tuple(_stats_of(p, block_size, clean_within_block) for p in plans)


def _stats_of(p: ShardPlan, s: int, rule: str) -> RankStats:
    remote = _scaled_pairs(p.q_tokens, p.remote_kv_tokens, s, rule) if p.communicates else 0
    return RankStats(
        rank=p.rank, q_rows=s * len(p.q_tokens), kv_rows=s * len(p.kv_tokens),
        primary_rows=s * int(p.q_primary.sum()), noisy_rows=s * int((p.q_tokens.kind == NOISY).sum()),
        shared_rows=s * int(p.shared.numel()), gather_width=s * p.gather_len, world=p.world_size,
        pairs_local=_scaled_pairs(p.q_tokens, p.kv_tokens, s, rule), pairs_remote=remote,
    )  # fmt: skip


# -- DFlash drafters ----------------------------------------------------------------------------


def drafter_anchors(context_len: int, anchors: int, block_size: int) -> list[int]:
    """Evenly spread anchor positions (the planner's stand-in for uniform sampling): anchor i at the middle
    of the i-th of `anchors` equal slices of the valid range [1, context_len - block_size]."""
    valid = context_len - block_size
    if anchors < 1 or valid < anchors:
        raise ValueError(
            f"anchors must be between 1 and context - block_size = {valid}; got {anchors}"
        )
    return [1 + ((2 * i + 1) * valid) // (2 * anchors) for i in range(anchors)]


def drafter_tokens(anchor_positions: list[int], block_size: int) -> TokenSet:
    """Draft-block tokens: block i = [anchor, MASK x (S-1)] at positions a..a+S-1, block id i, start a."""
    a = torch.tensor(anchor_positions, dtype=torch.long)
    ids = torch.arange(len(anchor_positions)).repeat_interleave(block_size)
    pos = a.repeat_interleave(block_size) + torch.arange(block_size).repeat(len(anchor_positions))
    return TokenSet(pos, torch.full_like(pos, NOISY), ids, a[ids])


def _context_tokens(positions: torch.Tensor) -> TokenSet:
    z = torch.zeros_like(positions)
    return TokenSet(positions, torch.full_like(positions, CLEAN), z, z)


@dataclass(frozen=True)
class DrafterRankStats:
    """One rank's share of a DFlash drafter step for one attention window (None = full attention)."""

    rank: int
    context_rows: int  # context positions whose features, fc and K/V projections this rank computes
    anchors: int  # draft blocks this rank runs through the decoder and the loss
    block_rows: int  # anchors * S
    pairs_local: int  # block queries x keys this rank holds (own blocks + local context)
    pairs_remote: int  # block queries x context keys received from other ranks
    received_rows: int  # context K/V rows received per layer (all-gather segments, or needed windows)
    gather_width: int  # all-gather segment rows (full attention under CSBP), 0 otherwise
    world: int

    @property
    def pairs(self) -> int:
        return self.pairs_local + self.pairs_remote


@functools.lru_cache(maxsize=256)
def drafter_rank_stats(
    mode: str, context_len: int, anchors: int, block_size: int, world_size: int, window: int | None = None
) -> tuple[DrafterRankStats, ...]:
    """Per-rank stats of a drafter layout (design.md section 3):

        dp    one rank holds the whole context and every anchor (world_size is the DP degree, no sharing)
        cp    context zigzag-sharded; every anchor on every rank (block work duplicated), partial
              attention over the local context merged across ranks
        bp    anchors owned whole (dual-end by prefix cost); each rank recomputes the context prefix its
              anchors need (up to its last anchor; its windows only, for sliding-window layers)
        csbp  anchors owned whole, in runs near their context (assign_near_home, as the drafter plans do)
              + context zigzag shard; full attention gathers all context K/V, sliding-window layers
              receive only the windows the rank's anchors need
    """
    check_mode(mode, ("dp", "cp", "bp", "csbp"))
    S = block_size
    if context_len % S:
        raise ValueError(f"context must be a multiple of block_size={S}; got {context_len}")
    pos = drafter_anchors(context_len, anchors, S)
    P = 1 if mode == "dp" else world_size
    if mode in ("bp", "csbp") and anchors < P:
        raise ValueError(f"anchors: {anchors} anchors cannot be spread over {P} ranks (anchors >= world_size)")
    # Prefix cost of an anchor: context keys its queries see (< a; within the window) + its own block.
    cost = [float(min(a, window) if window else a) + S for a in pos]
    owned = assign_dual_end(cost, P, what="anchors").items if mode in ("bp", "csbp") else None
    zig = ZigzagShards(context_len, S, P) if P > 1 else None
    if mode == "csbp" and P > 1:  # as the drafter plans own them: runs near their context, within the slack
        # lazy: heavy dependency (models.dflash loads transformers); the cost model imports without it
        from ..models.dflash.sharding import Q_TILE_ROWS, RUN_LOAD_SLACK

        home = zig.owner_at((torch.tensor(pos) - 1).clamp(min=0)).tolist()
        run = max(1, Q_TILE_ROWS // S)
        owned = assign_near_home(cost, home, P, run=run, slack=RUN_LOAD_SLACK, halve=True) or owned
    out = []
    for r in range(P):
        mine = list(range(anchors)) if owned is None else list(owned[r])
        my_pos = [pos[i] for i in mine]
        blocks = drafter_tokens(my_pos, S)
        if mode == "dp" or P == 1:
            local_ctx = torch.arange(context_len)
        elif mode == "bp":
            local_ctx = _needed_context(my_pos, window, context_len)
        else:
            local_ctx = zig.rank_positions(r)
        keys_local = TokenSet.cat([_context_tokens(local_ctx), blocks])
        pairs_local = count_visible(blocks, keys_local, S, window=window)
        pairs_remote, received, width = 0, 0, 0
        if mode == "csbp" and P > 1:
            needed = _needed_context(my_pos, window, context_len)
            is_local = torch.zeros(context_len, dtype=torch.bool)
            is_local[local_ctx] = True
            remote = needed[~is_local[needed]]
            pairs_remote = count_visible(blocks, _context_tokens(remote), S, window=window)
            if window is None:  # all-gather of every shard (padded to the largest)
                width = max(zig.rank_positions(x).numel() for x in range(P))
                received = (P - 1) * width
            else:  # only the windows this rank's anchors need
                received = int(remote.numel())
        out.append(
            DrafterRankStats(
                rank=r, context_rows=int(local_ctx.numel()), anchors=len(mine), block_rows=len(mine) * S,
                pairs_local=pairs_local, pairs_remote=pairs_remote, received_rows=received, gather_width=width,
                world=P,
            )  # fmt: skip
        )
    return tuple(out)


def _needed_context(anchor_positions: list[int], window: int | None, context_len: int) -> torch.Tensor:
    """Context positions some anchor's block sees: [0, max anchor), or with a window the union of
    (a - w, a) (slot 0 of a block sees the most: positions > a - w)."""
    if not anchor_positions:
        return torch.zeros(0, dtype=torch.long)
    if window is None:
        return torch.arange(min(max(anchor_positions), context_len))
    marks = torch.zeros(context_len + 1, dtype=torch.long)
    for a in anchor_positions:
        marks[max(0, a - window + 1)] += 1
        marks[a] -= 1
    return torch.nonzero(torch.cumsum(marks, 0)[:context_len] > 0).flatten()

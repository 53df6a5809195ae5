"""Per-rank plans for one drafter step, in modes reference, DP, CP and CSBP, built on `layout.build_plans`.

Rows of one sequence (global numbering): context rows are positions 0..L-1 (CLEAN, no queries); draft
block i (anchor a_i) is rows L + i*S .. L + i*S + S-1 (NOISY, block = i, start = a_i).

    mode       context rows of rank r (K/V computed here)     draft blocks of rank r     per layer
    reference  all                                            all                        -
    dp         all (whole sequence on its rank)               all                        -
    cp         zigzag shard r                                 all (duplicated)           merge partial outputs
    csbp       zigzag shard r                                 owned (dual-end by cost)   all-gather shard K/V

CSBP: every rank all-gathers the context K/V shards (overlapped with attention over its own rows) and its
owned blocks attend to all of it; gradients of the gathered K/V are reduce-scattered to their owners.
CP, the honest conventional baseline, duplicates only the block-local work: every rank attends all blocks
to its own context shard, and the partial outputs are LSE-merged over the group (`MergedAttention`; the
blocks' own keys count on rank 0 only). Attention work is split, never duplicated.

Sliding-window layers get their own plan: a block at anchor a needs context [a - W + 1, a) only, so a rank
computes K/V for the rows of its shard that some anchor needs, and shares only the rows that anchors on
other ranks need (with P = 2 that is exactly what the other rank receives). Row counts can be padded to a
multiple of `bucket` (static shapes for compiled kernels) with rows nobody needs - invisible to every query
by the rule, so padding never changes a result.

Anchors are owned whole: `assign_dual_end` on per-anchor cost (visible context keys of every layer plus the
block-local work expressed in key units), heaviest paired with lightest. CP keeps every anchor on every rank
and scales its loss by 1/P, so each loss counts once in the gradient sum.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...attention import merge_partials
from ...distributed.collectives import COMM_STATS, CommStats, all_gather_rows
from ...layout import CLEAN, NOISY, ShardPlan, TokenSet, ZigzagShards, assign_dual_end, assign_near_home
from ...layout.plans import build_plans
from ...parallel.sharded_attention import ShardedAttention
from .configuration import DFlashConfig
from .modeling import LayerAttention

__all__ = [
    "DRAFTER_MODES",
    "DrafterPlan",
    "LayerPlan",
    "MergedAttention",
    "anchor_costs",
    "drafter_plans",
    "own_anchor_runs",
    "own_anchors_near_context",
    "plan_attention",
    "prepare_plan_attention",
    "reference_attention",
]

DRAFTER_MODES = ("reference", "dp", "cp", "csbp")


@dataclass(frozen=True)
class LayerPlan:
    """One layer type's attention plan on one rank."""

    shard: ShardPlan
    ctx_index: torch.Tensor | None  # rows of the rank's context feeding this layer type (None: all)
    window: int | None
    noisy_causal: bool
    merge: bool = False  # CP: partial outputs over the local shard, LSE-merged over the group


@dataclass(frozen=True)
class DrafterPlan:
    mode: str
    rank: int
    world_size: int
    seq_len: int
    block_size: int
    anchors: torch.Tensor  # [N] every anchor of the sequence (sorted positions)
    owned: torch.Tensor  # indices into anchors whose blocks this rank computes
    loss_scale: float  # 1/P in CP (duplicated blocks), else 1
    sequence_share: float  # this rank's share of "one sequence" (for per-sequence denominators)
    ctx_positions: torch.Tensor  # context rows held here (sorted positions)
    ctx_intervals: tuple[tuple[int, int], ...]  # the same rows as [lo, hi) intervals (feature loading)
    layers: Mapping[str, LayerPlan]

    @property
    def owned_anchors(self) -> torch.Tensor:
        return self.anchors[self.owned]


def _granule(seq_len: int, world_size: int) -> int:
    """Zigzag chunk granularity: the largest power of two <= 128 dividing L that still gives every one of
    the 2P chunks a granule (chunks stay tile-aligned on long sequences)."""
    g = 128
    while g > 1 and (seq_len % g or seq_len // g < 2 * world_size):
        g //= 2
    return g


def anchor_costs(anchors: torch.Tensor, config: DFlashConfig) -> list[float]:
    """Forward FLOPs of one anchor's block: attention over its visible context plus block-local work."""
    S, H, D = config.draft_block_size, config.hidden_size, config.head_dim
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    per_key = 4.0 * S * heads * D  # QK^T and PV for S queries
    proj = 2.0 * H * D * (2 * heads + 2 * kv_heads) + 6.0 * H * inter  # q, o, k, v + MLP, per row
    local = (
        S * (config.num_hidden_layers * proj + 2.0 * H * config.vocab_size)
        + per_key * S * config.num_hidden_layers
    )
    a = anchors.to(torch.float64)
    keys = torch.zeros_like(a)
    for kind in config.layer_types:
        keys += a if kind == "full_attention" else a.clamp(max=float(config.sliding_window - 1))
    return (keys * per_key + local).tolist()


#: query rows of one FlexAttention tile: anchors are owned in runs that fill whole tiles
Q_TILE_ROWS = 128
#: load imbalance accepted for tile-filling runs, relative to owning single anchors (see own_anchor_runs)
RUN_LOAD_SLACK = 0.01


def own_anchor_runs(anchors: torch.Tensor, config: DFlashConfig, world_size: int) -> list[torch.Tensor]:
    """CSBP ownership: runs of consecutive anchors, placed on ranks by `assign_dual_end` over run costs.

    A rank's draft blocks are its query rows, Q_TILE_ROWS / S blocks to a kernel tile. Owning single anchors
    (heaviest with lightest) gives each tile every P-th anchor, so the tile's blocks - and, in sliding-window
    layers, their windows - lie P times further apart than in CP's tiles, which hold consecutive anchors:
    more partially filled tiles for the same pairs (tests/models/dflash/test_csbp_tiles_vs_cp.py). Runs of consecutive anchors
    fill a tile, and dual-end pairing of runs keeps the prefix costs balanced:

        anchors (sorted):  a0 a1 | a2 a3 | a4 a5 | a6 a7      runs of 2, P = 2
        pairs of runs:     (r0, r3) -> rank 0   (r1, r2) -> rank 1

    Coarser units can balance worse (few anchors per rank, P not dividing the runs): the longest run
    (tile-filling, halved down to 1) whose maximum rank load stays within RUN_LOAD_SLACK of single-anchor
    ownership's is used - the step waits for the most loaded rank, so that 1% is all tile filling may cost.
    """
    N, P = anchors.numel(), world_size
    costs = anchor_costs(anchors, config)
    singles = assign_dual_end(costs, P, what="anchors")  # also the one-line error when N < P
    order = torch.argsort(anchors, stable=True)
    run = max(1, Q_TILE_ROWS // config.draft_block_size)
    while run > 1:
        if N >= 2 * P * run:
            runs = [order[i : i + run] for i in range(0, N, run)]
            placed = assign_dual_end([sum(costs[int(i)] for i in r) for r in runs], P, what="anchors")
            if max(placed.loads) <= max(singles.loads) * (1 + RUN_LOAD_SLACK):
                return [torch.sort(torch.cat([runs[u] for u in units])).values for units in placed.items]
        run //= 2
    return [torch.tensor(items, dtype=torch.long) for items in singles.items]


def own_anchors_near_context(
    anchors: torch.Tensor, config: DFlashConfig, world_size: int, seq_len: int
) -> list[torch.Tensor] | None:
    """CSBP ownership that keeps sliding windows local: `assign_near_home` over the anchors in position order,
    an anchor's home being the rank whose zigzag context shard holds the position just before it, where
    its window ends; runs fill a query tile (as in `own_anchor_runs`; halved while that cannot balance),
    and the load stays within RUN_LOAD_SLACK of single-anchor dual-end ownership. None when it cannot (the
    caller then uses `own_anchor_runs`).

        context (zigzag, P = 2):  |  rank 0  |  rank 1  |  rank 1  |  rank 0  |
        runs of anchors:            [a a a a]  [a a a a]  [a a a a]  [a a a a]
        owner (home):                   0          1          1          0

    The zigzag pairing that balances the clean prefix balances the runs' prefix costs too, so few anchors
    move; only moved anchors' windows are gathered in sliding-window layers (full layers gather the whole
    context either way). A rank's whole runs come first in its order, so its query tiles stay aligned with
    runs; moved single anchors follow them."""
    order = torch.argsort(anchors, stable=True)
    costs = anchor_costs(anchors, config)
    home = _zigzag(seq_len, world_size).owner_at((anchors[order].to(torch.long) - 1).clamp(min=0))
    items = assign_near_home(
        [costs[i] for i in order.tolist()], home.tolist(), world_size,
        run=max(1, Q_TILE_ROWS // config.draft_block_size), slack=RUN_LOAD_SLACK, halve=True,
    )  # fmt: skip
    return None if items is None else [order[list(ids)] for ids in items]


def _block_tokens(anchors: torch.Tensor, idx: torch.Tensor, S: int) -> TokenSet:
    a = anchors[idx]
    pos = (a[:, None] + torch.arange(S)).reshape(-1)
    block = idx.repeat_interleave(S)
    return TokenSet(pos, torch.full_like(pos, NOISY), block, a.repeat_interleave(S))


def _ctx_tokens(pos: torch.Tensor) -> TokenSet:
    return TokenSet(pos, torch.full_like(pos, CLEAN), torch.full_like(pos, -1), torch.zeros_like(pos))


def _window_need(anchors: torch.Tensor, seq_len: int, window: int) -> torch.Tensor:
    """bool [L]: positions in [a - W + 1, a) for some anchor a (a difference array, then a prefix sum)."""
    diff = torch.zeros(seq_len + 1, dtype=torch.long)
    if anchors.numel():
        diff.index_add_(0, (anchors - window + 1).clamp(min=0), torch.ones_like(anchors))
        diff.index_add_(0, anchors, -torch.ones_like(anchors))
    return diff.cumsum(0)[:seq_len] > 0


def _padded(chosen: torch.Tensor, spare: torch.Tensor, bucket: int) -> torch.Tensor:
    """bool [L]: the chosen positions plus the first spare ones, up to a multiple of bucket rows."""
    n = int(chosen.sum())
    extra = min(-(-n // bucket) * bucket, n + int(spare.sum())) - n
    out = chosen.clone()
    if extra:
        out[torch.nonzero(spare).flatten()[:extra]] = True
    return out


def _zigzag(seq_len: int, world_size: int) -> ZigzagShards:
    """The drafter's zigzag context sharding (tile-aligned chunks, `_granule`)."""
    return ZigzagShards(seq_len, _granule(seq_len, world_size), world_size)


@functools.lru_cache(maxsize=16)
def _context_shards(
    seq_len: int, world_size: int
) -> tuple[list[torch.Tensor], list[tuple[tuple[int, int], ...]]]:
    """Zigzag context rows (positions, intervals) per rank; anchor-independent, so cached across steps."""
    if world_size == 1:
        return [torch.arange(seq_len)], [((0, seq_len),)]
    zig = _zigzag(seq_len, world_size)
    return [zig.rank_positions(r) for r in range(world_size)], [
        tuple(zig.rank_intervals(r)) for r in range(world_size)
    ]


def drafter_plans(
    mode: str,
    seq_len: int,
    anchors: torch.Tensor,
    config: DFlashConfig,
    world_size: int,
    *,
    bucket: int = 1,
) -> list[DrafterPlan]:
    """Every rank's plan for one sequence (pure: each rank computes all and keeps its own)."""
    if mode not in DRAFTER_MODES:
        raise ValueError(f"mode must be one of {', '.join(DRAFTER_MODES)}; got {mode!r}")
    if mode in ("reference", "dp") and world_size != 1:
        raise ValueError(f"mode {mode!r} plans one sequence on one rank (world_size 1); got {world_size}")
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1; got {bucket}")
    anchors = anchors.to(torch.long).cpu()
    L, S, P, N = seq_len, config.draft_block_size, world_size, anchors.numel()
    if N == 0:
        raise ValueError("anchors: a drafter step needs at least one anchor")
    if int(anchors.max()) >= L - 1 or int(anchors.min()) < 0:
        raise ValueError(
            f"anchors must lie in [0, seq_len - 1) = [0, {L - 1}); got {anchors.min()}..{anchors.max()}"
        )
    everything = torch.arange(N)
    ctx_pos, intervals = _context_shards(L, P)
    if mode == "csbp":
        # windows local where the load allows it (only sliding-window layers can gather less)
        near = "sliding_attention" in config.layer_types and P > 1
        owned = (own_anchors_near_context(anchors, config, P, L) if near else None) or own_anchor_runs(
            anchors, config, P
        )
    else:
        owned = [everything] * P
    q_rows = [L + (owned[r][:, None] * S + torch.arange(S)).reshape(-1) for r in range(P)]
    q_tok = [_block_tokens(anchors, owned[r], S) for r in range(P)]
    shares = P > 1 and mode == "csbp"  # CP merges partial outputs instead of sharing K/V
    merge = P > 1 and mode == "cp"
    # CP: the blocks' own keys are everywhere but must count once in the merged output -> PAD beyond rank 0
    own_keys = [
        q_tok[r] if not (merge and r) else q_tok[r].masked(torch.ones(len(q_tok[r]), dtype=torch.bool))
        for r in range(P)
    ]

    layers: list[dict[str, LayerPlan]] = [{} for _ in range(P)]
    for kind in dict.fromkeys(config.layer_types):
        window = config.sliding_window if kind == "sliding_attention" else None
        causal = config.sliding_layers_causal if window is not None else False
        kv_rows, kv_tok, shared, index = [], [], [], []
        for r in range(P):
            if window is None:
                keep, idx = ctx_pos[r], None
                shared.append(torch.arange(len(keep)) if shares else keep[:0])  # every context row
            else:
                in_shard = torch.zeros(L, dtype=torch.bool)
                in_shard[ctx_pos[r]] = True
                own_need = _window_need(anchors[owned[r]], L, window)
                if not shares:
                    other_need = torch.zeros(L, dtype=torch.bool)
                else:
                    others = torch.cat([owned[o] for o in range(P) if o != r])
                    other_need = _window_need(anchors[others], L, window)
                needed = in_shard & (own_need | other_need)
                keep_mask = _padded(needed, in_shard & ~needed, bucket)  # padding rows: nobody's window
                share_mask = in_shard & other_need
                if shares:  # padding rows: in no other rank's window
                    share_mask = _padded(share_mask, keep_mask & ~share_mask, bucket)
                keep = torch.nonzero(keep_mask).flatten()
                # rows of positions by lookup, not binary search (5x faster at 512K): both are subsets
                row = torch.empty(L, dtype=torch.long)
                row[ctx_pos[r]] = torch.arange(len(ctx_pos[r]))
                idx = row[keep]  # keep's rows in the local context
                row[keep] = torch.arange(len(keep))
                shared.append(row[share_mask])  # shared positions' rows in keep (share_mask within keep_mask)
            kv_rows.append(torch.cat([keep, q_rows[r]]))
            kv_tok.append(TokenSet.cat([_ctx_tokens(keep), own_keys[r]]))
            index.append(idx)
        shards = build_plans(q_rows, q_tok, kv_rows, kv_tok, shared)
        for r in range(P):
            layers[r][kind] = LayerPlan(shards[r], index[r], window, causal, merge)

    plans = []
    for r in range(P):
        plans.append(
            DrafterPlan(
                mode=mode,
                rank=r,
                world_size=P,
                seq_len=L,
                block_size=S,
                anchors=anchors,
                owned=owned[r],
                loss_scale=1.0 / P if mode == "cp" else 1.0,
                sequence_share=1.0 / P,
                ctx_positions=ctx_pos[r],
                ctx_intervals=intervals[r],
                layers=layers[r],
            )
        )
    return plans


class MergedAttention:
    """CP: attention of the (replicated) queries over this rank's keys, merged over the group by LSE."""

    def __init__(self, local: ShardedAttention, group, stats: CommStats, communicate: bool = True):
        self.local, self.group, self.stats, self.communicate = local, group, stats, communicate

    def prepare(self, device: torch.device | str, groups: int) -> None:
        self.local.prepare(device, groups)

    def begin(self, k_lead, v_lead) -> None:
        """Nothing to gather ahead (returns None): CP gathers the partial outputs, after its call."""

    def __call__(self, q, k, v, *, scale=None, gathered=None):
        if gathered is not None:
            raise ValueError("gathered: CP gathers no K/V (begin returned None)")
        out, lse = self.local(q, k, v, scale=scale)
        # every rank's partial result; backward reduce-scatters (each rank's replica fed its own loss copy)
        gather = dict(group=self.group, stats=self.stats, communicate=self.communicate, label="_partials")
        outs, lses = all_gather_rows(out, **gather), all_gather_rows(lse, **gather)
        out, lse = outs[0], lses[0]
        for p in range(1, outs.shape[0]):
            out, lse = merge_partials(out, lse, outs[p], lses[p])
        return out, lse


def plan_attention(
    plan: DrafterPlan,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    communicate: bool = True,
    stats: CommStats = COMM_STATS,
    regather: bool = False,
    schedule: str | None = None,
    pack_gqa: bool | None = None,
    gather_ahead: bool = True,
) -> dict[str, LayerAttention]:
    """The model's `attention` argument for this rank's plan (one executor per layer type).
    `gather_ahead`: layer types whose plan gathers context K/V (CSBP) start that gather one layer early
    (`LayerAttention.gather_ahead`).
    `regather`: free each layer's gathered context K/V after forward and gather it again in backward.
    `schedule`: ShardedAttention's ("fused" by default, "overlap" when regather); `pack_gqa`: the seam's
    GQA head packing (None: decided per call from the block masks)."""
    out = {}
    for kind, lp in plan.layers.items():
        attn = ShardedAttention(
            lp.shard, plan.block_size, window=lp.window, noisy_causal=lp.noisy_causal,
            group=group if plan.world_size > 1 else None, backend=backend, communicate=communicate, stats=stats,
            regather=regather, schedule=schedule, pack_gqa=pack_gqa,
        )  # fmt: skip
        ahead = gather_ahead and lp.shard.communicates and not lp.merge
        if lp.merge:
            attn = MergedAttention(attn, group, stats, communicate)
        out[kind] = LayerAttention(attn, lp.ctx_index, ahead)
    return out


def prepare_plan_attention(attention: Mapping[str, LayerAttention], device: torch.device | str, groups: int) -> None:
    """Build the masks of every layer type's attention (`plan_attention`'s result) now, for `groups` query
    heads per kv head, and stage the CSBP gather rows on `device`: the mask work of a step without its
    kernels (benchmarks time it as `prep_ms`). The context rows of sliding layers are staged with the
    step's other indices (prefetch.stage_indices)."""
    for layer in attention.values():
        layer.attend.prepare(device, groups)


def reference_attention(
    config: DFlashConfig, anchors: torch.Tensor, context_positions: torch.Tensor, *, backend: str = "auto"
) -> dict[str, LayerAttention]:
    """Single-process attention for blocks at `anchors` over context rows at `context_positions` (any set)."""
    anchors, ctx = anchors.to(torch.long).cpu(), context_positions.to(torch.long).reshape(-1).cpu()
    S = config.draft_block_size
    idx = torch.arange(anchors.numel())
    q_tok = _block_tokens(anchors, idx, S)
    top = int(ctx.max()) + 1 if ctx.numel() else 0
    q_rows = top + torch.arange(idx.numel() * S)
    kv_tok = TokenSet.cat([_ctx_tokens(ctx), q_tok])
    shard = build_plans(
        [q_rows], [q_tok], [torch.cat([ctx, q_rows])], [kv_tok], [torch.zeros(0, dtype=torch.long)]
    )[0]
    out = {}
    for kind in dict.fromkeys(config.layer_types):
        window = config.sliding_window if kind == "sliding_attention" else None
        causal = config.sliding_layers_causal if window is not None else False
        out[kind] = LayerAttention(
            ShardedAttention(shard, S, window=window, noisy_causal=causal, backend=backend)
        )
    return out

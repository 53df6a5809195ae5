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
from ...distributed.collectives import CommStats, all_gather_rows
from ...layout import CLEAN, NOISY, ShardPlan, TokenSet, ZigzagShards, assign_dual_end, assign_near_home
from ...layout.plans import build_plans, check_mode
from ...parallel.options import AttentionOptions
from ...parallel.sharded_attention import ShardedAttention
from .configuration import DFlashConfig
from .layer_attention import LayerAttention

__all__ = [
    "DRAFTER_MODES",
    "WHOLE_SHARD_MAX_LEFT_OUT",
    "DrafterPlan",
    "LayerPlan",
    "MergedAttention",
    "anchor_costs",
    "drafter_plans",
    "layer_rule",
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


def layer_rule(config: DFlashConfig, kind: str) -> tuple[int | None, bool]:
    """(window, noisy_causal) of a layer type: a sliding layer sees `sliding_window` context keys and is
    causal inside its block unless `is_causal` is false; a full layer sees all context, bidirectionally."""
    window = config.sliding_window if kind == "sliding_attention" else None
    return window, config.sliding_layers_causal if window is not None else False


def _check_inputs(mode: str, world_size: int, bucket: int, anchors: torch.Tensor, seq_len: int) -> None:
    check_mode(mode, DRAFTER_MODES)
    if mode in ("reference", "dp") and world_size != 1:
        raise ValueError(f"mode {mode!r} plans one sequence on one rank (world_size 1); got {world_size}")
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1; got {bucket}")
    if anchors.numel() == 0:
        raise ValueError("anchors: a drafter step needs at least one anchor")
    if int(anchors.max()) >= seq_len - 1 or int(anchors.min()) < 0:
        raise ValueError(
            f"anchors must lie in [0, seq_len - 1) = [0, {seq_len - 1}); got {anchors.min()}..{anchors.max()}"
        )


def _owners(mode: str, anchors: torch.Tensor, config: DFlashConfig, world_size: int, seq_len: int) -> list[torch.Tensor]:
    """Per rank, the indices of the anchors whose blocks it computes: CSBP owns them (windows local where the
    load allows it - only sliding-window layers can gather less), every other mode computes all of them."""
    if mode != "csbp":
        return [torch.arange(anchors.numel())] * world_size
    near = "sliding_attention" in config.layer_types and world_size > 1
    owned = own_anchors_near_context(anchors, config, world_size, seq_len) if near else None
    return owned or own_anchor_runs(anchors, config, world_size)


@dataclass(frozen=True)
class _RankBlocks:
    """One rank's draft blocks: their query rows (global numbering), tokens, and the tokens of their own keys."""

    q_rows: torch.Tensor
    q_tokens: TokenSet
    own_keys: TokenSet


def _rank_blocks(anchors: torch.Tensor, owned: torch.Tensor, seq_len: int, S: int, count_keys: bool) -> _RankBlocks:
    """`count_keys` False (CP beyond rank 0): the blocks' own keys are everywhere but must count once in the
    merged output, so they are PAD here."""
    q_rows = seq_len + (owned[:, None] * S + torch.arange(S)).reshape(-1)
    q_tok = _block_tokens(anchors, owned, S)
    keys = q_tok if count_keys else q_tok.masked(torch.ones(len(q_tok), dtype=torch.bool))
    return _RankBlocks(q_rows, q_tok, keys)


#: a sliding layer keeps its whole context shard when the anchors' windows would leave out at most this share
#: of it: selecting rows costs a copy of every kept row and, in backward, a scatter of its gradient, more
#: than the few rows' K/V projections and the attention tiles their mask skips
WHOLE_SHARD_MAX_LEFT_OUT = 1 / 16


def _window_rows(
    in_shard: torch.Tensor, ctx_pos: torch.Tensor, own_need: torch.Tensor, other_need: torch.Tensor | None, bucket: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A sliding layer's context rows on one rank: (positions kept, their rows in the local context - None
    when every row is kept -, the shared ones' rows in the kept). Kept: rows of the shard some anchor's window
    needs (own, or - when K/V are shared, `other_need` not None - another rank's), padded to a multiple of
    `bucket` with rows nobody's window needs; the whole shard when that leaves out little of it
    (WHOLE_SHARD_MAX_LEFT_OUT)."""
    needed = in_shard & (own_need | (other_need if other_need is not None else False))
    keep_mask = _padded(needed, in_shard & ~needed, bucket)
    shard_rows = int(in_shard.sum())
    whole = shard_rows - int(keep_mask.sum()) <= WHOLE_SHARD_MAX_LEFT_OUT * shard_rows
    if whole:
        keep_mask = in_shard
    share_mask = in_shard & other_need if other_need is not None else torch.zeros_like(in_shard)
    if other_need is not None:  # padding rows: in no other rank's window
        share_mask = _padded(share_mask, keep_mask & ~share_mask, bucket)
    keep = torch.nonzero(keep_mask).flatten()
    # rows of positions by lookup, not binary search (5x faster at 512K): both are subsets
    row = torch.empty(len(in_shard), dtype=torch.long)
    row[ctx_pos] = torch.arange(len(ctx_pos))
    idx = None if whole else row[keep]  # keep's rows in the local context
    row[keep] = torch.arange(len(keep))
    return keep, idx, row[share_mask]  # share_mask lies within keep_mask


def _layer_plans(
    window: int | None,
    causal: bool,
    anchors: torch.Tensor,
    owned: list[torch.Tensor],
    blocks: list[_RankBlocks],
    ctx_pos: list[torch.Tensor],
    *,
    seq_len: int,
    bucket: int,
    shares: bool,
    merge: bool,
) -> list[LayerPlan]:
    """Every rank's plan of one layer type: its context rows (all of the shard for full layers, the windows'
    rows for sliding ones), the shared ones, and its blocks as queries over [context ; own keys]."""
    P = len(owned)
    kv_rows, kv_tok, shared, index = [], [], [], []
    for r in range(P):
        if window is None:
            keep, idx = ctx_pos[r], None
            sh = torch.arange(len(keep)) if shares else keep[:0]  # every context row
        else:
            in_shard = torch.zeros(seq_len, dtype=torch.bool)
            in_shard[ctx_pos[r]] = True
            own_need = _window_need(anchors[owned[r]], seq_len, window)
            others = torch.cat([owned[o] for o in range(P) if o != r]) if shares else None
            other_need = None if others is None else _window_need(anchors[others], seq_len, window)
            keep, idx, sh = _window_rows(in_shard, ctx_pos[r], own_need, other_need, bucket)
        kv_rows.append(torch.cat([keep, blocks[r].q_rows]))
        kv_tok.append(TokenSet.cat([_ctx_tokens(keep), blocks[r].own_keys]))
        shared.append(sh)
        index.append(idx)
    q_rows, q_tok = [b.q_rows for b in blocks], [b.q_tokens for b in blocks]
    shards = build_plans(q_rows, q_tok, kv_rows, kv_tok, shared)
    return [LayerPlan(shards[r], index[r], window, causal, merge) for r in range(P)]


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
    anchors = anchors.to(torch.long).cpu()
    _check_inputs(mode, world_size, bucket, anchors, seq_len)
    L, S, P = seq_len, config.draft_block_size, world_size
    ctx_pos, intervals = _context_shards(L, P)
    owned = _owners(mode, anchors, config, P, L)
    merge = P > 1 and mode == "cp"  # CP merges partial outputs instead of sharing K/V
    blocks = [_rank_blocks(anchors, owned[r], L, S, count_keys=not (merge and r)) for r in range(P)]
    layers: list[dict[str, LayerPlan]] = [{} for _ in range(P)]
    for kind in dict.fromkeys(config.layer_types):
        per_rank = _layer_plans(
            *layer_rule(config, kind), anchors, owned, blocks, ctx_pos,
            seq_len=L, bucket=bucket, shares=P > 1 and mode == "csbp", merge=merge,
        )  # fmt: skip
        for r in range(P):
            layers[r][kind] = per_rank[r]
    return [
        DrafterPlan(
            mode=mode, rank=r, world_size=P, seq_len=L, block_size=S, anchors=anchors, owned=owned[r],
            loss_scale=1.0 / P if mode == "cp" else 1.0, sequence_share=1.0 / P, ctx_positions=ctx_pos[r],
            ctx_intervals=intervals[r], layers=layers[r],
        )
        for r in range(P)
    ]


class MergedAttention:
    """CP: attention of the (replicated) queries over this rank's keys, merged over the group by LSE."""

    def __init__(self, local: ShardedAttention, group, stats: CommStats):
        self.local, self.group, self.stats = local, group, stats

    def prepare(self, device: torch.device | str, groups: int) -> None:
        self.local.prepare(device, groups)

    def begin(self, k_lead, v_lead) -> None:
        """Nothing to gather ahead (returns None): CP gathers the partial outputs, after its call."""

    def __call__(self, q, k, v, *, scale=None, gathered=None):
        if gathered is not None:
            raise ValueError("gathered: CP gathers no K/V (begin returned None)")
        out, lse = self.local(q, k, v, scale=scale)
        # every rank's partial result; backward reduce-scatters (each rank's replica fed its own loss copy)
        gather = {"group": self.group, "stats": self.stats, "label": "_partials"}
        outs, lses = all_gather_rows(out, **gather), all_gather_rows(lse, **gather)
        out, lse = outs[0], lses[0]
        for p in range(1, outs.shape[0]):
            out, lse = merge_partials(out, lse, outs[p], lses[p])
        return out, lse


_DEFAULTS = AttentionOptions()


def plan_attention(
    plan: DrafterPlan, *, group: dist.ProcessGroup | None = None, options: AttentionOptions = _DEFAULTS
) -> dict[str, LayerAttention]:
    """The model's `attention` argument for this rank's plan: one executor per layer type, run as `options`
    say (parallel/options.py); with `options.gather_ahead`, layer types whose plan gathers context K/V (CSBP)
    start that gather one layer early (`LayerAttention.gather_ahead`)."""
    out = {}
    for kind, lp in plan.layers.items():
        attn = ShardedAttention(
            lp.shard, plan.block_size, window=lp.window, noisy_causal=lp.noisy_causal,
            group=group if plan.world_size > 1 else None, options=options,
        )  # fmt: skip
        ahead = options.gather_ahead and lp.shard.communicates and not lp.merge
        if lp.merge:
            attn = MergedAttention(attn, group, options.stats)
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
    config: DFlashConfig,
    anchors: torch.Tensor,
    context_positions: torch.Tensor,
    *,
    options: AttentionOptions = _DEFAULTS,
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
        window, causal = layer_rule(config, kind)
        out[kind] = LayerAttention(ShardedAttention(shard, S, window=window, noisy_causal=causal, options=options))
    return out

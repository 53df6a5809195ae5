"""Per-rank shard plans: which rows a rank queries, which keys it holds, which keys it shares.

Rows are numbered in the reference's 2L order (clean positions 0..L-1, then corrupted L..2L-1):

    reference row:   0 ........ L-1 | L ........ 2L-1
                     clean x0        | corrupted xt

A `ShardPlan` says, for one rank: its query rows, its key rows, and which of its key rows are shared (their
K/V are all-gathered by every rank each layer). One executor runs every plan; the modes differ only here:

    mode       query/key rows of rank r                                  shared key rows
    reference  all 2L rows (P = 1)                                       none
    cp         clean + corrupted rows at zigzag positions of r           all of them (both copies)
    bp         corrupted rows of r's blocks + clean prefix they need     none (clean prefix replicated)
    csbp       corrupted rows of r's blocks + clean zigzag shard of r    clean shard only

Corrupted blocks are owned whole (dual-end, `assignment.py`); clean shards are zigzag (`zigzag.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .assignment import Assignment, assign_dual_end
from .tokens import CLEAN, NOISY, TokenSet
from .zigzag import ZigzagShards, check_block_shape

__all__ = [
    "MODES",
    "ShardPlan",
    "bdlm_plan",
    "block_assignment",
    "build_plans",
    "check_bdlm_shape",
    "check_mode",
    "clean_keys_needed_elsewhere",
]

MODES = ("reference", "cp", "bp", "csbp")


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds for one attention call (see module docstring)."""

    rank: int
    world_size: int
    q_rows: torch.Tensor  # global row ids of local query rows
    q_tokens: TokenSet
    kv_rows: torch.Tensor  # global row ids of local key/value rows
    kv_tokens: TokenSet
    shared: torch.Tensor  # indices into the local kv rows whose K/V every rank gathers
    shared_counts: tuple[int, ...]  # len(shared) on every rank (the gathered buffer is padded to the max)
    remote_kv_tokens: TokenSet  # tokens of the gathered buffer, this rank's own segment turned to PAD
    q_primary: torch.Tensor  # bool per query row: this rank is the row's unique owner (False on replicas)

    @property
    def gather_len(self) -> int:
        """Rows of each rank's segment in the gathered buffer (padded to the largest shard)."""
        return max(self.shared_counts) if self.shared_counts else 0

    @property
    def communicates(self) -> bool:
        return self.world_size > 1 and self.gather_len > 0

    def segment_tokens(self, rank: int) -> TokenSet:
        """Tokens of rank `rank`'s segment of the gathered buffer (all PAD for this rank's own)."""
        width = self.gather_len
        return self.remote_kv_tokens.select(torch.arange(rank * width, (rank + 1) * width))

    @property
    def other_kv_tokens(self) -> TokenSet:
        """`remote_kv_tokens` without the own segment: the gathered keys a single fused call needs."""
        return TokenSet.cat([self.segment_tokens(r) for r in range(self.world_size) if r != self.rank])

    @property
    def shares_leading_rows(self) -> bool:
        """The shared rows are the first local rows, in order (full layers share every context row): the
        executor can take them as a slice."""
        return bool(torch.equal(self.shared.cpu(), torch.arange(len(self.shared))))


def build_plans(
    q_rows: list[torch.Tensor],
    q_tokens: list[TokenSet],
    kv_rows: list[torch.Tensor],
    kv_tokens: list[TokenSet],
    shared: list[torch.Tensor],
) -> list[ShardPlan]:
    """Assemble every rank's plan from per-rank row/token lists (pure; every rank computes all of them)."""
    world = len(q_rows)
    counts = tuple(int(s.numel()) for s in shared)
    width = max(counts) if counts else 0
    segments = [kv_tokens[r].select(shared[r]).padded(width) for r in range(world)]
    seen: set[int] = set()
    primary = []
    for r in range(world):
        rows = q_rows[r].tolist()
        primary.append(torch.tensor([row not in seen for row in rows], dtype=torch.bool))
        seen.update(rows)
    plans = []
    for r in range(world):
        own = torch.zeros(world * width, dtype=torch.bool)
        own[r * width : (r + 1) * width] = True
        plans.append(
            ShardPlan(
                rank=r,
                world_size=world,
                q_rows=q_rows[r],
                q_tokens=q_tokens[r],
                kv_rows=kv_rows[r],
                kv_tokens=kv_tokens[r],
                shared=shared[r],
                shared_counts=counts,
                remote_kv_tokens=TokenSet.cat(segments).masked(own),
                q_primary=primary[r],
            )
        )
    return plans


def check_mode(mode: str, allowed: Sequence[str] = MODES) -> None:
    """The one error for an unknown mode: the BDLM modes by default, or a caller's own (drafter, planner)."""
    if mode not in allowed:
        raise ValueError(f"mode must be one of {', '.join(allowed)}; got {mode!r}")


def check_bdlm_shape(mode: str, seq_len: int, block_size: int, world_size: int) -> None:
    """One-line errors for shapes no mode can run."""
    check_mode(mode)
    check_block_shape(seq_len, block_size, world_size)
    if mode == "reference" and world_size != 1:
        raise ValueError(f"mode 'reference' runs on world_size 1, got {world_size}")
    blocks = seq_len // block_size
    if blocks < world_size:
        raise ValueError(
            f"seq_len/block_size = {blocks} blocks < world_size = {world_size}: "
            f"every rank needs at least one block (use fewer ranks or a longer sequence)"
        )


def block_assignment(num_blocks: int, world_size: int) -> Assignment:
    """Dual-end ownership of corrupted blocks. Block b's visible pairs grow with b (S*S own + b*S*S clean)."""
    return assign_dual_end([float(b + 1) for b in range(num_blocks)], world_size, what="blocks")


def _noisy_rows(blocks: tuple[int, ...], block_size: int, seq_len: int) -> torch.Tensor:
    if not blocks:
        return torch.zeros(0, dtype=torch.long)
    return seq_len + torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in blocks])


def _tokens_of_rows(rows: torch.Tensor, seq_len: int, block_size: int) -> TokenSet:
    """TokenSet for global 2L rows (clean rows < L, corrupted rows >= L)."""
    clean = rows < seq_len
    pos = torch.where(clean, rows, rows - seq_len)
    block = torch.div(pos, block_size, rounding_mode="floor")
    kind = torch.where(clean, CLEAN, NOISY)
    return TokenSet(pos, kind, block, block * block_size)


def bdlm_plan(mode: str, seq_len: int, block_size: int, world_size: int) -> list[ShardPlan]:
    """Plans of all ranks for one BDLM sequence of `seq_len` clean tokens in blocks of `block_size`."""
    check_bdlm_shape(mode, seq_len, block_size, world_size)
    L, S, P = seq_len, block_size, world_size
    rows: list[torch.Tensor] = []
    shared: list[torch.Tensor] = []
    if mode == "reference":
        rows = [torch.arange(2 * L)]
        shared = [torch.zeros(0, dtype=torch.long)]
    elif mode == "cp":
        zig = ZigzagShards(L, S, P)
        for r in range(P):
            pos = zig.rank_positions(r)
            rows.append(torch.cat([pos, L + pos]))
            shared.append(torch.arange(2 * pos.numel()))
    else:
        owned = block_assignment(L // S, P).items
        zig = ZigzagShards(L, S, P)
        for r in range(P):
            noisy = _noisy_rows(owned[r], S, L)
            if mode == "csbp":
                clean = zig.rank_positions(r)
            else:  # bp: the clean prefix r's blocks need; the last block's owner also keeps the last clean
                # block so every reference row is computed somewhere (nothing depends on it).
                last = max(owned[r])
                clean = torch.arange((last + (1 if last == L // S - 1 else 0)) * S)
            rows.append(torch.cat([clean, noisy]))
            shared.append(torch.arange(clean.numel()) if mode == "csbp" else torch.zeros(0, dtype=torch.long))
    tokens = [_tokens_of_rows(r, L, S) for r in rows]
    return build_plans(rows, tokens, rows, tokens, shared)




def clean_keys_needed_elsewhere(plans: list[ShardPlan], window: int) -> list[torch.Tensor]:
    """Per rank: bool over its local key rows, True for clean keys that some OTHER rank's query sees under
    a sliding window of `window` clean keys (clean query p: (p - W, p]; corrupted query: (p - W, start)).

    These are the only rows a windowed layer would have to share. With dual-end block ownership every
    rank's corrupted blocks are spread over the whole sequence, so nearly every clean key lies in some
    other rank's window (> 99.9% for 64K, S = 32, P = 2..8, W = 512..4096): a windowed gather would save
    almost nothing, which is why sliding BDLM layers gather the full shard (docs/bdlm.md)."""
    out = []
    seq_len = max(int(p.q_tokens.pos.max()) for p in plans) + 1
    for r, plan in enumerate(plans):
        cover = torch.zeros(seq_len + 1, dtype=torch.long)  # +1 / -1 at the ends of each window: a prefix sum
        for o, other in enumerate(plans):
            if o == r:
                continue
            q = other.q_tokens
            hi = torch.where(q.kind == CLEAN, q.pos + 1, torch.where(q.kind == NOISY, q.start, q.pos))
            lo = (q.pos - window + 1).clamp_min(0)
            live = hi > lo
            cover.index_add_(0, lo[live], torch.ones_like(lo[live]))
            cover.index_add_(0, hi[live], -torch.ones_like(hi[live]))
        inside = cover.cumsum(0)[:seq_len] > 0
        k = plan.kv_tokens
        out.append((k.kind == CLEAN) & inside[k.pos.clamp(0, seq_len - 1)])
    return out

"""Zigzag sharding of the clean sequence.

The clean sequence (L tokens, B = L/S blocks) is cut into 2P chunks on block boundaries; rank r holds
chunks r and 2P-1-r, so every rank gets one early (cheap causal) and one late (expensive) chunk:

    P = 2, 2P = 4 chunks:   | c0 | c1 | c2 | c3 |
                              r0   r1   r1   r0

Chunks lie on block boundaries. When B is not divisible by 2P, every rank still holds B//P or B//P + 1
blocks (the first B % P ranks one more): rank r's n_r blocks split into an early chunk of n_r//2 blocks and
a late chunk of the rest, so all-gathered shards are equal whenever P divides B (no padding) and differ by
one block otherwise. Early chunks may be empty when B < 2P.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ZigzagShards", "check_block_shape"]


def check_block_shape(seq_len: int, block_size: int, world_size: int) -> None:
    """One-line errors for a sequence no layout can cut: whole blocks of >= 1 token, >= 1 rank."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if seq_len < 1 or seq_len % block_size:
        raise ValueError(f"seq_len must be a positive multiple of block_size={block_size}, got {seq_len}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


@dataclass(frozen=True)
class ZigzagShards:
    seq_len: int
    block_size: int
    world_size: int

    def __post_init__(self) -> None:
        check_block_shape(self.seq_len, self.block_size, self.world_size)

    @property
    def num_blocks(self) -> int:
        return self.seq_len // self.block_size

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """Token bounds [lo, hi) of the 2P chunks, in sequence order."""
        p, b, s = self.world_size, self.num_blocks, self.block_size
        per_rank = [b // p + (1 if r < b % p else 0) for r in range(p)]
        sizes = [n // 2 for n in per_rank] + [n - n // 2 for n in reversed(per_rank)]
        bounds, lo = [], 0
        for size in sizes:
            bounds.append((lo * s, (lo + size) * s))
            lo += size
        return bounds

    def rank_chunks(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.world_size - 1 - rank

    def rank_intervals(self, rank: int) -> list[tuple[int, int]]:
        """The (at most two) token intervals rank `rank` holds, in sequence order."""
        bounds = self.chunk_bounds()
        return [bounds[c] for c in self.rank_chunks(rank) if bounds[c][1] > bounds[c][0]]

    def rank_positions(self, rank: int) -> torch.Tensor:
        parts = [torch.arange(lo, hi) for lo, hi in self.rank_intervals(rank)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def owner_of(self) -> torch.Tensor:
        """owner[p] = the rank holding clean position p."""
        return self.owner_at(torch.arange(self.seq_len))

    def owner_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The rank holding each of `positions` (in [0, seq_len)), from the chunk bounds: no [L] table."""
        ends = torch.tensor([hi for _, hi in self.chunk_bounds()], dtype=torch.long)
        chunk = torch.searchsorted(ends, positions.to(torch.long), right=True)
        p = self.world_size
        return torch.where(chunk < p, chunk, 2 * p - 1 - chunk)

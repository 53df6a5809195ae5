"""Zigzag sharding of the clean sequence.

The clean sequence (L tokens, B = L/S blocks) is cut into 2P chunks on block boundaries; rank r holds
chunks r and 2P-1-r, so every rank gets one early (cheap causal) and one late (expensive) chunk:

    P = 2, 2P = 4 chunks:   | c0 | c1 | c2 | c3 |
                              r0   r1   r1   r0

When B is not divisible by 2P the chunk bounds are floor(c*B/2P) blocks, so chunk sizes differ by at most
one block (and chunks may be empty when B < 2P).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ZigzagShards"]


@dataclass(frozen=True)
class ZigzagShards:
    seq_len: int
    block_size: int
    world_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.seq_len < 1 or self.seq_len % self.block_size:
            raise ValueError(
                f"seq_len must be a positive multiple of block_size={self.block_size}, got {self.seq_len}"
            )

    @property
    def num_blocks(self) -> int:
        return self.seq_len // self.block_size

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """Token bounds [lo, hi) of the 2P chunks, in sequence order."""
        n, b, s = 2 * self.world_size, self.num_blocks, self.block_size
        return [((c * b // n) * s, ((c + 1) * b // n) * s) for c in range(n)]

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
        owner = torch.empty(self.seq_len, dtype=torch.long)
        for r in range(self.world_size):
            owner[self.rank_positions(r)] = r
        return owner

"""TokenSet: the per-token facts the visibility rule needs, for any set of rows in any order.

A token is described by four integers, so one rule serves BDLM training and DFlash drafters alike:

    pos    position id (clean token p and corrupted token p share pos = p)
    kind   CLEAN, NOISY (corrupted / draft-block token) or PAD (never visible)
    block  block id (noisy tokens see noisy keys of the same block id only)
    start  first position of the token's block (noisy queries see clean keys with pos < start)

For BDLM, block = pos // S and start = block * S. For a DFlash draft block anchored at position a,
block = anchor index and start = a.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CLEAN", "NOISY", "PAD", "TokenSet"]

PAD, CLEAN, NOISY = 0, 1, 2


@dataclass(frozen=True)
class TokenSet:
    """Per-row token attributes (all 1-D, same length, CPU int64)."""

    pos: torch.Tensor
    kind: torch.Tensor
    block: torch.Tensor
    start: torch.Tensor

    def __post_init__(self) -> None:
        n = self.pos.numel()
        for name in ("kind", "block", "start"):
            if getattr(self, name).numel() != n:
                raise ValueError(f"TokenSet.{name} has {getattr(self, name).numel()} rows, pos has {n}")

    def __len__(self) -> int:
        return self.pos.numel()

    # -- constructors -------------------------------------------------------------------------
    @staticmethod
    def bdlm(positions: torch.Tensor, kind: int, block_size: int) -> TokenSet:
        """BDLM tokens at `positions`, all of one kind; blocks are the aligned S-grid."""
        positions = positions.to(torch.long)
        block = torch.div(positions, block_size, rounding_mode="floor")
        return TokenSet(positions, torch.full_like(positions, kind), block, block * block_size)

    @staticmethod
    def empty() -> TokenSet:
        z = torch.zeros(0, dtype=torch.long)
        return TokenSet(z, z, z, z)

    @staticmethod
    def cat(sets: list[TokenSet]) -> TokenSet:
        if not sets:
            return TokenSet.empty()
        return TokenSet(*(torch.cat([getattr(s, f) for s in sets]) for f in ("pos", "kind", "block", "start")))

    # -- transforms -----------------------------------------------------------------------------
    def select(self, index: torch.Tensor) -> TokenSet:
        return TokenSet(self.pos[index], self.kind[index], self.block[index], self.start[index])

    def padded(self, length: int) -> TokenSet:
        """Append PAD rows up to `length` (padding of uneven all-gather shards)."""
        extra = length - len(self)
        if extra < 0:
            raise ValueError(f"cannot pad {len(self)} rows down to {length}")
        pad = torch.zeros(extra, dtype=torch.long)
        return TokenSet.cat([self, TokenSet(pad, pad, pad, pad)])

    def masked(self, hide: torch.Tensor) -> TokenSet:
        """Copy with rows in boolean `hide` turned into PAD (never visible)."""
        return TokenSet(self.pos, torch.where(hide, PAD, self.kind), self.block, self.start)

    def to(self, device: torch.device | str) -> TokenSet:
        return TokenSet(*(getattr(self, f).to(device) for f in ("pos", "kind", "block", "start")))

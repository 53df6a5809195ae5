"""The visibility rule of block-diffusion training (query -> key), for BDLM and DFlash alike.

For L = 8, S = 4 (two blocks), causal clean rule; rows are queries, columns keys, '#' visible:

                     clean keys        corrupted keys
                   b0 . . . b1 . . .   b0 . . . b1 . . .
    clean   b0     # . . .  . . . .    . . . .  . . . .
                   # # . .  . . . .    . . . .  . . . .
                   # # # .  . . . .    . . . .  . . . .
                   # # # #  . . . .    . . . .  . . . .
            b1     # # # #  # . . .    . . . .  . . . .
                   # # # #  # # . .    . . . .  . . . .
                   # # # #  # # # .    . . . .  . . . .
                   # # # #  # # # #    . . . .  . . . .
    corrupt b0     . . . .  . . . .    # # # #  . . . .
                   . . . .  . . . .    # # # #  . . . .   (corrupted keys of a block are seen by
                   . . . .  . . . .    # # # #  . . . .    that block only; corrupted queries see
                   . . . .  . . . .    # # # #  . . . .    clean keys of earlier blocks)
            b1     # # # #  . . . .    . . . .  # # # #
                   # # # #  . . . .    . . . .  # # # #
                   # # # #  . . . .    . . . .  # # # #
                   # # # #  . . . .    . . . .  # # # #

- clean query -> clean keys with pos <= q.pos ("causal"), or in blocks <= its own ("bidirectional");
- corrupted query -> corrupted keys of the same block id, and clean keys with pos < its block start;
- PAD keys are never visible.
A DFlash draft block is a run of NOISY tokens with block = anchor index and start = anchor position, and
the context is CLEAN tokens without queries: the same rule gives "context < anchor + own block".

Two optional restrictions (both off by default) serve sliding-window drafter layers, still one rule:
- window W: a query at position p sees clean keys only at positions > p - W (W keys up to p itself);
  for a draft slot at p = anchor + j that is the context range [p - W + 1, anchor). Noisy keys are not
  windowed (a block never exceeds the window);
- noisy_causal: a noisy query sees the noisy keys of its own block only at positions <= its own.
For a draft block at anchor a = 6 (S = 3) with W = 4, rows = slots, columns = context 0..5 | own block:

    slot 0 (p=6)   . . . # # #  | # . .       (noisy_causal)
    slot 1 (p=7)   . . . . # #  | # # .
    slot 2 (p=8)   . . . . . #  | # # #
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..layout.tokens import CLEAN, NOISY, TokenSet

__all__ = ["CLEAN_RULES", "visible", "Visibility"]

CLEAN_RULES = ("causal", "bidirectional")


def visible(
    q_pos: torch.Tensor,
    q_kind: torch.Tensor,
    q_block: torch.Tensor,
    q_start: torch.Tensor,
    k_pos: torch.Tensor,
    k_kind: torch.Tensor,
    k_block: torch.Tensor,
    block_size: int,
    clean_bidirectional: bool,
    window: int | None = None,
    noisy_causal: bool = False,
) -> torch.Tensor:
    """The rule, elementwise with broadcasting (also traced inside FlexAttention's mask_mod)."""
    q_clean = q_kind == CLEAN
    q_noisy = q_kind == NOISY
    clean_limit = (k_pos < q_start + block_size) if clean_bidirectional else (k_pos <= q_pos)
    sees_clean = (k_kind == CLEAN) & ((q_clean & clean_limit) | (q_noisy & (k_pos < q_start)))
    if window is not None:
        sees_clean = sees_clean & (k_pos > q_pos - window)
    same_block = k_block == q_block
    if noisy_causal:
        same_block = same_block & (k_pos <= q_pos)
    sees_noisy = (k_kind == NOISY) & q_noisy & same_block
    return sees_clean | sees_noisy


@dataclass(eq=False)
class Visibility:
    """Which of `k`'s rows each of `q`'s rows may attend to. Masks are built lazily and cached."""

    q: TokenSet
    k: TokenSet
    block_size: int
    clean_within_block: str = "causal"
    window: int | None = None  # sliding window on clean keys (None: unlimited)
    noisy_causal: bool = False  # noisy queries see their own block causally
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.clean_within_block not in CLEAN_RULES:
            raise ValueError(
                f"clean_within_block must be one of {', '.join(CLEAN_RULES)}; got {self.clean_within_block!r}"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be None or >= 1, got {self.window}")

    @property
    def bidirectional(self) -> bool:
        return self.clean_within_block == "bidirectional"

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[Nq, Nk] boolean mask."""
        key = ("dense", str(device))
        if key not in self._cache:
            q, k = self.q.to(device), self.k.to(device)
            self._cache[key] = visible(
                q.pos[:, None], q.kind[:, None], q.block[:, None], q.start[:, None],
                k.pos[None, :], k.kind[None, :], k.block[None, :],
                self.block_size, self.bidirectional, self.window, self.noisy_causal,
            )  # fmt: skip
        return self._cache[key]

    def mask_mod(self, device: torch.device | str) -> Callable[..., torch.Tensor]:
        """FlexAttention mask_mod(b, h, q_idx, kv_idx) evaluating the same rule by row lookup."""
        q, k = self.q.to(device), self.k.to(device)
        size, bidir, window, causal = self.block_size, self.bidirectional, self.window, self.noisy_causal

        def mask_mod(b, h, q_idx, kv_idx):  # noqa: ARG001 - FlexAttention's signature
            return visible(
                q.pos[q_idx], q.kind[q_idx], q.block[q_idx], q.start[q_idx],
                k.pos[kv_idx], k.kind[kv_idx], k.block[kv_idx], size, bidir, window, causal,
            )  # fmt: skip

        return mask_mod

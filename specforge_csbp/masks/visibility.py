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

Two optional restrictions (both off by default) serve sliding-window layers (drafter and BDLM), still
one rule:
- window W: a query at position p sees clean keys only at positions > p - W (W keys up to p itself),
  measured from the QUERY's own position, for clean and noisy queries alike; for a draft slot at
  p = anchor + j that is the context range [p - W + 1, anchor). Noisy keys are not windowed (a block
  never exceeds the window: S <= W is required);
- noisy_causal: a noisy query sees the noisy keys of its own block only at positions <= its own.
For a draft block at anchor a = 6 (S = 3) with W = 4, rows = slots, columns = context 0..5 | own block:

    slot 0 (p=6)   . . . # # #  | # . .       (noisy_causal)
    slot 1 (p=7)   . . . . # #  | # # .
    slot 2 (p=8)   . . . . . #  | # # #

In BDLM training (sliding layers of Gemma 3, Qwen2, Mistral...) that reads, for L = 12, S = 4, W = 6,
causal clean rule (rows = queries at positions 0..11, columns = clean keys 0..11 | own corrupted block):

                      clean keys 0..11              own block
    clean   p=5       # # # # # # . . . . . .
            p=9       . . . . # # # # # # . .       (clean: p - W < pos <= p, the causal window)
    corrupt b2 p=8    . . . # # # # # . . . .    |  # # # #   (clean pos in (p - W, start = 8))
               p=9    . . . . # # # # . . . .    |  # # # #
               p=11   . . . . . . # # . . . .    |  # # # #

  The window of a corrupted query is measured from its own position p, not from its block start: the
  served model denoises block b with the clean blocks < b in its KV cache, and its sliding layer lets
  the query at p attend to cached keys with p - pos < W (transformers' sliding mask and flash-attention
  window alike) plus its own block. Training the corrupted block on that same window is what makes the
  trained denoiser the one the served model runs (tests/models/bdlm/test_families_vs_transformers.py checks it against
  transformers' own sliding-window forward).

Evaluated as ranges. Every key gets one coordinate x and every query two half-open ranges, so a mask
entry is four integer compares (int32 inside FlexAttention's mask_mod, which runs on every element of a
partially visible tile - the old per-element lookups of seven int64 token fields cost more than the tile's
matrix products):

    key x:   clean -> pos          noisy -> NOISY_BASE + block * S + (pos - start)         PAD -> PAD_COORD
    query:   sees x in [lo, hi)  or  x in [noisy_lo, noisy_hi)

                    [lo, hi) on clean positions                    [noisy_lo, noisy_hi)
    clean query     [p - W + 1 or 0,  p + 1 | start + S)           empty
    noisy query     [p - W + 1 or 0,  start)                       own block: base + block S + [0, S | p - start + 1)
    PAD query       empty                                          empty

Exact for token sets whose noisy tokens lie inside their block (0 <= pos - start < S, block >= 0), with
positions and block * S below MAX_POSITION (checked; every plan of this package satisfies it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..devices import stage_index
from ..layout.tokens import CLEAN, NOISY, TokenSet

__all__ = ["CLEAN_RULES", "MAX_POSITION", "Visibility", "key_coordinates", "query_ranges", "visible"]

CLEAN_RULES = ("causal", "bidirectional")
MAX_POSITION = 1 << 29  # positions and block * S stay below this, so every coordinate fits int32
NOISY_BASE = 1 << 30  # noisy keys' coordinates start above every clean position
PAD_COORD = -(1 << 30)  # below every range (ranges start at >= -(window - 1) or at 0)


def _check(tokens: TokenSet, block_size: int, what: str) -> None:
    if len(tokens) == 0:
        return
    if int(tokens.pos.min()) < 0 or int(tokens.pos.max()) >= MAX_POSITION:
        raise ValueError(f"{what}: positions must lie in [0, {MAX_POSITION}); got {tokens.pos.min()}..{tokens.pos.max()}")
    noisy = tokens.kind == NOISY
    if bool(noisy.any()):
        offset, block = (tokens.pos - tokens.start)[noisy], tokens.block[noisy]
        if int(offset.min()) < 0 or int(offset.max()) >= block_size:
            raise ValueError(f"{what}: a noisy token must lie inside its block (0 <= pos - start < {block_size})")
        if int(block.min()) < 0 or int(block.max()) * block_size >= MAX_POSITION:
            raise ValueError(f"{what}: noisy block ids must lie in [0, {MAX_POSITION // block_size})")


def key_coordinates(k: TokenSet, block_size: int) -> torch.Tensor:
    """x [Nk] (int64): clean -> pos, noisy -> NOISY_BASE + block * S + (pos - start), PAD -> PAD_COORD."""
    _check(k, block_size, "keys")
    noisy = NOISY_BASE + k.block * block_size + (k.pos - k.start)
    x = torch.where(k.kind == NOISY, noisy, torch.full_like(k.pos, PAD_COORD))
    return torch.where(k.kind == CLEAN, k.pos, x)


def query_ranges(
    q: TokenSet, block_size: int, *, bidirectional: bool, window: int | None = None, noisy_causal: bool = False
) -> torch.Tensor:
    """[4, Nq] (int64): (lo, hi, noisy_lo, noisy_hi); query i sees keys with x in [lo, hi) or [noisy_lo, noisy_hi)."""
    _check(q, block_size, "queries")
    clean, noisy = q.kind == CLEAN, q.kind == NOISY
    zero = torch.zeros_like(q.pos)
    lo = q.pos - (window - 1) if window is not None else zero
    clean_hi = q.start + block_size if bidirectional else q.pos + 1
    hi = torch.where(clean, clean_hi, torch.where(noisy, q.start, zero))
    lo = torch.where(clean | noisy, lo, zero)
    own = NOISY_BASE + q.block * block_size
    width = q.pos - q.start + 1 if noisy_causal else torch.full_like(q.pos, block_size)
    noisy_lo = torch.where(noisy, own, zero)
    noisy_hi = torch.where(noisy, own + width, zero)
    return torch.stack([lo, hi, noisy_lo, noisy_hi])


def visible(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, noisy_lo: torch.Tensor, noisy_hi: torch.Tensor
) -> torch.Tensor:
    """The rule, elementwise with broadcasting (also traced inside FlexAttention's mask_mod)."""
    return ((x >= lo) & (x < hi)) | ((x >= noisy_lo) & (x < noisy_hi))


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
        if self.window is not None and not 1 <= self.window < MAX_POSITION:
            raise ValueError(f"window must be None or in [1, {MAX_POSITION}), got {self.window}")

    @property
    def bidirectional(self) -> bool:
        return self.clean_within_block == "bidirectional"

    def tables(
        self,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.int64,
        *,
        q_len: int | None = None,
        k_len: int | None = None,
    ):
        """(key coordinates [k_len], query ranges [4, q_len]) on `device` (cached). Lengths beyond the token
        sets (whole kernel tiles) are PAD rows: coordinate PAD_COORD, empty ranges - they see nothing."""
        q_len, k_len = q_len or len(self.q), k_len or len(self.k)
        key = ("tables", str(device), dtype, q_len, k_len)
        if key not in self._cache:
            x = torch.full((k_len,), PAD_COORD, dtype=torch.long)
            x[: len(self.k)] = self.coordinates()
            r = torch.zeros(4, q_len, dtype=torch.long)
            r[:, : len(self.q)] = self.ranges()
            # pinned + non_blocking on a GPU: the building thread never waits for the stream's queue
            self._cache[key] = (stage_index(x.to(dtype), device), stage_index(r.to(dtype), device))
        return self._cache[key]

    def coordinates(self) -> torch.Tensor:
        """key_coordinates of `k` (CPU, int64), computed once: every padded / device / dtype variant of the
        tables, and views sharing these keys (GQA packing), derive from it."""
        if "coordinates" not in self._cache:
            self._cache["coordinates"] = key_coordinates(self.k, self.block_size)
        return self._cache["coordinates"]

    def ranges(self) -> torch.Tensor:
        """query_ranges of `q` under this rule (CPU, int64, [4, Nq]), computed once."""
        if "ranges" not in self._cache:
            self._cache["ranges"] = query_ranges(self.q, self.block_size, bidirectional=self.bidirectional,
                                                 window=self.window, noisy_causal=self.noisy_causal)  # fmt: skip
        return self._cache["ranges"]

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[Nq, Nk] boolean mask."""
        key = ("dense", str(device))
        if key not in self._cache:
            x, r = self.tables(device)
            self._cache[key] = visible(x[None, :], *(t[:, None] for t in r))
        return self._cache[key]

    def mask_mod(
        self, device: torch.device | str, *, q_len: int | None = None, k_len: int | None = None
    ) -> Callable[..., torch.Tensor]:
        """FlexAttention mask_mod(b, h, q_idx, kv_idx) evaluating the same rule: one int32 lookup per key,
        four per query row, four compares per element (indices up to q_len / k_len: PAD beyond the sets)."""
        x, (lo, hi, noisy_lo, noisy_hi) = self.tables(device, torch.int32, q_len=q_len, k_len=k_len)

        def mask_mod(b, h, q_idx, kv_idx):
            return visible(x[kv_idx], lo[q_idx], hi[q_idx], noisy_lo[q_idx], noisy_hi[q_idx])

        return mask_mod

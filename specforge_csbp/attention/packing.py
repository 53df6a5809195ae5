"""GQA head packing: the G query heads of one kv head become rows of one head, so a 128-row query tile of
the kernel holds c rows x G heads of the same tokens instead of 128 different rows of one head.

With H = Kh * G query heads and R query rows, rows are taken in chunks of c = tile // G (G * c = 128):

    q [B, H, R, D]                                   q_packed [B, Kh, G * R', D]   (R' = R padded to c)
    head kh*G+g, row j*c+i   ─────────────────►     head kh, row j*G*c + g*c + i

    packed rows of kv head kh:  | chunk 0: g0 rows 0..c-1 | g1 rows 0..c-1 | ... | chunk 1: g0 rows c..2c-1 | ...
                                 └──────────── one 128-row q tile ──────────────┘

Why it pays: DFlash draft blocks (S = 16 rows with one context window each) sit 8 to a 128-row tile, and the
tile visits the union of 8 windows; packed (G = 4, c = 32) a tile holds 2 blocks x 4 heads, the union of 2.
The kernel then runs Kh heads without GQA, and each visits its own tiles.

Exact by construction: every packed row is an original (head, row) with the same key set, so the packed
visibility is `vis` with `q = vis.q.padded(R').select(index)` (index: packed row -> original row) and the
same keys and rule; the backend computes the same rows, unpack puts them back. Choices:
- c = tile // G, so a chunk fills a tile exactly and tiles never straddle chunks. Query rows come in whole
  blocks of S (drafter and BDLM plans): if c is a multiple of S a chunk holds whole blocks, else S is a
  multiple of c (both powers of two) and a tile holds one block's c rows for all G heads - never a mix.
  A G that does not divide the tile gets c = tile (one chunk per head and tile: exact, but no fewer tiles,
  so the automatic rule never picks it).
- R not a multiple of c: q is padded with zero rows whose tokens are PAD (see nothing: lse -inf, out 0,
  no gradient) and they are stripped on unpack. At most c - 1 rows per head, less than one 128-row tile per
  kv head; unpacked, the kernel pads R to 128 rows per head anyway.

The decision and the packed visibility are cached on the Visibility object (built once per plan, reused by
every layer), and so are the block masks, from one pass of the rule over chunks of c rows: the packed
tile status is the chunk status, the unpacked one the OR / AND over the 128 // c chunks of a tile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..masks.visibility import Visibility
from .flex import block_mask_from_status, tile_status, tile_visits

__all__ = ["TILE", "PackedVisibility", "TileCounts", "chunk_rows", "pack_q", "packed_visibility", "should_pack",
           "tile_counts", "unpack"]  # fmt: skip

TILE = 128  # FlexAttention's query/key tile (block mask BLOCK_SIZE)


def chunk_rows(groups: int, tile: int = TILE) -> int:
    """Rows c per chunk: G * c = tile when G divides the tile, else c = tile (see module docstring)."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1; got {groups}")
    return tile // groups if tile % groups == 0 else tile


@dataclass(frozen=True)
class PackedVisibility:
    """`vis` seen from packed rows: `vis.q` rows reordered (and padded) by `index`, same keys and rule."""

    vis: Visibility
    groups: int  # G query heads per kv head
    chunk: int  # c rows per chunk
    rows: int  # R original query rows
    index: torch.Tensor  # [G * R'] packed row -> original row (rows >= R are PAD)


def packed_visibility(vis: Visibility, groups: int, *, tile: int = TILE) -> PackedVisibility:
    """The packed view of `vis` for G = `groups`, cached on `vis` (one object per plan and G)."""
    key = ("gqa_packed", groups, tile)
    if key not in vis._cache:
        c, rows = chunk_rows(groups, tile), len(vis.q)
        n = -(-rows // c)
        index = torch.arange(n * c).view(n, 1, c).expand(n, groups, c).reshape(-1)
        q = vis.q.padded(n * c).select(index)
        # replace keeps every rule field of Visibility; a fresh cache, or it would share vis's masks - seeded
        # with what the packing does not change: the keys' coordinates, and the query ranges row by row
        # (a PAD query row has the empty ranges (0, 0, 0, 0))
        ranges = torch.nn.functional.pad(vis.ranges(), (0, n * c - rows)).index_select(1, index)
        seed = {"coordinates": vis.coordinates(), "ranges": ranges}
        vis._cache[key] = PackedVisibility(dataclasses.replace(vis, q=q, _cache=seed), groups, c, rows, index)
    return vis._cache[key]


def pack_q(q: torch.Tensor, kv_heads: int, chunk: int) -> torch.Tensor:
    """q [B, H, R, D] -> [B, Kh, G * R', D]: head kh*G+g, row j*c+i -> head kh, row (j*G + g)*c + i."""
    b, h, r, d = q.shape
    g, n = h // kv_heads, -(-r // chunk)
    if n * chunk != r:
        q = torch.nn.functional.pad(q, (0, 0, 0, n * chunk - r))
    return q.view(b, kv_heads, g, n, chunk, d).transpose(2, 3).reshape(b, kv_heads, n * g * chunk, d)


def unpack(t: torch.Tensor, groups: int, chunk: int, rows: int) -> torch.Tensor:
    """Inverse of `pack_q` for out [B, Kh, G * R', D] or lse [B, Kh, G * R'] -> [B, H, R(, D)]."""
    lse = t.dim() == 3
    if lse:
        t = t[..., None]
    b, kh, m, d = t.shape
    n = m // (groups * chunk)
    t = t.view(b, kh, n, groups, chunk, d).transpose(2, 3).reshape(b, kh * groups, n * chunk, d)[:, :, :rows]
    return (t[..., 0] if lse else t).contiguous()


@dataclass(frozen=True)
class TileCounts:
    """128x128 tiles the kernel visits per head, without and with packing (multiply by the heads it runs:
    H unpacked, Kh packed)."""

    unpacked: int
    packed: int


def tile_counts(vis: Visibility, groups: int, device: torch.device | str, *, tile: int = TILE) -> TileCounts:
    """Tile visits of `vis` and of its packed view, from one pass of the rule over chunks of c rows; the
    block masks of both are left in the caches (the flex backend then reuses them)."""
    device = torch.device(device)
    key = ("gqa_tiles", groups, str(device), tile)
    if key in vis._cache:
        return vis._cache[key]
    packed = packed_visibility(vis, groups, tile=tile)
    c = packed.chunk
    # status of chunks of c original rows (c divides the tile); all-PAD chunks up to whole unpacked tiles
    any_c, all_c = tile_status(vis, device, q_tile=c, kv_tile=tile)
    per = tile // c
    extra = -any_c.shape[0] % per
    pad = any_c.new_zeros(extra, any_c.shape[1])
    unpacked_any = torch.cat([any_c, pad]).view(-1, per, any_c.shape[1]).any(1)
    unpacked_all = torch.cat([all_c, pad]).view(-1, per, any_c.shape[1]).all(1)
    mask_key = ("block_mask", str(device), tile)
    if mask_key not in vis._cache:
        vis._cache[mask_key] = block_mask_from_status(vis, unpacked_any, unpacked_all, device, tile=tile)
    if mask_key not in packed.vis._cache:
        # packed tile j is chunk j when G * c = tile; with c = tile (G does not divide it) chunk j's G heads
        # are G consecutive packed tiles
        p_any, p_all = any_c, all_c
        if groups * c != tile:
            p_any, p_all = p_any.repeat_interleave(groups, 0), p_all.repeat_interleave(groups, 0)
        packed.vis._cache[mask_key] = block_mask_from_status(packed.vis, p_any, p_all, device, tile=tile)
    counts = TileCounts(tile_visits(vis._cache[mask_key]), tile_visits(packed.vis._cache[mask_key]))
    vis._cache[key] = counts
    return counts


def should_pack(vis: Visibility, groups: int, device: torch.device | str, *, tile: int = TILE) -> bool:
    """Automatic rule: pack iff G > 1 and the kernel visits fewer tiles x heads packed (Kh heads) than
    unpacked (H = G * Kh heads). Deterministic (integer tile counts), decided once per Visibility."""
    if groups <= 1 or len(vis.q) == 0:
        return False
    key = ("gqa_pack_auto", groups, str(torch.device(device)), tile)
    if key not in vis._cache:
        counts = tile_counts(vis, groups, device, tile=tile)
        vis._cache[key] = counts.packed < groups * counts.unpacked
    return vis._cache[key]

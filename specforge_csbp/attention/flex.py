"""FlexAttention backend (GPU): compiled flex_attention with a block mask built from the same rule.

Block masks are cached on the Visibility object, so a plan built once per step serves every layer.
"""

from __future__ import annotations

import functools

import torch

from ..masks.visibility import Visibility

__all__ = [
    "block_mask_for",
    "block_mask_from_status",
    "flex_attention_partial",
    "flex_available",
    "kernel_options",
    "tile_status",
    "tile_visits",
]


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - torch < 2.5
        return False
    return True


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Every plan has its own row counts; automatic dynamic shapes (dynamic=None) compile one kernel per
    # call site after the first size change instead of one per size, and the raised limit keeps dynamo
    # from silently falling back to eager (math) flex attention after 8 recompiles.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 2048)
    return torch.compile(flex_attention, dynamic=None)


def tile_status(
    vis: Visibility, device: torch.device, *, q_tile: int = 128, kv_tile: int = 128, budget: int = 1 << 27
) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) bool [n_q_tiles, n_kv_tiles]: does some / every (query, key) pair of a tile see each other.

    Counted, not evaluated pair by pair: a query sees the keys whose coordinate lies in its two ranges
    (masks/visibility.py), so with each kv tile's coordinates sorted, binary search gives how many of the
    tile's keys a query sees - "any" is a count > 0, "all" a count equal to the tile width. That is
    O(Nq x kv tiles x log kv_tile) work instead of O(Nq x Nk), and at most `budget` counts exist at a time.

        kv tile t, sorted x:  [ 3  4  5  6 ... ]      query [lo, hi) = [4, 9):  count = #x in [4, 9)
                                                      (+ its noisy range, disjoint from the clean one)

    The token sets are padded with PAD rows to whole tiles; PAD rows/columns see nothing, so a tile holding
    padding is never "all" (the kernel then applies mask_mod there, like create_block_mask's edge tiles).
    `q_tile` may be smaller than the kernel's tile: GQA packing (packing.py) reads the tile status of its
    packed rows from chunks of original rows, and the unpacked status is the OR/AND over chunks.
    """
    nq, nk = len(vis.q), len(vis.k)
    n_qt, n_kt = -(-nq // q_tile), -(-nk // kv_tile)
    x, ranges = vis.tables(device, q_len=n_qt * q_tile, k_len=n_kt * kv_tile)
    keys = x.view(n_kt, kv_tile).sort(dim=1).values
    any_visible = torch.empty(n_qt, n_kt, dtype=torch.bool, device=device)
    all_visible = torch.empty(n_qt, n_kt, dtype=torch.bool, device=device)
    tiles_per_chunk = max(1, budget // (q_tile * n_kt))

    def inside(lo, hi):  # [n_kt, rows]: keys of each kv tile with lo <= x < hi (0 for empty ranges)
        first, end = (torch.searchsorted(keys, t.expand(n_kt, t.numel()).contiguous()) for t in (lo, hi))
        return (end - first).clamp_min(0)

    for first in range(0, n_qt, tiles_per_chunk):
        last = min(first + tiles_per_chunk, n_qt)
        lo, hi, noisy_lo, noisy_hi = (t[first * q_tile : last * q_tile] for t in ranges)
        seen = inside(lo, hi) + inside(noisy_lo, noisy_hi)  # the two ranges are disjoint
        seen = seen.view(n_kt, last - first, q_tile)
        any_visible[first:last] = (seen > 0).any(dim=2).t()
        all_visible[first:last] = (seen == kv_tile).all(dim=2).t()
    return any_visible, all_visible


def block_mask_from_status(vis: Visibility, any_visible, all_visible, device: torch.device, *, tile: int = 128):
    """BlockMask of `vis` from its (any, all) tile status: empty, partial (mask_mod applied inside the
    kernel) or full (no mask_mod) - exactly the classification create_block_mask makes."""
    from torch.nn.attention.flex_attention import BlockMask

    n_qt, n_kt = any_visible.shape
    full = all_visible & any_visible
    partial = any_visible & ~full

    def blocks(selected):
        counts = selected.sum(-1, dtype=torch.int32)
        order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    # lengths of whole tiles: the kernel runs on inputs padded to them (`flex_attention_partial`), so it can
    # drop its bounds checks; the padding rows are PAD in the mask tables, visible to and seeing nothing
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=vis.mask_mod(device, q_len=n_qt * tile, k_len=n_kt * tile),
        seq_lengths=(n_qt * tile, n_kt * tile),
    )  # fmt: skip


def block_mask_for(vis: Visibility, device: torch.device, *, tile: int = 128, budget: int = 1 << 27):
    """BlockMask of `vis` built chunk by chunk from the same rule, never materialising [Nq, Nk].

    `create_block_mask` evaluates the mask over the whole [Nq, Nk] grid at once (69 GB at 2 x 128K tokens);
    here at most `budget` elements of it exist at a time (`tile_status`). Cached on `vis`.
    """
    key = ("block_mask", str(device), tile)
    if key not in vis._cache:
        status = tile_status(vis, device, q_tile=tile, kv_tile=tile, budget=budget)
        vis._cache[key] = block_mask_from_status(vis, *status, device, tile=tile)
    return vis._cache[key]


def tile_visits(block_mask) -> int:
    """128x128 tiles one head of the kernel visits (partial + full), summed over the mask's heads."""
    return int(block_mask.kv_num_blocks.sum()) + int(block_mask.full_kv_num_blocks.sum())


#: row multiple at which FlexAttention's kernels can drop their bounds checks (every kernel block size divides it)
DIVISIBLE_ROWS = 128


def kernel_options(q_len: int, kv_len: int, device: torch.device | None = None) -> dict[str, bool] | None:
    """FlexAttention kernel options for one call: IS_DIVISIBLE when both lengths are multiples of 128, and
    on CUDA the forward kernel's TMA loads (fwd_USE_TMA).

    Why IS_DIVISIBLE: the kernels skip bounds checks and the masking of a last partial tile only when
    inductor can prove both lengths are multiples of 128, i.e. for static shapes. Our call site is compiled
    with automatic dynamic shapes (every plan has its own row counts: a drafter step's sliding layers keep a
    different number of rows each step), so after the first change of length every kernel would run with
    the checks - most of the gap between static and dynamic kernels (benchmarks/flex_layer_bench.py,
    docs/performance.md). The lengths are known at the call (and padded to whole tiles there), so the call
    states it; dynamo guards on the option, so a call without it gets its own kernel.

    Why fwd_USE_TMA: the forward's K/V tiles load through the tensor memory accelerator, 7% faster on an
    H200 (the BDLM's 2L call at 64K, 80.9 -> 75.0 ms); the backward's TMA loads measured slower, so they stay
    off. Inductor drops the option where the GPU or the tensors' layout cannot use TMA (`can_use_tma`)."""
    options: dict[str, bool] = {}
    if q_len % DIVISIBLE_ROWS == 0 and kv_len % DIVISIBLE_ROWS == 0:
        options["IS_DIVISIBLE"] = True
    if device is not None and device.type == "cuda":
        options["fwd_USE_TMA"] = True
    return options or None


def flex_attention_partial(q, k, v, vis: Visibility, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention over `vis`, on inputs padded to whole 128-row tiles (PAD rows: they see and are seen by
    nothing, and their outputs are cut off), so the kernel can drop its bounds checks (`kernel_options`).
    Lengths that are multiples of 128 already - every benchmark plan - are passed through without a copy."""
    block_mask = block_mask_for(vis, q.device)
    nq, nk = q.shape[2], k.shape[2]
    q_len, kv_len = block_mask.seq_lengths
    if q_len != nq:
        q = torch.nn.functional.pad(q, (0, 0, 0, q_len - nq))
    if kv_len != nk:
        k, v = (torch.nn.functional.pad(t, (0, 0, 0, kv_len - nk)) for t in (k, v))
    out, lse = _compiled_flex()(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], return_lse=True,
        kernel_options=kernel_options(q_len, kv_len, q.device),
    )  # fmt: skip
    return (out[:, :, :nq], lse[:, :, :nq]) if q_len != nq else (out, lse)

"""FlexAttention backend (GPU): compiled flex_attention with a block mask built from the same rule.

Block masks are cached on the Visibility object, so a plan built once per step serves every layer.
"""

from __future__ import annotations

import functools

import torch

from ..layout.tokens import TokenSet
from ..masks.visibility import Visibility, visible

__all__ = ["flex_attention_partial", "flex_available"]


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


def _padded(tokens: TokenSet, length: int, device) -> TokenSet:
    return tokens.padded(length).to(device)


def block_mask_for(vis: Visibility, device: torch.device, *, tile: int = 128, budget: int = 1 << 27):
    """BlockMask of `vis` built chunk by chunk from the same rule, never materialising [Nq, Nk].

    `create_block_mask` evaluates the mask over the whole [Nq, Nk] grid at once (69 GB at 2 x 128K tokens);
    here at most `budget` elements of it exist at a time. Each (q tile, kv tile) is classified empty,
    partial (mask_mod applied inside the kernel) or full (no mask_mod), exactly as create_block_mask does.
    The token sets are padded with PAD rows to whole tiles so the kernel's lookups stay in bounds.
    """
    key = ("block_mask", str(device), tile)
    if key in vis._cache:
        return vis._cache[key]
    from torch.nn.attention.flex_attention import BlockMask

    nq, nk = len(vis.q), len(vis.k)
    n_qt, n_kt = -(-nq // tile), -(-nk // tile)
    q, k = _padded(vis.q, n_qt * tile, device), _padded(vis.k, n_kt * tile, device)
    padded_vis = Visibility(q, k, vis.block_size, vis.clean_within_block, vis.window, vis.noisy_causal)
    status = torch.empty(n_qt, n_kt, dtype=torch.int8, device=device)  # 0 empty, 1 partial, 2 full
    rows_per_chunk = max(1, budget // (tile * n_kt * tile))
    for lo in range(0, n_qt, rows_per_chunk):
        hi = min(lo + rows_per_chunk, n_qt)
        rows = slice(lo * tile, hi * tile)
        dense = visible(
            q.pos[rows, None], q.kind[rows, None], q.block[rows, None], q.start[rows, None],
            k.pos[None, :], k.kind[None, :], k.block[None, :], vis.block_size, vis.bidirectional,
            vis.window, vis.noisy_causal,
        ).view(hi - lo, tile, n_kt, tile)  # fmt: skip
        # Padding rows/columns are PAD and see nothing, so a tile holding padding is never "full": it stays
        # partial and the kernel applies mask_mod there (conservative, like create_block_mask's edge tiles).
        any_visible = dense.any(dim=3).any(dim=1)
        all_visible = dense.all(dim=3).all(dim=1)
        status[lo:hi] = torch.where(all_visible, 2, torch.where(any_visible, 1, 0)).to(torch.int8)
        del dense
    partial, full = status == 1, status == 2

    def blocks(selected):
        counts = selected.sum(-1, dtype=torch.int32)
        order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    block_mask = BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=padded_vis.mask_mod(device),
        seq_lengths=(nq, nk),
    )  # fmt: skip
    vis._cache[key] = block_mask
    return block_mask


def flex_attention_partial(q, k, v, vis: Visibility, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    block_mask = block_mask_for(vis, q.device)
    out, lse = _compiled_flex()(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], return_lse=True
    )
    return out, lse

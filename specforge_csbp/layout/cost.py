"""Exact counts of visible (query, key) pairs: the useful work of BDLM attention.

For L = B*S clean tokens:
    clean queries, causal rule:        L (L + 1) / 2
    clean queries, bidirectional rule: S^2 B (B + 1) / 2
    corrupted queries:                 S^2 B (own blocks)  +  S^2 B (B - 1) / 2 (clean prefixes)
Attention FLOPs: 4 D per pair per head forward (QK^T and PV), 2.5x that backward (5 matmuls vs 2).
"""

from __future__ import annotations

import torch

__all__ = ["attention_flops", "bdlm_visible_pairs"]


def bdlm_visible_pairs(
    seq_len: int, block_size: int, clean_within_block: str = "causal", window: int | None = None
) -> int:
    """Visible pairs of one 2L sequence; `window`: a sliding window of that many clean keys measured from
    each query's position (None, or >= seq_len: full attention)."""
    if window is None or window >= seq_len:
        b, s = seq_len // block_size, block_size
        clean = seq_len * (seq_len + 1) // 2 if clean_within_block == "causal" else s * s * b * (b + 1) // 2
        noisy = s * s * b + s * s * b * (b - 1) // 2
        return clean + noisy
    pos = torch.arange(seq_len, dtype=torch.float64)
    start = torch.div(pos, block_size, rounding_mode="floor") * block_size
    lo = (pos - window + 1).clamp_min(0)
    clean_hi = pos + 1 if clean_within_block == "causal" else start + block_size
    return int((clean_hi - lo).sum() + (block_size + (start - lo).clamp_min(0)).sum())


def attention_flops(pairs: int, heads: int, head_dim: int, *, backward: bool = True) -> float:
    forward = 4.0 * head_dim * heads * pairs
    return forward * (3.5 if backward else 1.0)

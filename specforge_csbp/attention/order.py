"""Query order: run the kernel over a call's query rows last row first (an A/B switch, off by default).

Why: FlexAttention schedules query tiles in row order. In a drafter's full-attention layer the last draft
blocks see the most context, so in row order the heaviest tiles start last and the kernel ends on a tail of
a few long tiles. Reversed, the heaviest start first (longest-job-first):

    row order      tiles:  q0 ▏  q1 ▎  q2 ▍  q3 ▌  q4 ▋  q5 █      work per tile grows with the row
    reversed       tiles:  q5 █  q4 ▋  q3 ▌  q2 ▍  q1 ▎  q0 ▏      the long ones no longer form the tail

Measured on one H200 (benchmarks/flex_layer_bench.py, shape a, full-attention layer, fwd + bwd): at 1M,
CP 327.4 -> 312.2 ms and CSBP 338.0 -> 329.2 ms; at 512K, CSBP 170.5 -> 164.7 ms. In a whole step it
gained nothing measurable (2 H200, side by side with CP, `--reverse-queries`: 1M / 512 anchors CP 1,451.4
vs 1,449.7 ms in row order, CSBP 1,356.9 vs 1,351.3; docs/performance.md), so it stays off; where
it is turned on it applies to every mode alike (the baselines get the same kernels).

Exact by construction: the reversed visibility is `vis` with `q` reversed (same keys, same rule), q rows
are flipped in and out/lse flipped back, so every row computes what it did; the only copies are of q,
out and lse (query rows: 8K per rank for a drafter at 1M against 512K+ key rows).
"""

from __future__ import annotations

import dataclasses

import torch

from ..masks.visibility import Visibility

__all__ = ["REVERSE_QUERIES", "flip_rows", "reversed_queries"]

#: the switch (module level, like flex.ASSERT_DIVISIBLE): every seam call reverses its query rows when True
REVERSE_QUERIES = False


def reversed_queries(vis: Visibility) -> Visibility:
    """`vis` with its query rows in reverse order, cached on `vis` (one object per plan, like the packed
    view). Seeded with what reversal keeps: the keys' coordinates and the query ranges, row by row."""
    key = "reversed_queries"
    if key not in vis._cache:
        order = torch.arange(len(vis.q) - 1, -1, -1)
        seed = {"coordinates": vis.coordinates(), "ranges": vis.ranges().index_select(1, order)}
        vis._cache[key] = dataclasses.replace(vis, q=vis.q.select(order), _cache=seed)
    return vis._cache[key]


def flip_rows(t: torch.Tensor) -> torch.Tensor:
    """Reverse the row (token) dimension of q / out [B, H, N, D] or lse [B, H, N]: dimension 2."""
    return t.flip(2)

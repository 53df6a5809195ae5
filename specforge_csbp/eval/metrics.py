"""Acceptance statistics over verify steps: tau, histogram, per-slot acceptance, context-position buckets.

    tau                  mean tokens committed per verify step, bonus included: 1 + mean accepted drafts
                         (1 <= tau <= S; an oracle drafter reaches S)
    accept_hist[k]       verify steps that accepted k drafted tokens (k = 0..S-1; they commit k + 1)
    per_slot_accept[j]   fraction of verify steps whose draft slot j + 1 was accepted (j = 0..S-2); slot
                         j + 1 counts only when every slot before it was accepted too
    buckets              tau of the steps whose block starts in [start, end) of context positions:
                         0-4K, 4K-16K, 16K-64K, 64K-256K, 256K+ (or `edges`) - those the prompts reach
    position_bins        the same over up to 24 equal-width bins of position (the plot's line)
    spec_accept_length   SGLang's metric: generated tokens / verify steps (its numerator also counts the
                         prefill's token, so it exceeds tau by about 1 / verify_steps per prompt)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..values import parse_size
from .loop import SequenceResult

__all__ = ["BUCKET_EDGES", "parse_bucket_edges", "summarize"]

K = 1024
BUCKET_EDGES = (0, 4 * K, 16 * K, 64 * K, 256 * K)  # the last bucket is open: 256K+
POSITION_BINS = 24  # finer equal-width bins of the steps' positions, for the plot


def _tau(accepted: Sequence[int]) -> float | None:
    return 1.0 + sum(accepted) / len(accepted) if accepted else None


def parse_bucket_edges(text: str) -> tuple[int, ...]:
    """`--bucket-edges 0,4K,16K,64K` -> (0, 4096, 16384, 65536): increasing token positions from 0 (`K` = 1024;
    the last bucket is open). Finer edges than the default serve short prompts (the CPU long-context study)."""
    try:
        edges = tuple(parse_size(x, field="--bucket-edges", minimum=0) for x in text.replace(" ", "").split(","))
    except ValueError:
        edges = ()
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--bucket-edges: expected increasing positions starting at 0, like 0,4K,16K; got {text!r}")
    return edges


def summarize(
    results: Sequence[SequenceResult], block_size: int, edges: Sequence[int] = BUCKET_EDGES
) -> dict[str, Any]:
    """The JSON fields of `specforge-csbp eval` computed from the sequences' verify steps; `edges` start the
    context-position buckets (the last one is open)."""
    steps = [s for r in results for s in r.steps]
    accepted = [s.accepted for s in steps]
    n = len(steps)
    hist = [0] * block_size
    for a in accepted:
        hist[a] += 1
    per_slot = [sum(a > j for a in accepted) / n if n else None for j in range(block_size - 1)]
    reach = max((s.position for s in steps), default=-1)
    buckets = []
    for i, start in enumerate(edges):
        if start > reach:
            break
        end = edges[i + 1] if i + 1 < len(edges) else None
        inside = [s.accepted for s in steps if s.position >= start and (end is None or s.position < end)]
        buckets.append({"start": start, "end": end, "tau": _tau(inside), "verify_steps": len(inside)})
    generated = sum(len(r.tokens) for r in results)
    width = max(1, -(-(reach + 1) // POSITION_BINS))
    bins = []
    for lo in range(0, reach + 1, width):
        inside = [s.accepted for s in steps if lo <= s.position < lo + width]
        if inside:
            bins.append({"start": lo, "end": lo + width, "tau": _tau(inside), "verify_steps": len(inside)})
    return {
        "tau": _tau(accepted),
        "verify_steps": n,
        "generated_tokens": generated,
        "block_size": block_size,
        "accept_hist": hist,
        "per_slot_accept": per_slot,
        "buckets": buckets,
        "position_bins": bins,
        "spec_accept_length": generated / n if n else None,
        "accept_rate": sum(accepted) / (n * (block_size - 1)) if n else None,
        "num_prompts": len(results),
        "prompt_tokens": sum(r.prompt_len for r in results),
        "max_context": max((r.prompt_len + len(r.tokens) for r in results), default=0),
        "prefill_s": sum(r.prefill_s for r in results),
        "decode_s": sum(r.decode_s for r in results),
    }

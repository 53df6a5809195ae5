"""One drafter sample and the reading of its context features: the rows a rank holds, interval by interval.

    DrafterSample(input_ids [L], loss_mask [L], features)      features: [L, K*H] tensor, or (lo, hi) -> rows
                                                               (or a store's SampleRows: also .pieces(lo, hi, pin)
                                                               and .dtype, read piece by piece)
    load_context(sample, intervals, ...) -> [1, rows, K*H] per interval   (never concatenated)

A leaf module: the step (step.py) and the prefetch worker (prefetch.py) both read features through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["PIN_CHUNK_BYTES", "DrafterSample", "FeatureSource", "copy_rows_chunked", "load_context"]

FeatureSource = torch.Tensor | Callable[[int, int], torch.Tensor]


@dataclass
class DrafterSample:
    """One sequence: token ids and loss mask (whole, small) and its target features [L, K*H] - a tensor or
    a loader `(lo, hi) -> rows lo..hi-1`, so a rank reads only its own context intervals."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    features: FeatureSource

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.numel())


#: host rows staged through pinned memory per copy (`load_context(pin=True)`): the caching host allocator
#: recycles a chunk's block once its copy ran, so pinned memory stays a few chunks, not a step's features
PIN_CHUNK_BYTES = 64 << 20


def copy_rows_chunked(rows: torch.Tensor, out: torch.Tensor, chunk_bytes: int, *, pin: bool) -> torch.Tensor:
    """out[:] = rows, `chunk_bytes` of rows per copy, each chunk pinned first when `pin` (non_blocking)."""
    step = max(1, chunk_bytes // max(1, rows[0].numel() * rows.element_size())) if len(rows) else 1
    for a in range(0, len(rows), step):
        chunk = rows[a : a + step]
        out[a : a + step].copy_(chunk.pin_memory() if pin else chunk, non_blocking=pin)
    return out


def load_context(
    sample: DrafterSample, intervals, device, dtype, width: int, *, pin: bool = False
) -> list[torch.Tensor]:
    """This rank's context feature rows, one [1, rows, width] piece per interval (never concatenated: the
    features are the widest tensor of the step); one empty piece when the rank holds none. `pin`: host rows
    go to a GPU through pinned memory (the prefetch worker's use), so the copy does not wait for the stream.

    Where the rows are copied anyway (to another device or dtype) and the source reads piece by piece (a
    store's `SampleRows.pieces`), each piece is copied as it arrives, while the next ones are still being
    read; otherwise the rows are read whole, and pinned in chunks of `PIN_CHUNK_BYTES` (pinned memory stays
    a few chunks, not a step's features)."""
    parts = []
    target = torch.device(device)
    pinned = pin and target.type == "cuda"
    pieces = getattr(sample.features, "pieces", None)
    for lo, hi in intervals:
        if pieces is not None and (target.type != "cpu" or dtype != sample.features.dtype):
            out = torch.empty((hi - lo, width), device=device, dtype=dtype)
            for at, rows in pieces(lo, hi, pin=pinned):
                out[at : at + len(rows)].copy_(rows, non_blocking=pinned)
            parts.append(out[None])
            continue
        rows = (
            sample.features[lo:hi] if isinstance(sample.features, torch.Tensor) else sample.features(lo, hi)
        )
        if pinned and rows.device.type == "cpu":
            out = torch.empty(rows.shape, device=device, dtype=dtype)
            parts.append(copy_rows_chunked(rows, out, PIN_CHUNK_BYTES, pin=True)[None])
            continue
        parts.append(rows.to(device=device, dtype=dtype, non_blocking=True)[None])
    return parts or [torch.empty((1, 0, width), device=device, dtype=dtype)]

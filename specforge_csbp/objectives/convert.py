"""AR -> BDLM conversion (Fast-dLLM v2): complementary masks, labels shifted by one, unit weights.

One Bernoulli draw m (per-block level t, noise.py) makes two views of every sequence; each eligible token is
masked in exactly one of them, and the batch is doubled. Like the AR model being converted, row p predicts
token p + 1 (the corrupted row before a masked token carries its label):

    position      0   1   2   3 | 4   5   6   7
    x0            a   b   c   d | e   f   g   h
    view A (m)    a   M   c   M | e   f   M   h     labels A: row 0 -> b, row 2 -> d, row 5 -> g
    view B (~m)   M   b   M   d | M   M   g   M     labels B: row 1 -> c, row 3 -> e, row 4 -> f, row 6 -> h

Position 0 has no preceding row, so it is never supervised; the global denominator is the number of
eligible tokens at positions >= 1 (each supervised exactly once across the two views).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .noise import IGNORE_INDEX, BDLMBatch, MaskedObjective

__all__ = ["ConvertObjective"]


@dataclass(frozen=True)
class ConvertObjective(MaskedObjective):
    noise: str = "uniform"

    @property
    def batch_factor(self) -> int:
        return 2

    def build(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor | None, seeds: Sequence[int]
    ) -> BDLMBatch:
        """Clean tokens [N, L] -> the 2L batch of 2N sequences (views A, B of sequence i at rows 2i, 2i+1)."""
        x0, eligible, _, drawn = self.draw(input_ids, loss_mask, seeds)
        views = torch.stack([drawn & eligible, ~drawn & eligible], 1).flatten(0, 1)  # [2N, L]
        clean = x0.repeat_interleave(2, 0)
        noisy = clean.masked_fill(views, self.mask_token_id)
        labels = torch.full_like(clean, IGNORE_INDEX)
        labels[:, :-1] = clean[:, 1:].masked_fill(~views[:, 1:], IGNORE_INDEX)
        supervised = (labels != IGNORE_INDEX).to(torch.float64)
        # counts: one per supervised row; over both views that is every eligible token at position >= 1
        return BDLMBatch.two_stream(clean, noisy, labels, supervised, supervised)

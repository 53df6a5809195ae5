"""Masked-diffusion SFT of a block-diffusion LM (bd3lms / LLaDA style), on the 2L layout.

Per block a noise level t (noise.py), each eligible token masked with probability t; the corrupted row of a
masked token predicts that token (no shift), with weight 1/t ("inv_t", the ELBO weight) or 1 ("unit"):

    position        0   1   2   3 | 4   5   6   7
    loss_mask       0   0   1   1 | 1   1   1   1      prompt tokens are never masked nor supervised
    x0 (clean)      p   q   a   b | c   d   e   f
    xt (corrupted)  p   q   M   b | c   M   M   f      t_0 = 0.6, t_1 = 0.4
    labels (xt)     -   -   a   - | -   d   e   -      weight 1/t_block

Denominator (global, all-reduced by the trainer): the number of eligible tokens ("eligible", unbiased for
the 1/t-weighted ELBO) or of masked tokens ("masked", a per-token mean). Each corrupted row carries its
token's count, so any partition of rows sums to the same denominator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .noise import IGNORE_INDEX, BDLMBatch, MaskedObjective

__all__ = ["DENOMINATORS", "WEIGHTINGS", "SFTObjective"]

WEIGHTINGS = ("inv_t", "unit")
DENOMINATORS = ("eligible", "masked")


@dataclass(frozen=True)
class SFTObjective(MaskedObjective):
    weighting: str = "inv_t"
    denominator: str = "eligible"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"objective.weighting must be one of {', '.join(WEIGHTINGS)}; got {self.weighting!r}"
            )
        if self.denominator not in DENOMINATORS:
            raise ValueError(
                f"objective.denominator must be one of {', '.join(DENOMINATORS)}; got {self.denominator!r}"
            )

    @property
    def batch_factor(self) -> int:
        """Sequences in the 2L batch per clean sequence."""
        return 1

    def build(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor | None, seeds: Sequence[int]
    ) -> BDLMBatch:
        """Clean tokens [N, L] (+ eligibility [N, L]) and one seed per sequence -> the full 2L batch (CPU)."""
        x0, eligible, levels, drawn = self.draw(input_ids, loss_mask, seeds)
        masked = drawn & eligible
        xt = x0.masked_fill(masked, self.mask_token_id)
        labels = x0.masked_fill(~masked, IGNORE_INDEX)
        weights = (1.0 / levels if self.weighting == "inv_t" else torch.ones_like(levels)) * masked
        counts = (eligible if self.denominator == "eligible" else masked).to(torch.float64)
        return BDLMBatch.two_stream(x0, xt, labels, weights, counts)

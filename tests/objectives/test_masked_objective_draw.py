"""SFT and AR -> BDLM conversion build their 2L batches from one shared draw (objectives/noise.py)."""

from __future__ import annotations

import pytest
import torch

from specforge_csbp.objectives.convert import ConvertObjective
from specforge_csbp.objectives.noise import IGNORE_INDEX, MaskedObjective, draw_token_masks
from specforge_csbp.objectives.sft import SFTObjective

S, VOCAB, MASK = 4, 64, 63


def _batch(n: int = 3, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randint(0, MASK, (n, length), generator=gen)
    loss_mask = torch.rand(n, length, generator=gen) < 0.7
    return x0, loss_mask


def test_draw_is_the_seeded_noise_of_the_validated_batch():
    x0, loss_mask = _batch()
    seeds = [11, 12, 13]
    draw = MaskedObjective(S, MASK, VOCAB, noise="antithetic").draw(x0.int(), loss_mask.int(), seeds)
    levels, drawn = draw_token_masks(seeds, x0.shape[1], S, eps=1e-3, schedule="antithetic")
    assert draw.x0.dtype == torch.int64 and torch.equal(draw.x0, x0)
    assert draw.eligible.dtype == torch.bool and torch.equal(draw.eligible, loss_mask)
    assert torch.equal(draw.levels, levels) and torch.equal(draw.drawn, drawn)


@pytest.mark.parametrize("noise", ["stratified", "antithetic", "uniform"])
def test_sft_masks_what_conversion_view_a_masks(noise):
    """One draw, two objectives: SFT's masked tokens are exactly the tokens conversion's view A masks."""
    x0, loss_mask = _batch()
    seeds = [5, 6, 7]
    sft = SFTObjective(S, MASK, VOCAB, noise=noise).build(x0, loss_mask, seeds)
    conv = ConvertObjective(S, MASK, VOCAB, noise=noise).build(x0, loss_mask, seeds)
    length = x0.shape[1]
    sft_masked = sft.labels[:, length:] != IGNORE_INDEX
    view_a, view_b = conv.input_ids[0::2, length:] == MASK, conv.input_ids[1::2, length:] == MASK
    assert sft_masked.any() and torch.equal(sft_masked, view_a)
    assert torch.equal(view_a | view_b, loss_mask) and not (view_a & view_b).any()


def test_each_objective_keeps_its_default_noise_and_the_shared_checks():
    assert SFTObjective(S, MASK, VOCAB).noise == "stratified"
    assert ConvertObjective(S, MASK, VOCAB).noise == "uniform"
    for cls in (SFTObjective, ConvertObjective):
        with pytest.raises(ValueError, match=r"objective.eps must be in \(0, 1\); got 1.5"):
            cls(S, MASK, VOCAB, eps=1.5)
        with pytest.raises(ValueError, match=r"seeds: need one per sequence \(3\); got 2"):
            cls(S, MASK, VOCAB).build(*_batch(), [1, 2])

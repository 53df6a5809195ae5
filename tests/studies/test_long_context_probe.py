"""The plateau probe (studies/long_context/probe.py): layer 0's context attention and per-layer grad norms."""

from __future__ import annotations

import math

import pytest
import torch

from specforge_csbp.models.dflash.features import DrafterSample
from specforge_csbp.objectives.dflash import DFlashObjective
from specforge_csbp.studies.long_context.probe import context_attention, layer_grad_norms
from tests.support.eval_fixtures import random_drafter

L = 96


def _sample(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 512, (L,), generator=g)
    width = model.fc.in_features
    return DrafterSample(ids, torch.ones(L, dtype=torch.long), torch.randn(L, width, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("first", ["full_attention", "sliding_attention"])
def test_zero_queries_attend_uniformly_over_exactly_the_keys_a_block_sees(first):
    model = random_drafter(False, layer_types=[first, "full_attention"], sliding_window=6)
    with torch.no_grad():
        model.layers[0].self_attn.q_proj.weight.zero_()  # q = 0: every seen key gets the same weight
    sample, anchors = _sample(model), torch.tensor([1, 5, 20, 47, 80])
    embed = torch.randn(512, model.config.hidden_size, dtype=torch.float64)
    out = context_attention(model, sample, anchors, embed, near=4)
    seen = anchors.double() if first == "full_attention" else anchors.clamp(max=5).double()  # a block at a sees
    assert out["keys_seen"] == pytest.approx(float(seen.mean()))  # [0, a), or its last W - 1 = 5 positions
    assert out["entropy_ratio"] == pytest.approx(1.0, abs=1e-12)
    assert out["near_mass"] == pytest.approx(out["near_mass_uniform"], abs=1e-12)
    assert out["near_mass_uniform"] == pytest.approx(float((seen.clamp(max=4) / seen).mean()))
    assert model.fc.weight.dtype == torch.float64 and model.layers[0].self_attn.q_proj.weight.abs().sum() == 0
    random = context_attention(random_drafter(False, layer_types=[first, "full_attention"], sliding_window=6,
                                              seed=3), sample, anchors, embed, near=4)  # fmt: skip
    assert random["entropy_ratio"] < 1.0 - 1e-6  # trained-like weights concentrate some


def test_layer_grad_norms_name_every_part_and_leave_no_gradient():
    model = random_drafter(False, layer_types=["sliding_attention", "full_attention"], sliding_window=6).train()
    vocab, hidden = 512, model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.1
    embed = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    out = layer_grad_norms(model, [_sample(model, 0), _sample(model, 1)], objective=DFlashObjective(num_anchors=8),
                           head_weight=head, embed_weight=embed)  # fmt: skip
    assert set(out) == {"loss", "fc", "layers.0", "layers.1", "final_norm"}
    assert all(math.isfinite(v) and v > 0 for v in out.values())
    assert all(p.grad is None for p in model.parameters())

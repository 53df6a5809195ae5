"""The plugin's micro-step ties a zero term to the loss only for the drafter parameters its graph leaves out
(DDP needs a gradient for every one; a tied parameter's real gradient would get a gradient-sized zero added
in backward), and eval forwards tie nothing."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from specforge_csbp.plugin.training_model import CSBPDrafterTrainingModel, unreached_parameters


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model[0].bias.requires_grad_(False)  # frozen: never tied
    return model


def _sum(model: nn.Module, numerator: torch.Tensor) -> torch.Tensor:
    out = SimpleNamespace(numerator=numerator, denominator=4.0, stats={})
    total, denominator, _ = CSBPDrafterTrainingModel._sum(SimpleNamespace(draft_model=model), [out])
    assert float(denominator) == 4.0
    return total


def test_unreached_parameters_walks_the_graph():
    model, x = _model(), torch.randn(4, 3)
    params = [p for p in model.parameters() if p.requires_grad]
    assert unreached_parameters(model(x).sum(), params) == []
    assert unreached_parameters(model[0](x).sum(), params) == [model[1].weight, model[1].bias]
    assert unreached_parameters(torch.zeros(()), params) == params  # no graph at all


def test_a_step_that_uses_every_parameter_gets_no_tie():
    model, x = _model(), torch.randn(4, 3)
    numerator = model(x).sum()
    assert _sum(model, numerator) is numerator


def test_a_parameter_the_step_leaves_out_gets_a_zero_gradient_and_the_others_theirs():
    model, x = _model(), torch.randn(4, 3)
    want = torch.autograd.grad(model[0](x).pow(2).sum(), model[0].weight)[0]
    total = _sum(model, model[0](x).pow(2).sum())
    total.backward()
    assert torch.equal(model[0].weight.grad, want)
    for p in (model[1].weight, model[1].bias):
        assert p.grad is not None and not p.grad.any()
    assert model[0].bias.grad is None


def test_eval_ties_nothing():
    model, x = _model(), torch.randn(4, 3)
    with torch.no_grad():
        numerator = model[0](x).sum()
        assert _sum(model, numerator) is numerator

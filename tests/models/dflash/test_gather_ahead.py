"""Gather ahead (LayerAttention.gather_ahead): the model starts layer i + 1's context K/V gather before it
runs layer i, hands each layer its own handle, and computes what it computes without it."""

import pytest
import torch

from specforge_csbp.models.dflash import reference_attention
from specforge_csbp.models.dflash.modeling import LayerAttention
from tests.models.dflash.test_modes_equal_reference import Case, build


class LoggedAttend:
    """A layer type's attend with `begin`: logs begins and calls, and hands out one token per begin."""

    def __init__(self, inner, kind: str, log: list):
        self.inner, self.kind, self.log = inner, kind, log

    def begin(self, k_ctx, v_ctx):
        token = ("handle", len(self.log))
        self.log.append(("begin", self.kind, k_ctx.shape[2], token))
        return token

    def __call__(self, q, k, v, *, scale=None, gathered=None):
        self.log.append(("call", self.kind, gathered))
        return self.inner(q, k, v, scale=scale)


def _forward(model, samples, attention):
    sample = samples[0]
    L = len(sample.input_ids)
    S = model.block_size
    anchors = torch.tensor([3, 11, 20, 31])
    positions = (anchors[:, None] + torch.arange(S)).reshape(-1)
    g = torch.Generator().manual_seed(0)  # the same draft embeddings for every call
    emb = torch.randn(1, positions.numel(), model.config.hidden_size, dtype=torch.float64, generator=g)
    return model(emb, positions, sample.features[None], torch.arange(L), attention=attention), anchors


def test_gathers_start_one_layer_ahead_and_each_layer_gets_its_own():
    case = Case("csbp", True, (40,), 4, layer_types=("sliding_attention", "full_attention", "full_attention"))
    model, _, _, samples, _ = build(case)
    L = len(samples[0].input_ids)
    anchors = torch.tensor([3, 11, 20, 31])
    ref = reference_attention(model.config, anchors, torch.arange(L))
    log: list = []
    ahead = {kind: LayerAttention(LoggedAttend(spec.attend, kind, log), spec.ctx_index, True) for kind, spec in ref.items()}
    out, _ = _forward(model, samples, ahead)
    events = [(e[0], e[1]) for e in log]
    assert events == [
        ("begin", "sliding_attention"), ("begin", "full_attention"),  # layers 0 and 1 before layer 0 runs
        ("call", "sliding_attention"), ("begin", "full_attention"),  # layer 2's gather while layer 1 runs
        ("call", "full_attention"), ("call", "full_attention"),
    ]  # fmt: skip
    begins = [e[3] for e in log if e[0] == "begin"]
    calls = [e[2] for e in log if e[0] == "call"]
    assert calls == begins  # layer i gets the handle begun for layer i
    full_rows = [e[2] for e in log if e[0] == "begin" and e[1] == "full_attention"]
    assert full_rows == [L, L]  # begin gets the layer's context K/V rows (full layers: the whole context)

    plain, _ = _forward(model, samples, ref)
    assert torch.equal(out, plain)  # the same function, computed in another order


def test_begin_on_a_plan_that_gathers_nothing():
    """A single-rank plan gathers nothing: begin says so with None, and a handle passed anyway is refused."""
    case = Case("reference", False, (24,), 3)
    model = build(case)[0]
    ref = reference_attention(model.config, torch.tensor([2, 9, 15]), torch.arange(24))
    attend = ref["full_attention"].attend
    q = torch.randn(1, 4, 12, 8, dtype=torch.float64)
    k = v = torch.randn(1, 2, 24 + 12, 8, dtype=torch.float64)
    assert attend.begin(k[:, :, :24], v[:, :, :24]) is None
    with pytest.raises(ValueError, match="gathered: this plan gathers nothing"):
        attend(q, k, v, gathered=object())

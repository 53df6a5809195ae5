"""`compile_token_wise()` (what the trainer does on GPUs) computes the eager drafter's function: the same
loss and every gradient in float64 on the CPU, DFlash and DFlash2, sliding and full layers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specforge_csbp.bench.isolation import compiled_graphs
from specforge_csbp.models.dflash import AttentionOptions, drafter_step
from specforge_csbp.models.dflash.modeling import _normed_rope_heads
from tests.models.dflash.test_modes_equal_reference import Case, build
from tests.support.checks import rel_err


def _step(case: Case, compiled: bool):
    model, head, embed, samples, obj = build(case)
    if compiled:
        assert model.compile_token_wise() > 0
        assert model.compile_token_wise() > 0  # idempotent: compiling again keeps one compiled form
        assert all(layer.self_attn.normed_rope_heads is not _normed_rope_heads for layer in model.layers)
    res = drafter_step(
        model, samples, objective=obj, mode="reference", head_weight=head, embed_weight=embed, step=1,
        options=AttentionOptions(),
    )  # fmt: skip
    return res, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow(reason="inductor builds the drafter's token-wise C++ kernels (cold cache: minutes)")
@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_compiled_token_wise_equals_eager(dflash2):
    case = replace(Case("reference", dflash2, (37, 30), 5, seed=11), layer_types=("sliding_attention", "full_attention"))
    eager, eager_grads = _step(case, compiled=False)
    before = compiled_graphs()
    compiled, compiled_grads = _step(case, compiled=True)
    assert compiled_graphs() > before, "nothing was compiled"
    assert abs(compiled.loss - eager.loss) <= 1e-12 * abs(eager.loss)
    assert eager_grads.keys() == compiled_grads.keys()
    for name, g in eager_grads.items():
        assert g.abs().sum() > 0, name  # every parameter carries gradient, so every compiled path is checked
        assert rel_err(compiled_grads[name], g) < 1e-11, name

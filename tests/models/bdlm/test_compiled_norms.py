"""`train.compile_norms` (BDLMModel.compile_norms): every RMSNorm compiled in place computes what the eager
model does - loss and every gradient, with and without checkpointing and kept attention - and the layers
share one compiled graph per norm shape (no graph per layer).

transformers' RMSNorms compute in float32 whatever the model's dtype (`hidden_states.to(torch.float32)`), so
even a float64 model differs from its compiled self by float32 rounding (the kernel's reduction order and
rsqrt: 2.4e-7 on one norm's output): the tolerances are float32's, far below what a wrong norm gives."""

from __future__ import annotations

import pytest
import torch

from specforge_csbp.bench.isolation import compiled_graphs, fresh_point
from specforge_csbp.models.bdlm import BDLMModel
from specforge_csbp.models.bdlm.tiny import TINY_CONFIGS

L = 16  # clean tokens (2L rows), block 4


def _run(name: str, compiled: bool, setting: str):
    torch.manual_seed(0)
    model = BDLMModel.from_config(TINY_CONFIGS[name], dtype=torch.float64, block_size=4, backend="dense")
    if setting != "none":
        model.enable_activation_checkpointing(keep_attention=setting == "kept")
    norms = model.compile_norms() if compiled else 0
    model.train()
    ids = torch.randint(1, 60, (1, 2 * L), generator=torch.Generator().manual_seed(1))
    hidden = model(ids, model.attention("reference", L))
    loss = (hidden.square() * torch.linspace(0.5, 1.5, hidden.shape[-1], dtype=hidden.dtype)).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, norms


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
@pytest.mark.parametrize("setting", ["none", "recompute", "kept"])
def test_compiled_norms_equal_the_eager_model(name, setting):
    fresh_point()
    loss0, grads0, _ = _run(name, False, setting)
    before = compiled_graphs()
    loss, grads, norms = _run(name, True, setting)
    layers = TINY_CONFIGS[name]["num_hidden_layers"]
    assert norms >= 2 * layers + 1  # two per layer (four in Gemma 3) + the final norm; q/k norms besides
    # one graph per distinct norm input (hidden stream, q heads, k heads; Gemma's post-norms on sublayer
    # outputs share the hidden shape), not one per module
    assert 0 < compiled_graphs() - before <= 4
    assert loss.item() == pytest.approx(loss0.item(), rel=1e-6)
    assert grads.keys() == grads0.keys()
    for k in grads0:
        scale = grads0[k].abs().max().item()
        torch.testing.assert_close(grads[k], grads0[k], rtol=1e-5, atol=1e-6 * scale, msg=k)

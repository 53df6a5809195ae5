"""`train.compile` (BDLMModel.compile_token_wise): the LM's token-wise work compiled in place - every RMSNorm
("norms"), and besides each layer's attention module around the routed call and its dense MLP ("layers") -
computes what the eager model does: loss and every gradient, with and without checkpointing and kept
attention, for every tiny family (full and sliding layers, biases, GQA, MoE). The layers share their graphs
(a bounded count, not one per layer), the routed attention call stays out of them (dynamo never traces the
executor: its plan-driven Python would break graphs and recompile per call), and a second step compiles
nothing.

transformers' RMSNorms compute in float32 whatever the model's dtype (`hidden_states.to(torch.float32)`), so
even a float64 model differs from its compiled self by float32 rounding (the kernel's reduction order and
rsqrt: 2.4e-7 on one norm's output): the tolerances are float32's, far below what a wrong layer gives."""

from __future__ import annotations

import pytest
import torch

from specforge_csbp.bench.isolation import compiled_graphs, fresh_point
from specforge_csbp.models.bdlm import BDLMModel
from specforge_csbp.models.bdlm.tiny import TINY_CONFIGS
from specforge_csbp.training.trainer import _compile_scope

L = 16  # clean tokens (2L rows), block 4


def _model(name: str, setting: str) -> BDLMModel:
    torch.manual_seed(0)
    model = BDLMModel.from_config(TINY_CONFIGS[name], dtype=torch.float64, block_size=4, backend="dense")
    if setting != "none":
        model.enable_activation_checkpointing(keep_attention=setting == "kept")
    return model.train()


def _step(model: BDLMModel, seed: int = 1):
    ids = torch.randint(1, 60, (1, 2 * L), generator=torch.Generator().manual_seed(seed))
    hidden = model(ids, model.attention("reference", L))
    loss = (hidden.square() * torch.linspace(0.5, 1.5, hidden.shape[-1], dtype=hidden.dtype)).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compiled_modules(model: BDLMModel) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for m in model.lm.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            kind = "norm" if type(m).__name__.endswith("RMSNorm") else type(m).__name__
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


@pytest.mark.slow(reason="inductor builds each family's token-wise C++ kernels (cold cache)")
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("setting", ["none", "recompute", "kept"])
@pytest.mark.parametrize("scope", ["layers", "norms"])
def test_compiled_model_equals_the_eager_model(name, setting, scope):
    fresh_point()
    loss0, grads0 = _step(_model(name, setting))
    model = _model(name, setting)
    count = model.compile_token_wise(scope)
    layers = TINY_CONFIGS[name]["num_hidden_layers"]
    kinds = _compiled_modules(model)
    assert count == sum(kinds.values())
    assert kinds["norm"] >= 2 * layers + 1  # two per layer (four in Gemma 3) + the final norm; q/k norms besides
    attention = sum(v for k, v in kinds.items() if k.endswith("Attention"))
    mlps = sum(v for k, v in kinds.items() if k.endswith("MLP"))
    assert attention == (layers if scope == "layers" else 0)
    dense = not (TINY_CONFIGS[name].get("num_experts") or TINY_CONFIGS[name].get("num_local_experts"))
    assert mlps == (layers if scope == "layers" and dense else 0)  # an MoE block stays eager

    before = compiled_graphs()
    loss, grads = _step(model)
    graphs = compiled_graphs() - before
    # shared across layers: a handful per distinct (module class, input shape, window); never one per layer
    # of each kind, and never the executor's (tracing it would break at every .item() of the plan)
    assert 0 < graphs <= (8 if scope == "layers" else 4)
    assert loss.item() == pytest.approx(loss0.item(), rel=1e-6)
    assert grads.keys() == grads0.keys()
    for k in grads0:
        scale = grads0[k].abs().max().item()
        torch.testing.assert_close(grads[k], grads0[k], rtol=1e-5, atol=1e-6 * scale, msg=k)

    # the next step - a new route object, other tokens - runs the same graphs
    before = compiled_graphs()
    _step(model, seed=2)
    assert compiled_graphs() == before


def test_compile_setting_resolves_per_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert _compile_scope("auto", gpu) == "layers" and _compile_scope("auto", cpu) is None
    assert _compile_scope(True, cpu) == "layers" and _compile_scope(False, gpu) is None
    assert _compile_scope("norms", gpu) == "norms"


def test_unknown_scope_is_one_line():
    model = _model("qwen3", "none")
    with pytest.raises(ValueError, match=r"^train.compile: scope must be one of layers, norms; got 'all'$"):
        model.compile_token_wise("all")

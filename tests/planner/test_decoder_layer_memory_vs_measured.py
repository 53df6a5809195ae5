"""The planner's per-row bytes of one decoder layer (`decoder_layer_bytes_per_row`) against what the layer
really saves for backward, for every supported family's tiny config, as train-bdlm runs it on a GPU:
bf16 autocast over fp32 weights (and, second, bf16 weights without autocast), BDLMModel's routed
attention on the flex backend.

Measured with `torch.autograd.graph.saved_tensors_hooks` over each decoder layer's forward, counting the
unique storages of row-sized tensors (weights and their autocast copies scale with no row: left out; the
rotary cos / sin every layer shares: left out). The FlexAttention kernel itself cannot run backward on the
CPU, so it is replaced by a function that saves what FlexAttention saves - q, k, v, out (out strided like
q, as flex allocates it) and the fp32 log-sum-exp; everything around it (GQA packing, casts, o_proj) runs
as on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from specforge_csbp.attention import flex as flex_backend
from specforge_csbp.models.bdlm import BDLMModel
from specforge_csbp.models.bdlm.tiny import TINY_CONFIGS
from specforge_csbp.planner.memory import decoder_layer_bytes_per_row, layer_activation_bytes_per_row
from specforge_csbp.planner.shapes import load_shape

FAMILIES = ["qwen3", "llama", "qwen2", "gemma3", "qwen3_moe"]
L = 256  # clean tokens: 2L = 512 rows; the sliding GQA layers pack at this length, the full ones do not
TOL = 0.10


class _FlexSaves(torch.autograd.Function):
    """Forward-only stand-in for the flex kernel that saves what it saves."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.zeros_like(q)
        lse = torch.zeros(q.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - the test runs forward only
        raise NotImplementedError


def stand_in_flex(monkeypatch) -> list[int]:
    """Replace the flex kernel by `_FlexSaves`; returns the list each call appends its query heads to (fewer
    than the model's: the call ran GQA-packed)."""
    query_heads: list[int] = []

    def kernel(q, k, v, **kwargs):
        query_heads.append(q.shape[1])
        return _FlexSaves.apply(q, k, v)

    monkeypatch.setattr(flex_backend, "_compiled_flex", lambda: kernel)
    return query_heads


def _measure(name: str, autocast: bool, monkeypatch) -> tuple[list[float], list[bool], dict]:
    """Per decoder layer: saved bytes per row, and whether its attention ran GQA-packed."""
    query_heads = stand_in_flex(monkeypatch)
    cfg = dict(TINY_CONFIGS[name])
    torch.manual_seed(0)
    model = BDLMModel.from_config(cfg, dtype=torch.float32 if autocast else torch.bfloat16, block_size=4,
                                  backend="flex")  # fmt: skip
    attention = model.attention("reference", L)
    ids = torch.randint(1, 60, (1, 2 * L), generator=torch.Generator().manual_seed(1))
    rows = 2 * L
    current: list[int | None] = [None]
    shared: set[int] = set()
    saved: list[dict[int, int]] = [{} for _ in model.lm.base_model.layers]

    def enter(module, args, kwargs, i):
        current[0] = i
        shared.update(t.untyped_storage().data_ptr() for t in kwargs.get("position_embeddings") or ())

    def leave(module, args, kwargs, out):
        current[0] = None

    handles = []
    for i, layer in enumerate(model.lm.base_model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, kw, i=i: enter(m, a, kw, i), with_kwargs=True))
        handles.append(layer.register_forward_hook(leave, with_kwargs=True))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        row_sized = any(d % rows == 0 for d in t.shape) and t.numel() >= rows
        if current[0] is not None and row_sized and storage.data_ptr() not in shared:
            saved[current[0]][storage.data_ptr()] = storage.nbytes()
        return t

    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with amp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, attention)
    for h in handles:
        h.remove()
    packed = [hq < cfg["num_attention_heads"] for hq in query_heads]
    return [sum(s.values()) / rows for s in saved], packed, cfg


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast-fp32-weights", "bf16-weights"])
@pytest.mark.parametrize("name", FAMILIES)
def test_predicted_layer_bytes_match_the_measured_layer(name, autocast, monkeypatch):
    measured, packed, cfg = _measure(name, autocast, monkeypatch)
    shape = load_shape(cfg)
    assert len(measured) == len(packed) == shape.layers
    for i, got in enumerate(measured):
        want = decoder_layer_bytes_per_row(shape, i, gemm_bytes=2, residual_bytes=4 if autocast else 2,
                                           gqa_packed=packed[i])  # fmt: skip
        assert want == pytest.approx(got, rel=TOL), (name, i, want, got)


def test_the_measurement_sees_packing_and_moe_rows(monkeypatch):
    """The cases the families differ in really occur: a packed sliding layer next to an unpacked full one
    (Gemma 3), and routed experts (Qwen3-MoE) whose count is not the dense MLP's."""
    measured, packed, cfg = _measure("gemma3", True, monkeypatch)
    assert packed == [True, False]
    shape = load_shape(cfg)
    assert measured[0] - measured[1] == pytest.approx(2 * shape.heads * shape.head_dim)  # the unpacked out copy
    moe, _, moe_cfg = _measure("qwen3_moe", True, monkeypatch)
    moe_shape = load_shape(moe_cfg)
    assert moe_shape.is_sparse(0) and moe_shape.experts_per_token == 2
    dense = decoder_layer_bytes_per_row(load_shape({**moe_cfg, "num_experts": 0}), 0, gemm_bytes=2, residual_bytes=4)
    assert abs(moe[0] - dense) > TOL * moe[0]


def test_the_former_qwen3_constant_underestimates_gemma3(monkeypatch):
    """The former model (the draft layer's bf16 count + 10 fp32 bytes per hidden unit, fitted on Qwen3)
    misses Gemma 3's four fp32 norms and q/k norms by far more than the tolerance."""
    measured, _, cfg = _measure("gemma3", True, monkeypatch)
    shape = load_shape(cfg)
    former = layer_activation_bytes_per_row(shape, 2) + 10 * shape.hidden
    assert former < (1 - TOL) * min(measured)
    assert (shape.norm_kind, shape.hidden_norms, shape.qk_norm) == ("gemma", 4, True)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen3_moe"])
def test_trainable_params_count_every_expert(name):
    """The states term's parameter count equals the model's weights but its norms (MoE: every expert of
    every sparse layer and the router, not the dense MLP width the config also names)."""
    model = BDLMModel.from_config(TINY_CONFIGS[name], dtype=torch.float32, block_size=4, backend="flex")
    weights = sum(p.numel() for n, p in model.lm.named_parameters() if "norm" not in n)
    assert load_shape(model.config.to_dict()).trainable_params == weights  # as auto reads it

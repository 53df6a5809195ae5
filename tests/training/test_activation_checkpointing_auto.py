"""`train.activation_checkpointing: auto`: on exactly when the planner's memory model (plus autocast's fp32
norm copies, measured here on a Qwen3 layer) says a step would not fit the GPU's memory (mocked) without."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from specforge_csbp.planner.memory import layer_activation_bytes_per_row
from specforge_csbp.planner.shapes import load_shape
from specforge_csbp.training import checkpointing, trainer
from specforge_csbp.training.checkpointing import (
    AUTOCAST_ROW_BYTES_PER_HIDDEN,
    HEADROOM_GIB,
    HEADROOM_SHARE,
    bdlm_peak_gib,
    keep_activations,
    layers_that_fit,
    needs_checkpointing,
    resolve_checkpointing,
)
from specforge_csbp.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
GiB = float(1 << 30)


def _qwen3_1p7b():
    from transformers import AutoConfig

    raw = json.loads((ROOT / "benchmarks" / "configs" / "qwen3-1.7b.json").read_text())
    return AutoConfig.for_model(raw.pop("model_type", "qwen3"), **raw)


def _run(seq_len: int, device: str = "cuda", micro: int = 1):
    model = types.SimpleNamespace(config=_qwen3_1p7b(), block_size=32, clean_within_block="causal")
    workload = types.SimpleNamespace(seq_len=seq_len, objective=types.SimpleNamespace(batch_factor=1),
                                     ce_chunk_size=4096)  # fmt: skip
    ctx = types.SimpleNamespace(mode="reference", cp_size=1, param_dtype=torch.float32, is_main=True,
                                autocast_dtype=torch.bfloat16, micro_batch_size=micro, device=torch.device(device))  # fmt: skip
    return workload, model, ctx


def test_headroom_rule():
    assert not needs_checkpointing(100.0, 100.0 * (1 + HEADROOM_SHARE) + HEADROOM_GIB + 0.01)
    assert needs_checkpointing(100.0, 100.0 * (1 + HEADROOM_SHARE) + HEADROOM_GIB - 0.01)


def test_autocast_row_bytes_match_a_measured_qwen3_layer():
    """Saved-tensor bytes of one Qwen3 decoder layer under bf16 autocast (fp32 weights), score-sized buffers
    of the CPU attention left out (FlexAttention has none): the planner's count + the autocast term."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    h, n = 256, 512
    cfg = Qwen3Config(hidden_size=h, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=768, num_hidden_layers=1, vocab_size=128)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    layer, rope = Qwen3DecoderLayer(cfg, 0), Qwen3RotaryEmbedding(cfg)
    x = torch.randn(1, n, h, requires_grad=True)
    pos = torch.arange(n)[None]
    storages: dict[int, int] = {}

    def pack(t):
        if t.numel() < n * n:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = rope(x, pos)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
    measured = (sum(storages.values()) - x.numel() * 4) / n  # the input is the previous layer's output
    shape = load_shape({**cfg.to_dict(), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    planner = layer_activation_bytes_per_row(shape, 2)
    assert measured > 1.15 * planner  # the bf16 count alone underestimates autocast
    assert planner + AUTOCAST_ROW_BYTES_PER_HIDDEN * h == pytest.approx(measured, rel=0.05)


def test_qwen3_1p7b_needs_it_from_16k_on_one_h200():
    """The issue's measurement: without checkpointing the 1.7B shape ran out of memory at 16K on an H200
    (134.6 GiB allocated at step 1); the prediction puts 16K over the H200's memory and 8K under it."""
    h200 = 139.0
    assert not needs_checkpointing(bdlm_peak_gib(*_run(8192), checkpointing=False), h200)
    assert needs_checkpointing(bdlm_peak_gib(*_run(16384), checkpointing=False), h200)
    assert bdlm_peak_gib(*_run(65536), checkpointing=True) < h200 < bdlm_peak_gib(*_run(65536), checkpointing=False)
    assert bdlm_peak_gib(*_run(8192, micro=2), checkpointing=False) > bdlm_peak_gib(*_run(8192), checkpointing=False)


def test_layers_that_fit_uses_the_per_layer_share():
    limit = 100.0  # fits when peak * (1 + HEADROOM_SHARE) + HEADROOM_GIB <= limit
    most = (limit - HEADROOM_GIB) / (1 + HEADROOM_SHARE)
    assert layers_that_fit(most - 1, 10.0, 10, limit) == 10  # everything fits: no checkpointing
    per = (200.0 - 10.0) / 10
    assert layers_that_fit(200.0, 10.0, 10, limit) == int((most - 10.0) // per)
    assert layers_that_fit(200.0, most + 1, 10, limit) == 0  # even fully checkpointed it is tight: all layers


def test_partial_checkpointing_keeps_the_last_layers_and_the_gradients():
    """keep_activations on a tiny Qwen3: the last k layers run un-checkpointed; gradients equal the
    un-checkpointed model's (float64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      intermediate_size=64, num_hidden_layers=4, vocab_size=64)  # fmt: skip
    torch.manual_seed(0)
    ref = Qwen3ForCausalLM(cfg).double().train()
    part = Qwen3ForCausalLM(cfg).double().train()
    part.load_state_dict(ref.state_dict())
    enable = getattr(part, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # transformers < 5
        part.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert keep_activations(part, 3) == 3
    assert [layer.gradient_checkpointing for layer in part.model.layers] == [True, False, False, False]
    ids = torch.randint(0, 64, (2, 12))
    for m in (ref, part):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(ref.named_parameters(), part.parameters()):
        assert torch.equal(a.grad, b.grad), name


def _mock_gpu(monkeypatch, free_gib: float, held_gib: float = 3.0):
    monkeypatch.setattr(checkpointing.torch.cuda, "mem_get_info", lambda d: (int(free_gib * GiB), int(141 * GiB)))
    monkeypatch.setattr(checkpointing.torch.cuda, "memory_allocated", lambda d: int(held_gib * GiB))


def test_resolve_reads_free_plus_held_memory(monkeypatch):
    _mock_gpu(monkeypatch, free_gib=136.0)  # + 3 GiB the model already holds = 139
    assert resolve_checkpointing(*_run(8192)).enabled is False
    on = resolve_checkpointing(*_run(16384))
    assert on.enabled is True and "> 139.0 GiB" in on.line()
    _mock_gpu(monkeypatch, free_gib=60.0)
    assert resolve_checkpointing(*_run(8192)).enabled is True
    assert resolve_checkpointing(*_run(65536, device="cpu")).line() == "train.activation_checkpointing auto -> off (no GPU)"
    workload, model, ctx = _run(8192)
    no_model = resolve_checkpointing(types.SimpleNamespace(), model, ctx)
    assert no_model.enabled is False and "no memory model" in no_model.reason


def test_trainer_applies_auto_and_keeps_explicit_values(monkeypatch, capsys):
    _mock_gpu(monkeypatch, free_gib=136.0)
    workload, model, ctx = _run(16384)
    assert TrainConfig().activation_checkpointing == "auto"
    enabled, keep = trainer._checkpointing(TrainConfig(), workload, model, ctx)
    assert enabled and 0 < keep < 28  # 16K: most layers keep their activations, a few are recomputed
    assert f"train.activation_checkpointing auto -> on for {28 - keep} of 28 layers" in capsys.readouterr().out
    workload8, model8, ctx8 = _run(8192)
    assert trainer._checkpointing(TrainConfig(), workload8, model8, ctx8) == (False, 0)
    assert trainer._checkpointing(TrainConfig(activation_checkpointing=False), workload, model, ctx) == (False, 0)
    assert trainer._checkpointing(TrainConfig(activation_checkpointing=True), workload8, model8, ctx8) == (True, 0)
    assert resolve_checkpointing(*_run(131072)).keep_layers == 0  # 128K: every layer checkpointed
    with pytest.raises(ValueError):
        TrainConfig(activation_checkpointing="sometimes")

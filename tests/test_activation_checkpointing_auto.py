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
    needs_checkpointing,
    resolve_checkpointing,
)
from specforge_csbp.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
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
    assert trainer._checkpointing(TrainConfig(), workload, model, ctx) is True
    assert "train.activation_checkpointing auto -> on" in capsys.readouterr().out
    workload8, model8, ctx8 = _run(8192)
    assert trainer._checkpointing(TrainConfig(), workload8, model8, ctx8) is False
    assert trainer._checkpointing(TrainConfig(activation_checkpointing=False), workload, model, ctx) is False
    assert trainer._checkpointing(TrainConfig(activation_checkpointing=True), workload8, model8, ctx8) is True
    with pytest.raises(ValueError):
        TrainConfig(activation_checkpointing="sometimes")

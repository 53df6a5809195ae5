"""Planner vs benchmark records: the built-in calibrated profile, the benchmark model configs, and the
options a record's benchmark ran with (memory terms that follow from them)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from specforge_csbp.bench.records import BenchRecord
from specforge_csbp.models.bdlm.tiny import QWEN3_1_7B
from specforge_csbp.planner.cost import Layout, Options, predict
from specforge_csbp.planner.memory import decoder_layer_bytes_per_row, layer_activation_bytes_per_row
from specforge_csbp.planner.profile import BUILTIN_PROFILES, load_profile
from specforge_csbp.planner.shapes import load_shape
from specforge_csbp.planner.validate import BENCHMARK_OPTIONS, record_options, record_predictor

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "benchmarks" / "configs"


def _bench_shapes() -> dict:
    spec = importlib.util.spec_from_file_location("drafter_bench", ROOT / "benchmarks" / "drafter_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SHAPES


def test_builtin_calibrated_profile_loads():
    assert "h200x2-2026-11-29" in BUILTIN_PROFILES
    p = load_profile("h200x2-2026-11-29")
    assert p.measured and p.device == "NVIDIA H200" and p.date == "2026-11-29" and p.world_size == 2
    assert p.allgather_gbps and p.reduce_scatter_gbps and p.allreduce_gbps and p.gemm_tflops > p.attn_tflops


@pytest.mark.parametrize("key, name", [("a", "drafter-qwen3.6-27b"), ("b", "drafter-qwen3-8b")])
def test_benchmark_drafter_configs_match_the_benchmark_shapes(key, name):
    want = _bench_shapes()[key]
    s = load_shape(CONFIGS / f"{name}.json", workload="drafter")
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    assert (s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab) == (
        want["hidden_size"], want["intermediate_size"], want["num_hidden_layers"], want["num_attention_heads"],
        want["num_key_value_heads"], want["head_dim"], want["vocab_size"])  # fmt: skip
    windows = tuple(want["sliding_window"] if t == "sliding_attention" else None for t in want["layer_types"])
    assert s.windows == windows and cfg["dflash_config"]["block_size"] == want["block_size"] == 16
    # the GPU runs used --dflash2 for both shapes (drafter_bench.py build_config: conv 2 / 16, selector 256 / 16)
    assert s.dflash2 and (s.conv_taps, s.conv_groups, s.selector_rank, s.selector_top_k) == (2, s.hidden // 16, 256, 16)
    if want["target_layer_ids"]:
        assert cfg["dflash_config"]["target_layer_ids"] == want["target_layer_ids"]
    assert s.features == s.layers and s.target_hidden == s.hidden


def test_benchmark_sft_config_is_qwen3_1_7b():
    s = load_shape(CONFIGS / "qwen3-1.7b.json", workload="sft")
    assert (s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab, s.tied_embeddings) == (
        QWEN3_1_7B["hidden_size"], QWEN3_1_7B["intermediate_size"], QWEN3_1_7B["num_hidden_layers"],
        QWEN3_1_7B["num_attention_heads"], QWEN3_1_7B["num_key_value_heads"], QWEN3_1_7B["head_dim"],
        QWEN3_1_7B["vocab_size"], QWEN3_1_7B["tie_word_embeddings"])  # fmt: skip
    assert set(s.windows) == {None} and not s.drafter


def test_dflash2_terms():
    d2 = load_shape(CONFIGS / "drafter-qwen3-8b.json")
    d1 = d2.without_dflash2()
    h, e = d2.hidden, 2
    assert layer_activation_bytes_per_row(d2, e) - layer_activation_bytes_per_row(d1, e) == e * 2 * (2 * 2 + 2) * h
    conv = 2 * (h * 2 * 2 * (h // 16) + 2 * 2 * h)
    assert d2.trainable_params - d1.trainable_params == d2.layers * conv + (2 * d2.vocab + h) * 256


def _rec(**kw):
    base = dict(workload="w", mode="csbp", world_size=2, context_len=65536, block_size=16, device="d",
                date="x", command="c", step_ms=1.0, peak_mem_gib=1.0, tokens_per_s=1.0)  # fmt: skip
    return BenchRecord(**{**base, **kw})


def test_record_options_follow_the_benchmark_and_the_record():
    o = record_options(_rec(anchors=128), "drafter")
    assert (o.anchors, o.state_bytes_per_param, o.ce_chunk, o.checkpointing) == (128, 4.0, 2048, False)
    o = record_options(_rec(block_size=32, activation_checkpointing=False, precision="float32",
                            state_bytes_per_param=8), "sft")  # fmt: skip
    assert (o.block_size, o.checkpointing, o.autocast, o.state_bytes_per_param) == (32, False, False, 8.0)
    assert record_options(_rec(), "sft").ce_chunk == BENCHMARK_OPTIONS["sft"]["ce_chunk"]


def test_record_predictor_compares_tensor_bytes_and_honours_dflash2_off():
    prof = load_profile("h200x2-2026-11-29")
    path = str(CONFIGS / "drafter-qwen3-8b.json")
    fn = record_predictor({"w": path}, prof)
    on, off = fn(_rec(anchors=512)), fn(_rec(anchors=512, dflash2=False))
    shape = load_shape(path)
    full = predict(shape, "drafter", 65536, Layout(1, 2, "csbp"), prof, float("inf"),
                   Options(anchors=512, state_bytes_per_param=4.0, ce_chunk=2048))  # fmt: skip
    assert on.peak_gib == pytest.approx(full.peak_gib - prof.reserved_gib) and on.step_ms == pytest.approx(full.step_ms)
    states = (shape.trainable_params - shape.without_dflash2().trainable_params) * 4.0 / (1 << 30)
    assert on.peak_gib - off.peak_gib > states > 0
    assert fn(_rec(mode="specforge", world_size=1)) is None and fn(_rec(status="oom")) is None


def test_autocast_keeps_the_checkpointed_residual_stream_in_fp32():
    s = load_shape(CONFIGS / "qwen3-1.7b.json")
    prof = load_profile("h200x2-2026-11-29")
    a, b = (predict(s, "sft", 16384, Layout(1, 2, "csbp"), prof, 1e9, Options(block_size=32, autocast=x))
            for x in (True, False))  # fmt: skip
    rows = 16384  # per rank: 2L rows over 2 ranks
    # the fp32 checkpointed inputs, and the recomputed layer's fp32 norms and per-projection bf16 casts
    recomputed = (decoder_layer_bytes_per_row(s, gemm_bytes=2, residual_bytes=4, gqa_packed=True)
                  - decoder_layer_bytes_per_row(s, gemm_bytes=2, residual_bytes=2, gqa_packed=True))  # fmt: skip
    assert recomputed == 2 * 2 * s.hidden + 3 * 2 * s.hidden  # 2 hidden norms' fp32 copies, 3 more casts
    assert (a.memory.activations - b.memory.activations) * (1 << 30) == pytest.approx(
        s.layers * rows * s.hidden * 2 + rows * recomputed
    )
    assert dataclasses.replace(a.memory, activations=0) == dataclasses.replace(b.memory, activations=0)

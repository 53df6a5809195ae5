"""`train.activation_checkpointing: auto`: on exactly when the planner's memory model (each family's decoder
layer as tests/planner/test_decoder_layer_memory_vs_measured.py measures it) says a step would not fit the
GPU's memory (mocked) without."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import yaml

from specforge_csbp.planner.memory import decoder_layer_bytes_per_row, layer_activation_bytes_per_row
from specforge_csbp.planner.shapes import load_shape
from specforge_csbp.training import checkpointing, trainer
from specforge_csbp.training.checkpointing import (
    HEADROOM_GIB,
    HEADROOM_SHARE,
    PeakModel,
    bdlm_peak_gib,
    bdlm_peaks,
    keep_activations,
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


def _gemma3_1b():
    from transformers import AutoConfig

    recipe = yaml.safe_load((ROOT / "benchmarks" / "configs" / "bdlm_gemma3-1b_32k.yaml").read_text())
    raw = dict(recipe["model"]["config"])
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def test_gemma3_recipe_checkpoints_more_layers_than_the_former_qwen3_constant_did(monkeypatch):
    """The Gemma-3-1B recipe at 32K on a 139 GiB H200: the former model (the draft layer's bf16 count + 10
    fp32 bytes per hidden unit) kept 13 of 26 layers and the step ran out of memory; each Gemma layer saves
    ~45% more per row than that (four fp32 norms, q/k norms), so auto now keeps fewer, and the chosen
    setting's prediction + headroom fits."""
    workload, model, ctx = _run(32768)
    model.config = _gemma3_1b()
    shape = load_shape(model.config.to_dict())
    new = decoder_layer_bytes_per_row(shape, 0, gemm_bytes=2, residual_bytes=4, gqa_packed=True)
    former = layer_activation_bytes_per_row(shape, 2) + 10 * shape.hidden
    assert new > 1.3 * former
    peaks = bdlm_peaks(workload, model, ctx)
    keep, attention = peaks.choose(139.0, recompute_attention=True)
    assert 0 < keep < 13 and attention == ()
    assert needs_checkpointing(peaks.peak(13), 139.0)  # the setting that ran out
    assert not needs_checkpointing(peaks.peak(keep), 139.0)
    _mock_gpu(monkeypatch, free_gib=136.0)
    line = resolve_checkpointing(workload, model, ctx, recompute_attention=True).line()
    assert f"on for {26 - keep} of 26 layers, attention recomputed" in line
    assert f"{peaks.peak(keep):.1f} GiB as chosen" in line


def test_qwen3_1p7b_needs_it_from_16k_on_one_h200():
    """The issue's measurement: without checkpointing the 1.7B shape ran out of memory at 16K on an H200
    (134.6 GiB allocated at step 1); the prediction puts 16K over the H200's memory and 8K under it."""
    h200 = 139.0
    assert not needs_checkpointing(bdlm_peak_gib(*_run(8192), checkpointing=False), h200)
    assert needs_checkpointing(bdlm_peak_gib(*_run(16384), checkpointing=False), h200)
    assert bdlm_peak_gib(*_run(65536), checkpointing=True) < h200 < bdlm_peak_gib(*_run(65536), checkpointing=False)
    assert bdlm_peak_gib(*_run(8192, micro=2), checkpointing=False) > bdlm_peak_gib(*_run(8192), checkpointing=False)


def test_peak_model_is_linear_in_kept_layers_and_attention_outputs():
    peaks = PeakModel(none=210.0, all=10.0, kept=30.0, layers=10)
    assert peaks.peak() == 10.0 and peaks.peak(10) == 210.0 and peaks.peak(0, 10) == 30.0
    assert peaks.peak(3, 4) == pytest.approx(10.0 + 3 * 20.0 + 4 * 2.0)


def _cap(peak: float) -> float:
    """The memory at which a step predicted at `peak` just fits with headroom."""
    return peak * (1 + HEADROOM_SHARE) + HEADROOM_GIB + 1e-9


def test_choose_recompute_true_keeps_the_most_whole_layers_that_fit():
    peaks = PeakModel(none=210.0, all=10.0, kept=30.0, layers=10)
    assert peaks.choose(_cap(210.0)) == (10, ())  # everything fits: no checkpointing
    assert peaks.choose(_cap(70.0), recompute_attention=True) == (3, ())
    assert peaks.choose(_cap(69.0), recompute_attention=True) == (2, ())
    assert peaks.choose(_cap(9.0), recompute_attention=True) == (0, ())  # even fully checkpointed it is tight


def test_choose_recompute_false_keeps_every_attention_output_and_whole_layers_on_top():
    peaks = PeakModel(none=210.0, all=10.0, kept=30.0, layers=10)
    # k whole layers + (10 - k) attention outputs: 10 + 20 k + 2 (10 - k) = 30 + 18 k
    assert peaks.choose(_cap(66.0), recompute_attention=False) == (2, tuple(range(8)))
    assert peaks.choose(_cap(30.0), recompute_attention=False) == (0, tuple(range(10)))


def test_auto_keeps_the_attention_outputs_with_the_most_flops_first():
    """Full-attention layers (many FLOPs) before sliding ones (few); when every output fits, whole layers
    on top; and whole layers instead when their GEMMs save more than the attention outputs they displace."""
    flops = (1.0, 1.0, 50.0, 1.0, 1.0, 50.0, 1.0, 1.0, 1.0, 50.0)
    peaks = PeakModel(none=210.0, all=10.0, kept=30.0, layers=10, attention_flops=flops, other_flops=5.0)
    assert peaks.choose(_cap(16.0)) == (0, (2, 5, 9))  # room for 3 outputs: the three full layers
    assert peaks.choose(_cap(17.9)) == (0, (2, 5, 9))
    assert peaks.choose(_cap(18.0)) == (0, (2, 5, 8, 9))  # a fourth: the latest sliding layer
    keep, attention = peaks.choose(_cap(66.0))  # every output fits with whole layers on top
    assert keep == 2 and attention == tuple(range(8))
    gemm_heavy = PeakModel(none=210.0, all=10.0, kept=30.0, layers=10, attention_flops=(1.0,) * 10,
                           other_flops=100.0)  # fmt: skip
    keep, attention = gemm_heavy.choose(_cap(31.0))  # one whole layer (20 GiB) beats 10 outputs (2 GiB each)
    assert keep == 1 and len(attention) == 0


def test_qwen3_1p7b_at_64k_keeps_attention_instead_of_a_layer():
    """The 64K profile point: recomputing attention, a layer or two fit un-checkpointed; keeping attention,
    many more layers' outputs do (each an eighth of a layer's memory, 3/4 of its recompute's FLOPs at 64K)."""
    peaks = bdlm_peaks(*_run(65536))
    whole, none_kept = peaks.choose(139.0, recompute_attention=True)
    assert 0 < whole < 4 and none_kept == ()
    keep, attention = peaks.choose(139.0)  # one H200: every output (measured 112.2 GiB), no whole layer
    assert keep == 0 and attention == tuple(range(28))
    keep, attention = peaks.choose(110.0)  # less memory: as many outputs as fit
    assert keep == 0 and len(attention) > 4 * whole
    assert not needs_checkpointing(peaks.peak(0, len(attention)), 110.0)
    assert needs_checkpointing(peaks.peak(0, len(attention) + 1), 110.0)
    assert sum(peaks.attention_flops) > 2 * 28 * peaks.other_flops  # attention dominates a 64K layer


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
    assert TrainConfig().activation_checkpointing == "auto" and TrainConfig().recompute_attention == "auto"
    plan = trainer._checkpointing(TrainConfig(), workload, model, ctx)
    assert plan.enabled and 0 < plan.keep_layers < 28  # 16K: most layers keep their activations
    assert plan.attention_layers == tuple(range(28 - plan.keep_layers))  # every checkpointed layer's attention
    out = capsys.readouterr().out
    assert f"train.activation_checkpointing auto -> on for {28 - plan.keep_layers} of 28 layers, attention kept" in out
    recompute = trainer._checkpointing(TrainConfig(recompute_attention=True), workload, model, ctx)
    assert recompute.enabled and recompute.attention_layers == () and recompute.keep_layers > plan.keep_layers
    workload8, model8, ctx8 = _run(8192)
    assert not trainer._checkpointing(TrainConfig(), workload8, model8, ctx8).enabled
    assert not trainer._checkpointing(TrainConfig(activation_checkpointing=False), workload, model, ctx).enabled
    explicit = trainer._checkpointing(TrainConfig(activation_checkpointing=True), workload8, model8, ctx8)
    assert explicit.enabled and explicit.keep_layers == 0 and explicit.attention_layers == tuple(range(28))
    assert "train.recompute_attention auto -> on, attention kept" in capsys.readouterr().out
    as_set = trainer._checkpointing(TrainConfig(activation_checkpointing=True, recompute_attention=False),
                                    workload8, model8, ctx8)  # fmt: skip
    assert as_set.attention_layers == tuple(range(28)) and capsys.readouterr().out == ""
    assert resolve_checkpointing(*_run(131072)).keep_layers == 0  # 128K: every layer checkpointed
    with pytest.raises(ValueError):
        TrainConfig(activation_checkpointing="sometimes")
    with pytest.raises(ValueError, match="recompute_attention"):
        TrainConfig(recompute_attention="sometimes")


@pytest.mark.parametrize(
    "block, groups, window",
    [(32, 2, None), (32, 4, None), (32, 4, 256), (16, 2, 256), (32, 8, None), (8, 4, 96)],
)
def test_the_packing_guess_on_a_short_probe_matches_the_full_sequence(block, groups, window, monkeypatch):
    """`layer_packs` counts tiles on a probe sequence; its answer is the one `should_pack` gives the whole
    sequence's 2L mask (here 4x the probe), for full and sliding layers, 2-8 query heads per KV head."""
    from specforge_csbp.attention.packing import should_pack
    from specforge_csbp.layout.plans import bdlm_plan
    from specforge_csbp.masks import Visibility
    from specforge_csbp.training import checkpointing

    monkeypatch.setattr(checkpointing, "PACKING_PROBE_TOKENS", 1024)
    checkpointing.layer_packs.cache_clear()
    plan = bdlm_plan("csbp", 4096, block, 1)[0]
    full = should_pack(Visibility(plan.q_tokens, plan.kv_tokens, block, window=window), groups, "cpu")
    assert checkpointing.layer_packs(4096, block, groups, window, "causal") == full
    checkpointing.layer_packs.cache_clear()


def test_the_packing_copy_is_counted_per_layer():
    """bdlm_step_memory: a flag per layer counts GQA packing's output copy (e H D per row) only where set."""
    from specforge_csbp.planner.memory import bdlm_step_memory
    from specforge_csbp.planner.pairs import bdlm_rank_stats
    from specforge_csbp.planner.shapes import load_shape

    shape = load_shape(json.loads((ROOT / "benchmarks/configs/qwen3-1.7b.json").read_text()))
    (stats,) = bdlm_rank_stats("csbp", 8192, 32, 1, "causal")
    n = shape.layers

    def act(packed, **kw):
        kw = {"views": 1, "elem_bytes": 2, "state_bytes": 16.0, "ce_chunk": 4096, "reserved_gib": 0.0,
              "residual_bytes": 4, **kw}  # fmt: skip
        return bdlm_step_memory(shape, stats, gqa_packed=packed, **kw).activations

    copy = 2 * 8192 * 2 * shape.heads * shape.head_dim / 2**30  # e H D per 2L row, one layer
    assert act([True] * n, checkpointing=False) == pytest.approx(act(True, checkpointing=False))
    assert act(True, checkpointing=False) - act(False, checkpointing=False) == pytest.approx(n * copy)
    first_three = [i < 3 for i in range(n)]
    assert act(first_three, checkpointing=False) - act(False, checkpointing=False) == pytest.approx(3 * copy)
    kept = {"checkpointing": True, "attention_kept": True}
    first_five = [i < 5 for i in range(n)]
    # every kept layer's copy + the one recomputed layer's
    assert act(first_five, **kept) - act(False, **kept) == pytest.approx(5 * copy + copy)
    with pytest.raises(ValueError, match="gqa_packed: one flag per layer"):
        act([True] * (n - 1), checkpointing=False)


def test_a_step_down_asks_for_less_every_time():
    """step_down_scale: the failed choice no longer fits at the new scale, and the scale grows >= 10% per
    retry, so a run steps down to everything checkpointed and recomputed (then nothing smaller is left)."""
    from specforge_csbp.training.checkpointing import CheckpointingChoice, step_down_scale

    peaks = PeakModel(none=210.0, all=10.0, kept=30.0, layers=10, attention_flops=(1.0,) * 10, other_flops=1.0)
    available, scale = _cap(100.0), 1.0
    keep, attention = peaks.choose(available)
    seen = []
    while True:
        choice = CheckpointingChoice(True, keep_layers=keep, layers=10, attention_layers=attention)
        failed_peak = peaks.peak(keep, len(attention))
        new = step_down_scale(peaks, choice, available, scale)
        assert new >= 1.1 * scale and needs_checkpointing(failed_peak * new, available)  # it no longer fits
        scale = new
        seen.append(failed_peak)
        keep, attention = peaks.scaled(scale).choose(available)
        if (keep, attention) == (0, ()) or len(seen) > 20:
            break
    assert seen == sorted(seen, reverse=True) and len(set(seen)) == len(seen)  # strictly less each time
    assert (keep, attention) == (0, ())

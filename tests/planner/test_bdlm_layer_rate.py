"""The BDLM decoder-layer rate at a model's own shape and precision (planner/rates.py `measure_bdlm_layer`,
profile.py `bdlm_layer_tflops` / `bdlm_layer_shape`, cost.py, `plan --calibrate --model`): what calibration
counts and runs, that the cost model charges a BDLM's token-wise work at it only for the layer it measured,
and that profiles without it (those measured before it existed) predict exactly as before."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from importlib import resources
from pathlib import Path

import pytest
import torch

from specforge_csbp.bench.records import BenchRecord
from specforge_csbp.cli import plan as plan_cli
from specforge_csbp.cli.main import main
from specforge_csbp.planner import rates
from specforge_csbp.planner.cost import Layout, Options, predict
from specforge_csbp.planner.profile import BUILTIN_PROFILES, MachineProfile, load_profile
from specforge_csbp.planner.rates import BDLMLayerSpec
from specforge_csbp.planner.search import enumerate_layouts
from specforge_csbp.planner.shapes import load_shape
from specforge_csbp.planner.validate import record_predictor
from tests.support.planner_fixtures import DRAFTER, LM, PROFILE

FIELDS = ("bdlm_layer_tflops", "bdlm_layer_shape")
SFT_CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-1.7b.json"


def _with_layer(prof: MachineProfile, shape, rate: float, **spec) -> MachineProfile:
    key = BDLMLayerSpec.of(shape, **{"autocast": True, "checkpointing": True, **spec}).key
    return prof.model_copy(update={"bdlm_layer_tflops": rate, "bdlm_layer_shape": key})


def test_measurement_runs_the_bdlm_layer_and_counts_flops_as_the_cost_model(monkeypatch):
    """With the timed call taking "1 s", the rate is rows x 2 x layer params x (3 + checkpointing) / 1e12 -
    the count cost.py charges. The call is the real layer: fp32 weights get fp32 gradients, the projections
    run in bf16 under autocast (fp32 without), the layer runs twice (forward + recompute) when
    checkpointed."""
    built, seen = [], []
    qwen3_layer = rates.qwen3_layer

    def spy_layer(device, z):
        layer, rope = qwen3_layer(device, z)
        built.append(layer)
        calls = []
        # up_proj: its output is saved (SwiGLU product), so the recompute returns from it (the checkpoint
        # stops recomputing inside down_proj, the last op whose inputs backward needs)
        layer.mlp.up_proj.register_forward_hook(lambda m, i, o: calls.append(o.dtype))
        layer.calls = calls
        return layer, rope

    def one_second(fn, device, reps, warmup=2):
        fn()
        layer = built[-1]
        grads = [p.grad for p in layer.parameters() if p.dim() == 2]
        assert grads and all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)
        assert all(p.dtype == torch.float32 for p in layer.parameters())
        seen.append((fn.__name__, list(layer.calls)))
        return 1.0

    monkeypatch.setattr(rates, "qwen3_layer", spy_layer)
    monkeypatch.setattr(rates, "timed", one_second)
    shape = load_shape(LM)
    z = rates.BDLM_LAYER_SIZES["cpu"]
    for autocast in (True, False):
        for ckpt in (True, False):
            spec = BDLMLayerSpec.of(shape, autocast=autocast, checkpointing=ckpt)
            got = rates.measure_bdlm_layer(torch.device("cpu"), spec)
            linear = sum(m.weight.numel() for m in built[-1].modules() if isinstance(m, torch.nn.Linear))
            assert linear == shape.layer_params  # the measured layer has the weights the model counts
            flops = z["rows"] * shape.layer_gemm_flops_per_row() * (4 if ckpt else 3)
            assert got == {
                "bdlm_layer_tflops": pytest.approx(flops / 1e12, rel=1e-12),
                "bdlm_layer_shape": spec.key,
            }
            name, calls = seen[-1]
            assert name == "bdlm_layer_step"
            assert calls == [torch.bfloat16 if autocast else torch.float32] * (2 if ckpt else 1)


def test_layer_key_names_widths_precision_and_checkpointing():
    shape = load_shape(SFT_CONFIG)
    spec = BDLMLayerSpec.of(shape, autocast=True, checkpointing=True)
    assert spec.key == ("hidden 2048, intermediate 6144, heads 16/8 x 128, fp32 weights + bf16 autocast, "
                        "checkpointing on")  # fmt: skip
    keys = {BDLMLayerSpec.of(s, autocast=a, checkpointing=c).key
            for s in (shape, load_shape(LM)) for a in (True, False) for c in (True, False)}  # fmt: skip
    assert len(keys) == 8 and spec.passes == 4 and replace(spec, checkpointing=False).passes == 3
    with pytest.raises(ValueError, match="bdlm layer heads must be >= 1"):
        BDLMLayerSpec(64, 128, 0, 2, 16)


def test_rate_is_charged_only_for_the_layer_it_measured():
    """Matching key: the BDLM's token-wise (gemm) term is exactly rows x params x passes at the new rate,
    i.e. the old term x token rate / new rate, and nothing else moves. Any other widths, precision or
    checkpointing, and every drafter: the prediction is the one without the fields, field for field."""
    lm, drafter = load_shape(LM), load_shape(DRAFTER)
    base = PROFILE.model_copy(update={"layer_tflops": 0.4})
    fast = _with_layer(base, lm, 0.1)
    for layout in enumerate_layouts(4):
        for wl, ctx in (("sft", 8192), ("convert", 4096)):
            a, b = predict(lm, wl, ctx, layout, base, 80), predict(lm, wl, ctx, layout, fast, 80)
            if a.step_ms is None:
                assert asdict(a) == asdict(b)
                continue
            ga, gb = a.breakdown_ms.pop("gemm"), b.breakdown_ms.pop("gemm")
            assert gb == pytest.approx(ga * 0.4 / 0.1, rel=1e-12)
            assert a.breakdown_ms == b.breakdown_ms and a.peak_gib == b.peak_gib
            assert b.step_ms == pytest.approx(sum(b.breakdown_ms.values()) + gb, rel=1e-12)
            for opt in (Options(checkpointing=False), Options(autocast=False)):
                assert asdict(predict(lm, wl, ctx, layout, base, 80, opt)) == asdict(
                    predict(lm, wl, ctx, layout, fast, 80, opt))  # fmt: skip
            other = _with_layer(base, replace(lm, hidden=lm.hidden * 2), 0.1)  # another model's layer
            assert asdict(predict(lm, wl, ctx, layout, other, 80)) == asdict(
                predict(lm, wl, ctx, layout, base, 80)
            )
            off = _with_layer(base, lm, 0.1, checkpointing=False)  # measured without checkpointing
            opt = Options(checkpointing=False)
            g_off = predict(lm, wl, ctx, layout, off, 80, opt).breakdown_ms["gemm"]
            assert g_off == pytest.approx(
                predict(lm, wl, ctx, layout, base, 80, opt).breakdown_ms["gemm"] * 4
            )
        d = predict(drafter, "drafter", 16384, layout, base, 80, Options(anchors=64))
        assert asdict(d) == asdict(predict(drafter, "drafter", 16384, layout, fast, 80, Options(anchors=64)))
    assert fast.bdlm_layer_rate(BDLMLayerSpec.of(lm, autocast=True, checkpointing=True).key) == 0.1
    assert fast.bdlm_layer_rate("hidden 1, ...") == base.bdlm_layer_rate("x") == 0.4 == base.token_tflops
    assert PROFILE.bdlm_layer_rate("x") == PROFILE.gemm_tflops  # no layer_tflops either: the GEMM rate


def _raw_profile(name: str) -> dict:
    return json.loads(resources.files("specforge_csbp.planner").joinpath(f"profiles/{name}.json").read_text())


def test_profiles_without_the_rate_predict_as_before():
    """The built-in profiles measured before the field existed have neither field; each predicts exactly what
    it predicts with the rate measured for this very layer at its own token rate (the model those profiles
    always had), BDLM and drafter alike."""
    lm, drafter = load_shape(LM), load_shape(DRAFTER)
    without = [name for name in BUILTIN_PROFILES if not set(FIELDS) & set(_raw_profile(name))]
    assert {"h200-nominal", "h200x2-2026-11-29", "h200x2-2026-11-30"} <= set(without)
    for name in without:
        prof = load_profile(name)
        assert all(getattr(prof, f) is None for f in FIELDS)
        assert "BDLM layer" not in prof.summary()
        same = _with_layer(prof, lm, prof.token_tflops)
        assert "BDLM layer" in same.summary() and same.bdlm_layer_shape in same.summary()
        for layout in enumerate_layouts(4):
            for wl, ctx in (("sft", 8192), ("convert", 4096)):
                assert asdict(predict(lm, wl, ctx, layout, prof, 80)) == asdict(
                    predict(lm, wl, ctx, layout, same, 80)
                )
            d = predict(drafter, "drafter", 16384, layout, prof, 80, Options(anchors=64))
            assert asdict(d) == asdict(
                predict(drafter, "drafter", 16384, layout, same, 80, Options(anchors=64))
            )


def test_calibrated_builtin_profile_has_the_benchmark_sft_layer():
    """h200x2-2026-11-30-b measured Qwen3-1.7B's layer as benchmarks/bdlm_bench.py runs it (bf16 autocast,
    checkpointing), so SFT records of that model are predicted at that rate, below the 8B-width layer's."""
    prof = load_profile("h200x2-2026-11-30-b")
    key = BDLMLayerSpec.of(load_shape(SFT_CONFIG), autocast=True, checkpointing=True).key
    assert prof.bdlm_layer_shape == key and 0 < prof.bdlm_layer_tflops < prof.layer_tflops
    assert "BDLM layer" in prof.summary()


def test_record_predictor_uses_the_rate_for_records_of_that_layer():
    """An SFT record of the BDLM benchmark (bf16 autocast, checkpointing) is predicted at the rate measured
    for Qwen3-1.7B's layer as the benchmark runs it; a float32 or non-checkpointed record is not."""
    prof = load_profile("h200x2-2026-11-30")
    shape = load_shape(SFT_CONFIG)
    half = _with_layer(prof, shape, prof.layer_tflops / 2)
    base = dict(workload="sft", mode="csbp", world_size=2, context_len=32768, block_size=32, device="d",
                date="x", command="c", step_ms=1.0, peak_mem_gib=1.0, tokens_per_s=1.0,
                precision="bf16-autocast", activation_checkpointing=True)  # fmt: skip
    old, new = (record_predictor({"sft": str(SFT_CONFIG)}, p) for p in (prof, half))
    rec = BenchRecord(**base)
    gemm = predict(shape, "sft", 32768, Layout(1, 2, "csbp"), prof, 1e9, Options(block_size=32)).breakdown_ms[
        "gemm"
    ]
    assert new(rec).step_ms == pytest.approx(old(rec).step_ms + gemm, rel=1e-12)  # the gemm term doubled
    for extra in ({"precision": "float32"}, {"activation_checkpointing": False}):
        other = BenchRecord(**{**base, **extra})
        assert new(other) == old(other)


def test_half_given_rate_and_bad_values_are_rejected_naming_the_fields():
    for update in ({"bdlm_layer_tflops": 1.0}, {"bdlm_layer_shape": "hidden 64, ..."}):
        with pytest.raises(ValueError, match="bdlm_layer_tflops and bdlm_layer_shape"):
            MachineProfile(**{**PROFILE.model_dump(), **update})
    with pytest.raises(ValueError, match="bdlm_layer_tflops"):
        MachineProfile(**{**PROFILE.model_dump(), "bdlm_layer_tflops": 0.0, "bdlm_layer_shape": "x"})


def test_plan_calibrate_with_a_model_measures_its_layer(tmp_path, capsys, monkeypatch):
    """`plan --calibrate --model M` on 2 gloo ranks writes M's layer rate and key (both ranks measured it;
    the merge keeps the key) and plans with it; the layer `calibrate` is asked for follows the workload and
    --checkpointing (none for drafters or without a model)."""
    lm_json, dr_json = tmp_path / "lm.json", tmp_path / "drafter.json"
    lm_json.write_text(json.dumps(LM))
    dr_json.write_text(json.dumps(DRAFTER))
    out = tmp_path / "cpu2.json"
    assert main(["plan", "--calibrate", "--world-size", "2", "--model", str(lm_json), "--context", "2K",
                 "--gpus", "2", "--no-scaling", "--profile-out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    prof = load_profile(out)
    key = BDLMLayerSpec.of(load_shape(LM), autocast=True, checkpointing=True).key
    assert prof.bdlm_layer_shape == key and prof.bdlm_layer_tflops > 0 and prof.world_size == 2
    assert (
        f"decoder layers: {prof.bdlm_layer_tflops:.3g} TFLOP/s, measured at this model's layer ({key})"
        in printed
    )
    assert "recommended:" in printed
    # the same profile, a plan of another precision: charged at layer_tflops, and it says so
    assert main(["plan", "--model", str(lm_json), "--context", "2K", "--gpus", "2", "--no-scaling",
                 "--profile", str(out), "--checkpointing", "off"]) == 0  # fmt: skip
    assert "the profile's BDLM layer is" in capsys.readouterr().out

    asked = []

    def fake_calibrate(world_size, *, command="", bdlm_layer=None):
        asked.append(bdlm_layer)
        return PROFILE

    monkeypatch.setattr(plan_cli, "calibrate", fake_calibrate)
    for args in (["--model", str(lm_json), "--workload", "convert", "--checkpointing", "off"],
                 ["--model", str(dr_json)], []):  # fmt: skip
        assert main(["plan", "--calibrate", "--gpus", "2", "--no-scaling", *args]) == 0
    capsys.readouterr()
    assert asked == [BDLMLayerSpec.of(load_shape(LM), autocast=True, checkpointing=False), None, None]

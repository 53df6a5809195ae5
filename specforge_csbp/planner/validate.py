"""The planner's prediction for a measured benchmark record (the report puts them side by side).

A record of workload W is predicted when W has a model config: its mode and world size give the layout
(dp: W GPUs each with a whole sequence; cp/bp/csbp: one group of world_size ranks), its block size and
`anchors` (drafters) the options. The rest of the options is what the repository's benchmark of that
workload runs (`BENCHMARK_OPTIONS`), overridden by the record's own fields of the same name when present
(`state_bytes_per_param`, `ce_chunk`, `checkpointing` / `activation_checkpointing`, `precision`
"bf16-autocast" = fp32 weights under bf16 autocast; precision and checkpointing also decide whether the
profile's `bdlm_layer_tflops`, measured for one layer / precision / checkpointing, applies). A drafter
record with `dflash2: false` ran the config without DFlash2's convolutions and selector
(`ModelShape.without_dflash2`):

    benchmarks/drafter_bench.py  the drafter in bf16, forward + backward with no optimizer step: weights and
                                 gradients only, 2 + 2 bytes per trainable parameter; DFlashObjective's CE
                                 chunk of 2048 rows; no activation checkpointing
    benchmarks/bdlm_bench.py     fp32 weights, fp32 gradients and fused AdamW's two fp32 moments: 16 bytes;
                                 --ce-chunk-size 4096; activation checkpointing on; one fused AdamW step
                                 (costed when the profile measured `adamw_gbps`)

Peak memory: the benchmarks record `torch.cuda.max_memory_allocated` - bytes held by tensors. The plan's
peak adds the profile's `reserved_gib` (CUDA context, other processes, allocator slack) because that memory
is not available to tensors either; none of it is an allocation, so the comparison leaves it out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..bench.records import BenchRecord
from .cost import Layout, Options, predict
from .profile import MachineProfile
from .shapes import ModelShape, load_shape

__all__ = ["BENCHMARK_OPTIONS", "PredictedPoint", "record_options", "record_predictor"]

BENCHMARK_OPTIONS: dict[str, dict] = {
    "drafter": dict(state_bytes_per_param=4.0, ce_chunk=2048, checkpointing=False, optimizer_step=False),
    "sft": dict(state_bytes_per_param=16.0, ce_chunk=4096, checkpointing=True),
    "convert": dict(state_bytes_per_param=16.0, ce_chunk=4096, checkpointing=True),
}


@dataclass(frozen=True)
class PredictedPoint:
    step_ms: float
    tokens_per_s: float
    peak_gib: float  # tensor bytes (what max_memory_allocated measures): the plan's peak less `reserved`


def record_options(r: BenchRecord, kind: str) -> Options:
    """The options the record's benchmark ran with (see module docstring)."""
    extra = r.model_extra or {}
    opts = dict(BENCHMARK_OPTIONS[kind])
    ckpt = extra.get("checkpointing", extra.get("activation_checkpointing"))
    if ckpt is not None:
        opts["checkpointing"] = bool(ckpt)
    if extra.get("precision") is not None:
        opts["autocast"] = "autocast" in str(extra["precision"])
    for key, cast in (("state_bytes_per_param", float), ("ce_chunk", int), ("keep_logits_gib", float)):
        if extra.get(key) is not None:
            opts[key] = cast(extra[key])
    return Options(block_size=r.block_size, anchors=int(extra.get("anchors", 512)), **opts)


def record_predictor(
    models: dict[str, str], profile: MachineProfile, per_workload: dict[str, MachineProfile] | None = None
) -> Callable[[BenchRecord], PredictedPoint | None]:
    """models: record workload name -> config.json. Returns record -> prediction (None: not predictable).
    `per_workload`: a workload's own profile instead of `profile` (e.g. the calibration that measured its
    layer: the SFT layer rate and the drafter's rates come from different `plan --calibrate` runs)."""
    shapes: dict[str, ModelShape] = {w: load_shape(path) for w, path in sorted(models.items())}
    profiles = per_workload or {}

    def fn(r: BenchRecord) -> PredictedPoint | None:
        shape = shapes.get(r.workload)
        if shape is None or r.status != "ok" or r.mode not in ("reference", "dp", "cp", "bp", "csbp"):
            return None
        kind = "drafter" if shape.drafter else ("convert" if "convert" in r.workload else "sft")
        if shape.drafter and (r.model_extra or {}).get("dflash2") is False:
            shape = shape.without_dflash2()
        if r.mode in ("reference", "dp") or r.world_size == 1:
            layout = Layout(r.world_size, 1, "dp")
        else:
            layout = Layout(1, r.world_size, r.mode)
        machine = profiles.get(r.workload, profile)
        p = predict(shape, kind, r.context_len, layout, machine, float("inf"), record_options(r, kind))
        if p.step_ms is None:
            return None
        return PredictedPoint(p.step_ms, p.tokens_per_s, p.peak_gib - p.memory.reserved)

    return fn

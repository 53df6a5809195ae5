"""The planner's prediction for a measured benchmark record (the report puts them side by side).

A record of workload W is predicted when W has a model config: its mode and world size give the layout
(dp: W GPUs each with a whole sequence; cp/bp/csbp: one group of world_size ranks), its block size and
`anchors` (drafters) the options; `checkpointing` is read from the record when present.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..bench.records import BenchRecord
from .cost import Layout, Options, predict
from .profile import MachineProfile
from .shapes import ModelShape, load_shape

__all__ = ["PredictedPoint", "record_predictor"]


@dataclass(frozen=True)
class PredictedPoint:
    step_ms: float
    tokens_per_s: float
    peak_gib: float


def record_predictor(
    models: dict[str, str], profile: MachineProfile
) -> Callable[[BenchRecord], PredictedPoint | None]:
    """models: record workload name -> config.json. Returns record -> prediction (None: not predictable)."""
    shapes: dict[str, ModelShape] = {w: load_shape(path) for w, path in sorted(models.items())}

    def fn(r: BenchRecord) -> PredictedPoint | None:
        shape = shapes.get(r.workload)
        if shape is None or r.status != "ok" or r.mode not in ("reference", "dp", "cp", "bp", "csbp"):
            return None
        kind = "drafter" if shape.drafter else ("convert" if "convert" in r.workload else "sft")
        if r.mode in ("reference", "dp") or r.world_size == 1:
            layout = Layout(r.world_size, 1, "dp")
        else:
            layout = Layout(1, r.world_size, r.mode)
        extra = r.model_extra or {}
        ckpt = extra.get("checkpointing")
        opts = Options(block_size=r.block_size, anchors=int(extra.get("anchors", 512)),
                       checkpointing=None if ckpt is None else bool(ckpt))  # fmt: skip
        p = predict(shape, kind, r.context_len, layout, profile, float("inf"), opts)
        if p.step_ms is None:
            return None
        return PredictedPoint(p.step_ms, p.tokens_per_s, p.peak_gib)

    return fn

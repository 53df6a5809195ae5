"""Every layout of G GPUs, the recommendation, and the scaling table printed next to its calibration.

Layouts: for every CP degree c dividing G, DP degree G/c; c = 1 is plain data parallelism, c > 1 is one
of cp, bp, csbp. The recommendation is deterministic:

    fastest predicted tokens/s among layouts that fit; layouts within TIE (1%) of it are ties, broken by
    lower peak memory, then more data parallelism (smaller CP degree), then mode order (csbp, cp, bp, dp)
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Layout, Options, Prediction, predict
from .profile import MachineProfile
from .shapes import ModelShape

__all__ = ["MODE_PREFERENCE", "TIE", "Plan", "ScalingRow", "enumerate_layouts", "plan_layouts", "recommend",
           "scaling_table"]  # fmt: skip

TIE = 0.01
MODE_PREFERENCE = ("csbp", "cp", "bp", "dp")


def enumerate_layouts(gpus: int) -> list[Layout]:
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    out = []
    for cp in range(1, gpus + 1):
        if gpus % cp:
            continue
        for mode in ("dp",) if cp == 1 else ("csbp", "cp", "bp"):
            out.append(Layout(gpus // cp, cp, mode))
    return out


def recommend(preds: list[Prediction]) -> Prediction | None:
    ok = [p for p in preds if p.fits]
    if not ok:
        return None
    best = max(p.tokens_per_s for p in ok)
    ties = [p for p in ok if p.tokens_per_s >= best * (1 - TIE)]
    return min(ties, key=lambda p: (round(p.peak_gib, 6), p.layout.cp, MODE_PREFERENCE.index(p.layout.mode)))


@dataclass
class Plan:
    predictions: list[Prediction]
    recommended: Prediction | None


def plan_layouts(
    shape: ModelShape, workload: str, context: int, gpus: int, gpu_mem_gib: float, profile: MachineProfile,
    options: Options | None = None,
) -> Plan:  # fmt: skip
    options = options or Options()
    preds = [predict(shape, workload, context, lay, profile, gpu_mem_gib, options) for lay in enumerate_layouts(gpus)]
    return Plan(preds, recommend(preds))


@dataclass
class ScalingRow:
    gpus: int
    context: int
    csbp: Prediction | None  # best CSBP layout that fits
    other: Prediction | None  # best non-CSBP layout that fits
    single: Prediction | None  # one GPU (None when it does not fit)

    @property
    def speedup_over_other(self) -> float | None:
        if self.csbp is None or self.other is None:
            return None
        return self.csbp.tokens_per_s / self.other.tokens_per_s

    @property
    def speedup_over_single(self) -> float | None:
        if self.csbp is None or self.single is None:
            return None
        return self.csbp.tokens_per_s / self.single.tokens_per_s


def scaling_table(
    shape: ModelShape, workload: str, gpu_mem_gib: float, profile: MachineProfile, options: Options | None = None,
    gpus: tuple[int, ...] = (8, 16), contexts: tuple[int, ...] = (512 << 10, 1 << 20),
) -> list[ScalingRow]:  # fmt: skip
    options = options or Options()
    rows = []
    for ctx in contexts:
        single = predict(shape, workload, ctx, Layout(1, 1, "dp"), profile, gpu_mem_gib, options)
        for g in gpus:
            preds = plan_layouts(shape, workload, ctx, g, gpu_mem_gib, profile, options).predictions
            csbp = recommend([p for p in preds if p.layout.mode == "csbp"])
            other = recommend([p for p in preds if p.layout.mode != "csbp"])
            rows.append(ScalingRow(g, ctx, csbp, other, single if single.fits else None))
    return rows

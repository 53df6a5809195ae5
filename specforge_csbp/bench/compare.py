"""Side-by-side comparisons computed from records: which records were measured together, and CSBP's speedup.

Two records are "side by side" when they agree on every field of `match_key` (workload, context, world
size, block size, date, device, the launch - the `launch` a benchmark script records, else its command line;
one sweep for sweep points - and the configuration extras in
`CONFIG_EXTRAS` that they carry), i.e. they were measured in one run on one machine for one problem and
differ only in the parallel mode:

    group (drafter, L=512K, P=2, S=16, one date, one device)
        csbp   tokens/s 41,000  ─┐
        cp     tokens/s 20,500  ─┼─► speedup over cp = 2.00
        bp     oom              ─┘   speedup over bp = "bp oom"

Speedup = tokens_per_s(csbp) / tokens_per_s(other) when both carry tokens/s, else step_ms(other) /
step_ms(csbp). Repeated measurements of one mode in one group: the fastest ok record stands for the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .records import BenchRecord

__all__ = [
    "BASE_FIELDS",
    "CONFIG_EXTRAS",
    "MODE_ORDER",
    "Speedup",
    "best_other",
    "extra_fields",
    "group_side_by_side",
    "match_key",
    "mode_rank",
    "speedups",
    "throughput",
]

BASE_FIELDS = tuple(BenchRecord.model_fields)
# Extra fields that describe the problem (not a measurement): records differing in them are not compared.
CONFIG_EXTRAS = (
    "model", "batch", "anchors", "heads", "kv_heads", "head_dim", "layers", "hidden", "dtype",
    "clean_within_block", "vocab", "backend", "schedule", "regather", "pack_gqa", "reverse_queries", "gather_ahead",
)  # fmt: skip
MODE_ORDER = ("reference", "dp", "cp", "torch-cp", "bp", "specforge", "csbp")


def mode_rank(mode: str) -> tuple[int, str]:
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), mode)


def extra_fields(records: list[BenchRecord]) -> list[str]:
    """Names of the non-schema fields present on any record, sorted."""
    names: set[str] = set()
    for r in records:
        names.update((r.model_extra or {}).keys())
    return sorted(names)


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def match_key(r: BenchRecord) -> tuple:
    """Everything that must agree for two records to be compared (all but the mode and measurements)."""
    extra = r.model_extra or {}
    config = tuple((name, _hashable(extra[name])) for name in CONFIG_EXTRAS if name in extra)
    # Records pair only within one launch (one run of a benchmark script): the `launch` it records, else its
    # command line. Sweep points (`point`) ran in processes of their own by design and pair within their
    # sweep - same date and device (runner.py) - whatever each point's own launch says.
    launch = "sweep" if "point" in extra else extra.get("launch", r.command)
    return (r.workload, r.context_len, r.world_size, r.block_size, r.date, r.device, launch, config)


def throughput(r: BenchRecord) -> float | None:
    return r.tokens_per_s if r.status == "ok" else None


def group_side_by_side(records: list[BenchRecord]) -> dict[tuple, dict[str, list[BenchRecord]]]:
    """match_key -> mode -> records, keys sorted (deterministic iteration)."""
    groups: dict[tuple, dict[str, list[BenchRecord]]] = {}
    for r in records:
        groups.setdefault(match_key(r), {}).setdefault(r.mode, []).append(r)
    return {k: groups[k] for k in sorted(groups, key=repr)}


def _best(records: list[BenchRecord]) -> BenchRecord | None:
    """The fastest ok record (highest tokens/s, else lowest step_ms), None when none is ok."""
    ok = [r for r in records if r.status == "ok" and (r.tokens_per_s is not None or r.step_ms is not None)]
    if not ok:
        return None
    return min(ok, key=lambda r: (-(r.tokens_per_s or 0.0), r.step_ms if r.step_ms is not None else float("inf")))


@dataclass(frozen=True)
class Speedup:
    """CSBP against one other mode in one side-by-side group."""

    key: tuple
    csbp: BenchRecord
    other_mode: str
    other: BenchRecord | None  # the fastest ok record of the other mode; None when it has none
    other_status: str  # "ok" | "oom" | "error" (the other mode's status when it has no ok record)
    value: float | None  # csbp over other; None when not computable

    @property
    def text(self) -> str:
        if self.value is not None:
            return f"{self.value:.2f}x"
        if self.other_status != "ok":
            return f"{self.other_mode} {self.other_status}"
        return "n/a"


def _ratio(csbp: BenchRecord, other: BenchRecord) -> float | None:
    if csbp.tokens_per_s and other.tokens_per_s:
        return csbp.tokens_per_s / other.tokens_per_s
    if csbp.step_ms and other.step_ms:
        return other.step_ms / csbp.step_ms
    return None


def speedups(records: list[BenchRecord]) -> list[Speedup]:
    """CSBP's speedup over every other mode measured side by side with it (groups with an ok CSBP record)."""
    out = []
    for key, by_mode in group_side_by_side(records).items():
        csbp = _best(by_mode.get("csbp", []))
        if csbp is None:
            continue
        for mode in sorted(by_mode, key=mode_rank):
            if mode == "csbp":
                continue
            other = _best(by_mode[mode])
            if other is None:
                statuses = sorted({r.status for r in by_mode[mode]})
                status = "oom" if "oom" in statuses else statuses[0]
                out.append(Speedup(key, csbp, mode, None, status, None))
            else:
                out.append(Speedup(key, csbp, mode, other, "ok", _ratio(csbp, other)))
    return out


def best_other(group: dict[str, list[BenchRecord]]) -> tuple[str, BenchRecord] | None:
    """The fastest non-CSBP mode of a group (by tokens/s), None if no other mode ran ok."""
    cands = [(m, _best(rs)) for m, rs in sorted(group.items(), key=lambda kv: mode_rank(kv[0])) if m != "csbp"]
    cands = [(m, r) for m, r in cands if r is not None]
    if not cands:
        return None
    return min(cands, key=lambda mr: (-(mr[1].tokens_per_s or 0.0), mr[1].step_ms or float("inf"), mode_rank(mr[0])))

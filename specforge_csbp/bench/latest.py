"""The newest measurement of each configuration, and the headline row of each problem, computed from records.

The record files hold every run ever fetched: a point measured on an older day, or by an earlier launch
of the same configuration, is superseded by the newer one and must not stand in the headline or the plots.

    problem   = workload, world size, context, block size, device, PROBLEM_EXTRAS (model, anchors, ...)
    config    = problem + mode + SWITCH_EXTRAS (schedule, gather_ahead, ...)

    records of one problem ──► keep its newest day (newer code measured it; older days are superseded)
                          ──► per config, keep only its newest launch (repeats within that launch stay)
                          ──► headline row: the fastest CSBP record, the fastest other mode, SpecForge

"Newest" is the record's recency: (date, carries a library digest `code`, position in load order).
Records written before provenance existed carry no `code`; on one day they come before the ones that do,
and record files load in name order (`<bench>_<device>_<date>[_b, _c, ...].jsonl`), i.e. in run order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .compare import CONFIG_EXTRAS, _best, _hashable, best_other, match_key, mode_rank
from .records import BenchRecord

__all__ = [
    "PROBLEM_EXTRAS",
    "RETIRED_SWITCHES",
    "SWITCH_EXTRAS",
    "HeadlineRow",
    "config_key",
    "headline_rows",
    "latest_records",
    "problem_fields",
    "problem_key",
]

# Implementation switches: records differing only in them measured one problem in different ways.
SWITCH_EXTRAS = ("backend", "schedule", "regather", "pack_gqa", "reverse_queries", "gather_ahead")
# Switch settings the library no longer offers (measured to gain nothing): their records stay in the appendix,
# but a user cannot rerun them, so they stand in no headline row or plot.
RETIRED_SWITCHES = (("reverse_queries", True),)
# Everything else in CONFIG_EXTRAS describes the problem itself (model shape, anchors, dtype, ...).
PROBLEM_EXTRAS = tuple(name for name in CONFIG_EXTRAS if name not in SWITCH_EXTRAS)


def _extras(r: BenchRecord, names: tuple[str, ...]) -> tuple:
    extra = r.model_extra or {}
    return tuple((name, _hashable(extra[name])) for name in names if name in extra)


def problem_key(r: BenchRecord) -> tuple:
    """What a user asks about: this workload at this context on this many GPUs of this device."""
    return (r.workload, r.world_size, r.context_len, r.block_size, r.device, _extras(r, PROBLEM_EXTRAS))


def config_key(r: BenchRecord) -> tuple:
    """One way of running one problem: the problem, the mode and the implementation switches."""
    return (problem_key(r), r.mode, _extras(r, SWITCH_EXTRAS))


def latest_records(records: list[BenchRecord]) -> list[BenchRecord]:
    """The records that are the newest measurement of their configuration, in the given order (records
    with a RETIRED_SWITCHES setting left out).

    `records` must be in load order (load_records: files by name, lines in order), which breaks ties
    between records of one day that carry no library digest."""
    records = [r for r in records if not any((r.model_extra or {}).get(k) == v for k, v in RETIRED_SWITCHES)]
    recency = {id(r): (r.date, (r.model_extra or {}).get("code") is not None, i)
               for i, r in enumerate(records)}  # fmt: skip
    newest_day: dict[tuple, str] = {}
    for r in records:
        p = problem_key(r)
        newest_day[p] = max(newest_day.get(p, r.date), r.date)
    current = [r for r in records if r.date == newest_day[problem_key(r)]]
    newest_launch: dict[tuple, BenchRecord] = {}
    for r in current:
        c = config_key(r)
        if c not in newest_launch or recency[id(r)] > recency[id(newest_launch[c])]:
            newest_launch[c] = r
    return [r for r in current if match_key(r) == match_key(newest_launch[config_key(r)])]


@dataclass(frozen=True)
class HeadlineRow:
    """One problem's newest numbers: CSBP against the fastest other mode and against stock SpecForge.

    The two sides may come from different launches of the problem's newest day (each mode starts from a
    fresh compile state, bench/isolation.py); the appendix keeps the strictly side-by-side ratios."""

    problem: tuple
    csbp: BenchRecord  # the fastest ok CSBP record (or CSBP's failed record when none is ok)
    other_mode: str | None  # the fastest other mode, or the one that failed when none ran ok
    other: BenchRecord | None  # its fastest ok record; None when it has none
    other_status: str  # "ok" | "oom" | "error"
    specforge: BenchRecord | None  # stock SpecForge's fastest ok record, when measured
    specforge_status: str | None  # None: SpecForge not measured for this problem

    @staticmethod
    def ratio(csbp: BenchRecord, other: BenchRecord | None) -> float | None:
        if other is None or csbp.status != "ok" or not csbp.tokens_per_s or not other.tokens_per_s:
            return None
        return csbp.tokens_per_s / other.tokens_per_s

    @property
    def over_other(self) -> float | None:
        return self.ratio(self.csbp, self.other)

    @property
    def over_specforge(self) -> float | None:
        return self.ratio(self.csbp, self.specforge)


def _failed_status(recs: list[BenchRecord]) -> str:
    statuses = {r.status for r in recs}
    return "oom" if "oom" in statuses else sorted(statuses)[0]


def headline_rows(latest: list[BenchRecord]) -> list[HeadlineRow]:
    """One row per problem that has a CSBP record among `latest` (the output of latest_records)."""
    by_problem: dict[tuple, dict[str, list[BenchRecord]]] = {}
    for r in latest:
        by_problem.setdefault(problem_key(r), {}).setdefault(r.mode, []).append(r)
    rows = []
    for problem in sorted(by_problem, key=repr):
        by_mode = by_problem[problem]
        if "csbp" not in by_mode:
            continue
        csbp = _best(by_mode["csbp"]) or by_mode["csbp"][0]
        others = {m: rs for m, rs in by_mode.items() if m != "csbp"}
        best = best_other(by_mode)
        if best is not None:
            other_mode, other, other_status = best[0], best[1], "ok"
        elif others:
            other_mode = min(others, key=mode_rank)
            other, other_status = None, _failed_status(others[other_mode])
        else:
            other_mode, other, other_status = None, None, "ok"
        sf = by_mode.get("specforge")
        sf_best = _best(sf) if sf else None
        sf_status = None if not sf else ("ok" if sf_best is not None else _failed_status(sf))
        rows.append(HeadlineRow(problem, csbp, other_mode, other, other_status, sf_best, sf_status))
    return rows


def problem_fields(r: BenchRecord) -> dict[str, Any]:
    """The PROBLEM_EXTRAS a record carries, by name (for table columns and plot labels)."""
    extra = r.model_extra or {}
    return {name: extra[name] for name in PROBLEM_EXTRAS if name in extra}

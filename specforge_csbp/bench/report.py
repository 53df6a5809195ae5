"""Render records into markdown (a headline page and a records appendix, with plots) and a CSV.

Both pages are pure functions of the records (no clock): rendering twice gives the same bytes.

    docs/benchmarks.md (render_summary): the newest measurements only (bench/latest.py)
      | workload | GPUs | context | ... | CSBP tokens/s | best other mode | CSBP / best other | ... | run |
      ## <workload>: ![plots](img/<workload>_*.png)
      runs: [n] `command`
    docs/benchmarks_records.md (render_markdown): every record
    ## <workload>                       one section per workload, sorted by name
      | mode | world_size | context_len | ... | status | extras... | run |     all records
      | context_len | world_size | block_size | ... | speedup over cp | ... |   CSBP vs each mode
      runs: [n] device, date: `command`                                        every distinct command
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..outputs import write_text_atomic
from .compare import CONFIG_EXTRAS, extra_fields, group_side_by_side, mode_rank, speedups
from .latest import HeadlineRow, headline_rows, latest_records, problem_fields
from .plots import context_label, plot_workload
from .records import BenchRecord, load_records

__all__ = [
    "CSV_FIELDS",
    "format_value",
    "fresh_compile",
    "record_sort_key",
    "render_markdown",
    "render_summary",
    "steady",
    "write_csv",
    "write_report",
]

# Table columns (field, header); attention-only columns appear when a workload's records carry them.
CORE_COLUMNS = (
    ("mode", "mode"), ("world_size", "world_size"), ("context_len", "context_len"),
    ("block_size", "block_size"), ("step_ms", "step_ms"), ("tokens_per_s", "tokens/s"),
    ("peak_mem_gib", "peak GiB"), ("status", "status"),
)  # fmt: skip
OPTIONAL_COLUMNS = (("useful_tflops_per_gpu", "useful TFLOP/s/GPU"), ("exposed_comm_ms", "exposed comm ms"))
RUN_FIELDS = ("device", "date", "command")
# Bookkeeping extras of the sweep runner: kept in the records and the CSV, left out of the tables.
HIDDEN_EXTRAS = ("point", "wall_s", "exit_code", "code")  # code: in the CSV (bench/provenance.py)
CSV_FIELDS = tuple(BenchRecord.model_fields)
PLANNER_TARGET = 0.15  # the planner's target error on measured points (issue 6)
MAX_TIMED_COMPILES = 2  # a record whose timed steps compiled this many graphs is no steady-state time (`steady`)
# record -> object with step_ms, tokens_per_s, peak_gib (or None): see planner/validate.py
Predictor = Callable[[BenchRecord], Any]


def format_value(value: Any) -> str:
    """Compact, deterministic cell text."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        a = abs(value)
        if a >= 1000:
            return f"{value:,.0f}"
        if a >= 10:
            return f"{value:.1f}"
        if a >= 0.01 or a == 0:
            return f"{value:.3g}" if a < 1 else f"{value:.2f}"
        return f"{value:.2e}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value).replace("|", "\\|").replace("\n", " ")


def record_sort_key(r: BenchRecord) -> tuple:
    return (r.workload, r.device, r.date, r.context_len, r.world_size, r.block_size, mode_rank(r.mode),
            r.status, r.model_dump_json())  # fmt: skip


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _pct(pred: float | None, meas: float | None) -> str:
    if pred is None or not meas:
        return "—"
    return f"{100 * (pred / meas - 1):+.1f}%"


def _image_links(workload: str, images: dict[str, Path], doc_dir: Path, kinds: tuple[str, ...],
                 speedup_over: str) -> list[str]:  # fmt: skip
    """Markdown image lines for a workload's plots (paths relative to the page), in the order of `kinds`."""
    captions = {"tokens_per_s": "tokens/s vs context", "speedup": f"CSBP speedup over the {speedup_over}",
                "peak_mem": "peak memory vs context"}  # fmt: skip
    return [f"![{workload}: {captions[kind]}]({Path(os.path.relpath(images[kind], doc_dir)).as_posix()})"
            for kind in kinds if kind in images]  # fmt: skip


def _records_table(
    recs: list[BenchRecord], runs: dict[tuple[str, str, str], int], predictor: Predictor | None,
    same_code: Callable[[BenchRecord], bool] | None,
) -> list[str]:
    """The "All records" table: one row per record (+ the planner's prediction and its error, if predicted)."""
    lines: list[str] = []
    optional = [(f, h) for f, h in OPTIONAL_COLUMNS if any(getattr(r, f) is not None for r in recs)]
    extras = [name for name in extra_fields(recs) if name not in HIDDEN_EXTRAS]
    preds = [predictor(r) if predictor else None for r in recs]
    with_pred = any(p is not None for p in preds)
    header = [h for _, h in CORE_COLUMNS] + [h for _, h in optional] + extras
    if with_pred:
        header += ["planned tokens/s", "error", "planned GiB", "error"]
    header.append("run")
    rows = []
    for r, p in zip(recs, preds):
        extra = r.model_extra or {}
        row = [format_value(getattr(r, f)) for f, _ in CORE_COLUMNS + tuple(optional)]
        row += [format_value(extra.get(name)) for name in extras]
        if with_pred:
            row += ["—", "—", "—", "—"] if p is None else [
                format_value(p.tokens_per_s), _pct(p.tokens_per_s, r.tokens_per_s),
                format_value(p.peak_gib), _pct(p.peak_gib, r.peak_mem_gib),
            ]  # fmt: skip
        row.append(f"[{runs[(r.device, r.date, r.command)]}]")
        rows.append(row)
    lines += ["### All records", ""] + _table(header, rows) + [""]
    if with_pred:
        lines += _prediction_summary(recs, preds, same_code) + [""]
    return lines


def _speedup_table(recs: list[BenchRecord], runs: dict[tuple[str, str, str], int]) -> list[str]:
    """The side-by-side speedup table: one row per group of records measured together (compare.py)."""
    spd = speedups(recs)
    if not spd:
        return []
    lines: list[str] = []
    others = sorted({s.other_mode for s in spd}, key=mode_rank)
    by_key: dict[tuple, dict[str, str]] = {}
    base: dict[tuple, BenchRecord] = {}
    for s in spd:
        by_key.setdefault(s.key, {})[s.other_mode] = s.text
        base[s.key] = s.csbp
    # the configuration fields that tell this workload's groups apart (e.g. anchors, gather_ahead), and
    # the run (numbered below) each group's CSBP record came from
    varying = [name for name in CONFIG_EXTRAS
               if len({format_value((c.model_extra or {}).get(name)) for c in base.values()}) > 1]  # fmt: skip
    header = ["context_len", "world_size", "block_size", "device", "date", *varying, "CSBP tokens/s"]
    header += [f"CSBP / {m}" for m in others] + ["run", "fresh compile"]
    rows = []
    for key, by_mode in group_side_by_side(recs).items():
        if key not in by_key:
            continue
        c = base[key]
        row = [str(c.context_len), str(c.world_size), str(c.block_size), format_value(c.device),
               format_value(c.date)]  # fmt: skip
        row += [format_value((c.model_extra or {}).get(name)) for name in varying]
        row.append(format_value(c.tokens_per_s))
        row += [by_key[key].get(m, "—") for m in others]
        row.append(f"[{runs[(c.device, c.date, c.command)]}]")
        row.append("yes" if all(fresh_compile(r) for rs in by_mode.values() for r in rs) else "no")
        rows.append(row)
    rows.sort(key=lambda row: (row[3], row[4], int(row[1]), int(row[2]), int(row[0])))
    lines += [
        "### CSBP speedup, measured side by side",
        "",
        "Computed from the records above: same workload, context, world size, block size, date, device and launch "
        "(tokens/s of CSBP over tokens/s of the other mode; the fastest ok record when a mode was repeated; "
        "`<mode> oom` where the other mode did not fit). `fresh compile`: every mode started from a fresh "
        "compile state (its own process, or `bench/isolation.py`'s reset). Where it says no, a mode that ran "
        "after another in the same process inherited that mode's compiled FlexAttention kernels and may have "
        "run slower for it (measured up to 13% per step, docs/performance.md): treat that ratio as an upper "
        "bound on CSBP's lead. Configuration columns (anchors, schedule, gather_ahead, ...) appear where the groups "
        "differ in them; `—`: the records do not say (a switch added later: off in them). `run`: the command, "
        "numbered under Runs.",
        "",
    ]
    lines += _table(header, rows) + [""]
    return lines


def _workload_section(
    recs: list[BenchRecord],
    plots: dict[str, Path],
    doc_dir: Path,
    predictor: Predictor | None = None,
    same_code: Callable[[BenchRecord], bool] | None = None,
) -> list[str]:
    workload = recs[0].workload
    lines = [f"## {workload}", ""]
    ok = sum(r.status == "ok" for r in recs)
    oom = sum(r.status == "oom" for r in recs)
    err = sum(r.status == "error" for r in recs)
    lines += [f"{len(recs)} records: {ok} ok, {oom} oom, {err} error.", ""]
    lines += _image_links(workload, plots, doc_dir, ("tokens_per_s", "speedup", "peak_mem"), "best non-CSBP mode")
    if plots:
        lines.append("")

    # Runs: one entry per distinct (device, date, command), numbered in order of first appearance.
    runs: dict[tuple[str, str, str], int] = {}
    for r in recs:
        runs.setdefault((r.device, r.date, r.command), len(runs) + 1)

    lines += _records_table(recs, runs, predictor, same_code)
    lines += _speedup_table(recs, runs)

    lines += ["### Runs", ""]
    for (device, date, command), n in runs.items():
        lines.append(f"{n}. {device}, {date}: `{command}`")
    lines.append("")
    return lines


def fresh_compile(r: BenchRecord) -> bool:
    """Did this record's mode start from a fresh compile state: the benchmark reset it (`fresh_compile`),
    or the sweep ran the point in its own process (`point`)?"""
    extra = r.model_extra or {}
    return bool(extra.get("fresh_compile")) or "point" in extra


def _prediction_summary(
    recs: list[BenchRecord], preds: list, same_code: Callable[[BenchRecord], bool] | None = None
) -> list[str]:
    """Error of the planner on the records; with `same_code` also on the records that ran the code the
    profile calibrated (cli/report.py: same library digest, else measured on or after the calibration date)
    - older records ran older code, whose speed the profile does not describe."""

    def stat(pairs: list) -> tuple[str, str]:
        tps = [abs(p.tokens_per_s / r.tokens_per_s - 1) for r, p in pairs if p and r.tokens_per_s]
        mem = [abs(p.peak_gib / r.peak_mem_gib - 1) for r, p in pairs if p and r.peak_mem_gib]

        def one(errs: list[float]) -> str:
            if not errs:
                return "no points"
            within = sum(e <= PLANNER_TARGET for e in errs)
            return (f"max {100 * max(errs):.1f}%, mean {100 * sum(errs) / len(errs):.1f}%, "
                    f"{within}/{len(errs)} within {100 * PLANNER_TARGET:.0f}%")  # fmt: skip

        return one(tps), one(mem)

    pairs = list(zip(recs, preds))
    compiling = [r for r, p in pairs if p is not None and not steady(r)]
    pairs = [(r, p) for r, p in pairs if steady(r)]
    lines = []
    if same_code is not None:
        tps, mem = stat([(r, p) for r, p in pairs if same_code(r)])
        lines.append(f"Planner (`specforge-csbp plan`) against the measurements of the code its profile calibrated "
                     f"(same library digest `code`; for a profile without one, measured on or after its calibration "
                     f"date): tokens/s error {tps}; peak memory error {mem}.")  # fmt: skip
    tps, mem = stat(pairs)
    lines.append(f"Planner against {'all ' if same_code else ''}these measurements: tokens/s error {tps}; "
                 f"peak memory error {mem}.")  # fmt: skip
    if compiling:
        lines.append(f"Left out of both: {len(compiling)} record(s) whose timed steps compiled "
                     f"{MAX_TIMED_COMPILES} or more graphs (the median step was a compiling one; the planner "
                     "predicts the steady state): " + ", ".join(
                         f"{r.mode} L={r.context_len} ({r.date})" for r in compiling) + ".")  # fmt: skip
    return lines


def steady(r: BenchRecord) -> bool:
    """False for a record whose timed steps compiled MAX_TIMED_COMPILES graphs or more (`timed_steps_health`,
    benchmarks/drafter_bench.py): of its 3 timed steps the median one compiled, so its time is not the
    step's. bench/isolation.warm_up now warms up until steady; older records may still show it."""
    health = (r.model_extra or {}).get("timed_steps_health") or {}
    return float(health.get("compiled_graphs", 0)) < MAX_TIMED_COMPILES


def render_markdown(
    records: list[BenchRecord],
    *,
    doc_path: str | Path,
    img_dir: str | Path | None = None,
    title: str = "Benchmarks",
    source: str = "benchmarks/results/",
    generator: str = "specforge-csbp report",
    predictor: Predictor | None = None,
    predictor_note: str = "",
    same_code: Callable[[BenchRecord], bool] | None = None,
    plots: bool = True,
    headline_doc: str | Path | None = None,
) -> str:
    """Every record as markdown; with `plots`, writes the PNGs into img_dir (default: <doc dir>/img). With a
    `predictor` (planner/validate.py), ok records get the planner's prediction and its error beside them.
    `headline_doc`: the headline page (render_summary) this page is the appendix of, linked at the top."""
    doc_dir = Path(doc_path).parent
    img_dir = Path(img_dir) if img_dir is not None else doc_dir / "img"
    records = sorted(records, key=record_sort_key)
    lines = [
        f"# {title}",
        "",
        f"Generated by `{generator}` from {len(records)} records in `{source}` (schema: "
        "`specforge_csbp/bench/records.py`). Do not edit by hand: every table, speedup and plot is "
        "recomputed from the records.",
        "",
    ]
    if headline_doc is not None:
        rel = Path(os.path.relpath(headline_doc, doc_dir)).as_posix()
        lines += [f"Every record, superseded ones included; the newest measurements and their plots: "
                  f"[{rel}]({rel}).", ""]  # fmt: skip
    if predictor is not None and predictor_note:
        lines += [predictor_note, ""]
    workloads = sorted({r.workload for r in records})
    if not workloads:
        lines += ["No records yet.", ""]
    for w in workloads:
        recs = [r for r in records if r.workload == w]
        images = plot_workload(recs, w, img_dir) if plots else {}
        lines += _workload_section(recs, images, doc_dir, predictor, same_code)
    return "\n".join(lines).rstrip("\n") + "\n"


def _ratio_text(value: float | None, mode: str | None, status: str | None) -> str:
    if value is not None:
        return f"{value:.2f}x"
    if mode is not None and status not in (None, "ok"):
        return f"{mode} {status}"
    return "—"


def render_summary(
    records: list[BenchRecord],
    *,
    doc_path: str | Path,
    records_doc: str | Path,
    img_dir: str | Path | None = None,
    title: str = "Benchmarks",
    source: str = "benchmarks/results/",
    generator: str = "specforge-csbp report",
    rerun: Callable[[BenchRecord], str | None] | None = None,
) -> str:
    """The headline page: per problem, CSBP's newest numbers against the fastest other mode and SpecForge,
    then plots of the newest records only; writes the PNGs into img_dir (default: <doc dir>/img).
    `records` in load order (latest_records breaks ties of one day by it); `records_doc`: the appendix;
    `rerun`: a CSBP record -> the named scenario that remeasures it (bench/scenarios.py), as a column."""
    doc_dir = Path(doc_path).parent
    img_dir = Path(img_dir) if img_dir is not None else doc_dir / "img"
    latest = latest_records(records)
    rows = headline_rows(latest)
    appendix = Path(os.path.relpath(records_doc, doc_dir)).as_posix()
    lines = [
        f"# {title}",
        "",
        f"Generated by `{generator}` from the records in `{source}` (schema: `specforge_csbp/bench/records.py`). "
        "Do not edit by hand. This page shows the newest measurement of each problem only: "
        f"{len(latest)} of {len(records)} records; the others were measured on an older day (older code) or by an "
        "earlier launch of the same configuration (`specforge_csbp/bench/latest.py`). Every record, the planner's "
        f"predictions and the strictly side-by-side speedups: [{appendix}]({appendix}).",
        "",
    ]
    if not rows:
        lines += ["No records yet." if not records else "No CSBP records yet.", ""]
    else:
        lines += _headline_table(rows, rerun)
    latest_sorted = sorted(latest, key=record_sort_key)
    for w in sorted({r.workload for r in latest}):
        images = plot_workload(latest_sorted, w, img_dir, headline=rows)
        if not images:
            continue
        lines += [f"## {w}", ""]
        lines += _image_links(w, images, doc_dir, ("speedup", "tokens_per_s", "peak_mem"), "best other mode")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _headline_table(rows: list[HeadlineRow], rerun: Callable[[BenchRecord], str | None] | None) -> list[str]:
    runs: dict[str, int] = {}
    # problem fields that tell one workload's rows apart (anchors, ...), as columns
    varying = sorted({name for h in rows for name in problem_fields(h.csbp)
                      if len({format_value(problem_fields(g.csbp).get(name)) for g in rows
                              if g.csbp.workload == h.csbp.workload}) > 1})  # fmt: skip
    header = ["workload", "GPUs", "context", *varying, "date", "CSBP tokens/s", "CSBP peak GiB", "best other mode",
              "its tokens/s", "its peak GiB", "CSBP / best other", "CSBP / SpecForge", "run"]  # fmt: skip
    if rerun is not None:
        header.append("rerun")
    def order(h: HeadlineRow) -> tuple:
        fields = problem_fields(h.csbp)
        return (h.csbp.workload, h.csbp.world_size, *[format_value(fields.get(n)) for n in varying],
                h.csbp.context_len, h.csbp.block_size, h.csbp.device)  # fmt: skip

    body = []
    runs: dict[str, int] = {}
    for h in sorted(rows, key=order):
        c = h.csbp
        runs.setdefault(c.command, len(runs) + 1)
        fields = problem_fields(c)
        csbp_tps = format_value(c.tokens_per_s) if c.status == "ok" else c.status
        other = h.other
        body.append([
            c.workload, str(c.world_size), context_label(c.context_len),
            *[format_value(fields.get(name)) for name in varying], c.date, csbp_tps, format_value(c.peak_mem_gib),
            h.other_mode or "—",
            format_value(other.tokens_per_s) if other else h.other_status if h.other_mode else "—",
            format_value(other.peak_mem_gib) if other else "—",
            _ratio_text(h.over_other, h.other_mode, h.other_status),
            _ratio_text(h.over_specforge, "specforge", h.specforge_status),
            f"[{runs[c.command]}]",
        ])  # fmt: skip
        if rerun is not None:
            name = rerun(c)
            body[-1].append(f"`{name}`" if name else "—")
    lines = [
        "## Headline",
        "",
        "Per problem (workload, GPUs, context, and the problem fields shown), the fastest CSBP record of the newest "
        "measurements against the fastest other parallel mode (`dp`, `cp`, `bp`, `torch-cp`, stock SpecForge) and "
        "against stock SpecForge alone (one GPU; `—`: not measured for that problem). tokens/s: supervised tokens "
        "per second of the whole job; peak GiB: peak memory per GPU, the maximum over ranks; `<mode> oom`: that "
        "mode did not fit. Both sides ran on the problem's newest day, each mode from a fresh compile state, "
        "not always in one launch. `run`: the CSBP record's command, listed below. `rerun`: the named scenario "
        "that measures the row again with today's code and defaults (`python benchmarks/run_scenario.py NAME "
        "--contexts L`, benchmarks/README.md).",
        "",
    ]
    lines += _table(header, body) + [""]
    lines += ["Runs:", ""]
    for command, n in runs.items():
        lines.append(f"{n}. `{command}`")
    lines.append("")
    return lines


def _write_atomic(path: Path, text: str) -> None:
    """A reader never sees half a page; a failed write (disk full) leaves the old page."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


def write_csv(records: list[BenchRecord], path: str | Path) -> None:
    """One row per record: the schema's fields, then every extra field (JSON for lists/dicts)."""
    records = sorted(records, key=record_sort_key)
    extras = extra_fields(records)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(list(CSV_FIELDS) + extras)
    for r in records:
        data = r.model_dump()
        row = [data.get(f) for f in CSV_FIELDS] + [data.get(f) for f in extras]
        writer.writerow(["" if v is None else json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
                         for v in row])  # fmt: skip
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(buf.getvalue())


def write_report(
    results: str | Path | list[str | Path],
    doc_path: str | Path,
    *,
    img_dir: str | Path | None = None,
    csv_path: str | Path | None = None,
    title: str = "Benchmarks",
    generator: str = "specforge-csbp report",
    predictor: Predictor | None = None,
    predictor_note: str = "",
    same_code: Callable[[BenchRecord], bool] | None = None,
    code_by_file: dict[str, str] | None = None,
    records_path: str | Path | None = None,
    rerun: Callable[[BenchRecord], str | None] | None = None,
    allow_empty: bool = True,
) -> list[BenchRecord]:
    """Load every record under `results`, write the headline page to `doc_path`, every record to
    `records_path` (default: `<doc stem>_records.md` beside it), optionally the CSV; returns the records.
    `code_by_file`: library digests of record files written before records carried one (load_records);
    `rerun`: see render_summary; `allow_empty=False` refuses results that hold no record (nothing written)."""
    paths = results if isinstance(results, list) else [results]
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:  # a mistyped path must not replace a report with "No records yet"
        raise ValueError(f"--results: {', '.join(missing)} does not exist; {doc_path} was left unchanged")
    records = load_records(paths, code_by_file=code_by_file)
    if not records and not allow_empty:  # an empty page would replace the report that was there
        raise ValueError(
            f"--results: {', '.join(map(str, paths))} holds no benchmark records (*.json, *.jsonl); {doc_path} "
            "was left unchanged"
        )
    source = ", ".join(Path(p).as_posix().rstrip("/") + ("/" if Path(p).is_dir() else "") for p in paths)
    doc_path = Path(doc_path)
    records_path = Path(records_path) if records_path is not None else doc_path.with_name(
        f"{doc_path.stem}_records{doc_path.suffix}")  # fmt: skip
    appendix = render_markdown(records, doc_path=records_path, title=f"{title}: every record", source=source,
                               generator=generator, predictor=predictor, predictor_note=predictor_note,
                               same_code=same_code, plots=False, headline_doc=doc_path)  # fmt: skip
    summary = render_summary(records, doc_path=doc_path, records_doc=records_path, img_dir=img_dir, title=title,
                             source=source, generator=generator, rerun=rerun)  # fmt: skip
    for path, text in ((doc_path, summary), (records_path, appendix)):  # the page asked for first: a failed
        _write_atomic(path, text)  # write (disk full) leaves both pages as they were
    if csv_path is not None:
        write_csv(records, csv_path)
    return records

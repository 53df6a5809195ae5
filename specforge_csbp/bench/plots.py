"""PNG plots of one workload's records (matplotlib, Agg, no timestamps: same records -> same bytes).

    <slug>_tokens_per_s.png   tokens/s vs context, one line per mode (and degree / block size if they vary)
    <slug>_speedup.png        CSBP tokens/s over the best non-CSBP mode, vs context: the headline rows
                              (bench/latest.py) when given, else the side-by-side groups (compare.py)
    <slug>_peak_mem.png       peak memory (max over ranks) vs context, one line per mode

Only ok records are drawn; a point that has several ok records (repeats) shows the fastest / smallest.
Lines are told apart by mode and by whatever varies among the records drawn (GPUs, block size, the problem
fields of bench/latest.py such as anchors, device, date). docs/benchmarks.md draws the newest records only.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..outputs import pyplot, save_figure_atomic
from .compare import best_other, group_side_by_side, mode_rank
from .latest import HeadlineRow, problem_fields
from .records import BenchRecord

__all__ = ["context_label", "plot_workload", "slug"]

PLOT_KINDS = ("tokens_per_s", "speedup", "peak_mem")


def slug(name: str) -> str:
    """File-name-safe form of a workload name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "workload"


def context_label(n: int) -> str:
    """64K, 1M, ...: a context length as users write it (powers of two), else the plain number."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}K"
    return str(n)


def _series_label(r: BenchRecord, vary: dict[str, bool], with_mode: bool = True) -> str:
    parts = [r.mode] if with_mode else []
    if vary["world_size"] or not with_mode:
        parts.append(f"P={r.world_size}")
    if vary["block_size"] or not with_mode:
        parts.append(f"S={r.block_size}")
    parts += [f"{name}={value}" for name, value in problem_fields(r).items() if vary.get(name)]
    if vary["device"]:
        parts.append(r.device)
    if vary["date"]:
        parts.append(r.date)
    return " ".join(parts)


def _save(fig, ax, path: Path, contexts: list[int], title: str, ylabel: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [context_label(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context length (clean tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path)  # no Software/date metadata: the PNG depends only on the records


def _lines(points: dict[str, dict[int, float]], ax, sort_key) -> None:
    for label in sorted(points, key=sort_key):
        xs = sorted(points[label])
        ax.plot(xs, [points[label][x] for x in xs], marker="o", label=label)


def plot_workload(
    records: list[BenchRecord], workload: str, img_dir: str | Path, headline: list[HeadlineRow] | None = None
) -> dict[str, Path]:
    """Write the plots of `workload` that have data; returns {kind: path}. With `headline`, the speedup
    plot draws those rows (CSBP over the best other mode of each problem) instead of side-by-side groups."""
    recs = [r for r in records if r.workload == workload]
    ok = [r for r in recs if r.status == "ok"]
    img_dir = Path(img_dir)
    vary = {f: len({getattr(r, f) for r in recs}) > 1 for f in ("world_size", "block_size", "device", "date")}
    for name in {n for r in recs for n in problem_fields(r)}:
        vary[name] = len({repr(problem_fields(r).get(name)) for r in recs}) > 1
    out: dict[str, Path] = {}
    if not ok:
        return out
    plt = pyplot()
    img_dir.mkdir(parents=True, exist_ok=True)
    labels: dict[str, BenchRecord] = {}

    def series(metric: str, better) -> dict[str, dict[int, float]]:
        pts: dict[str, dict[int, float]] = {}
        for r in ok:
            value = getattr(r, metric)
            if value is None:
                continue
            label = _series_label(r, vary)
            labels.setdefault(label, r)
            old = pts.setdefault(label, {}).get(r.context_len)
            pts[label][r.context_len] = value if old is None else better(old, value)
        return pts

    def order(label: str):
        r = labels[label]
        return (mode_rank(r.mode), r.world_size, r.block_size, r.device, r.date, label)

    for kind, metric, better, ylabel in (
        ("tokens_per_s", "tokens_per_s", max, "supervised tokens / s (whole job)"),
        ("peak_mem", "peak_mem_gib", min, "peak memory per GPU (GiB, max over ranks)"),
    ):
        pts = series(metric, better)
        if not pts:
            continue
        contexts = sorted({c for p in pts.values() for c in p})
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _lines(pts, ax, order)
        path = img_dir / f"{slug(workload)}_{kind}.png"
        _save(fig, ax, path, contexts, f"{workload}: {ylabel.split(' (')[0]}", ylabel)
        out[kind] = path

    # Speedup: the headline rows, else side-by-side groups only (compare.py): CSBP over the fastest other mode
    pairs: list[tuple[BenchRecord, BenchRecord]] = []
    if headline is not None:
        pairs = [(h.csbp, h.other) for h in headline
                 if h.csbp.workload == workload and h.over_other is not None]  # fmt: skip
    else:
        for by_mode in group_side_by_side(recs).values():
            csbp = [r for r in by_mode.get("csbp", []) if r.status == "ok" and r.tokens_per_s]
            other = best_other(by_mode)
            if csbp and other is not None and other[1].tokens_per_s:
                pairs.append((max(csbp, key=lambda r: r.tokens_per_s or 0.0), other[1]))
    spd: dict[str, dict[int, float]] = {}
    for best_csbp, other_rec in pairs:
        label = _series_label(best_csbp, vary, with_mode=False)
        labels.setdefault(label, best_csbp)
        spd.setdefault(label, {})[best_csbp.context_len] = best_csbp.tokens_per_s / other_rec.tokens_per_s
    if spd:
        contexts = sorted({c for p in spd.values() for c in p})
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _lines(spd, ax, order)
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        path = img_dir / f"{slug(workload)}_speedup.png"
        _save(fig, ax, path, contexts, f"{workload}: CSBP speedup over the best other mode",
              "tokens/s of CSBP / best non-CSBP")  # fmt: skip
        out["speedup"] = path
    return out

"""The study's final table: does the long-context recipe pay? Generated from the records, never typed.

    recipe_table(records)   per study run (newest first) and evaluated architecture, its drafters in the
                            grid's order: the 4K drafter, those trained from scratch on the long store, the
                            two-stage ones (4K, then the long store from its weights): far tau at 16K-32K and
                            32K+, their ratios to the run's 4K full-attention drafter and to their
                            architecture's 4K drafter, short-context tau on both eval sets, and whether the
                            recipe pays (PAYS_*). A missing bucket or drafter is n/a, never a verdict.

    | run | drafter | ... | far 16K-32K | far 32K+ | vs full-attention 4K | vs same architecture 4K | ... | meets |
          short                 (the run's baseline: 1.00x / 1.00x)                                      -
          long                  ratios to `short` ........... ratios to `short` ....................  yes | no: ...
          short-then-long       ratios to `short` ........... ratios to `short` ....................  yes | no: ...
          swa-short             ratios to `short` ........... 1.00x / 1.00x                              -
          swa-long              ratios to `short` ........... ratios to `swa-short` ................  yes | no: ...
          swa-short-then-long   ratios to `short` ........... ratios to `swa-short` ................  yes | no: ...

Two runs of one date and device are told apart by their record file's name.
"""

from __future__ import annotations

from .grid import ARCHS, DRAFTERS
from .report import EVAL_SETS, StudyRun, drafter_names, label, run_names, study_runs, tau_records

__all__ = ["FAR_BUCKETS", "PAYS_SHORT_FRACTION", "PAYS_VS_ARCH_4K", "PAYS_VS_FULL_4K", "SHORT_BUCKET",
           "recipe_table"]  # fmt: skip

#: A long-context recipe that pays: ">= 1.5x the 4K full-attention drafter" - its far tau at 16K-32K and at
#: 32K+ each at least 1.5x the run's `short` drafter's,
PAYS_VS_FULL_4K = 1.5
#: ">= 1.3x the best 4K-trained drafter of the same architecture" - each at least 1.3x its architecture's 4K
#: drafter's (`short`, `swa-short`, ...: the long stage, not the architecture, earns the gain),
PAYS_VS_ARCH_4K = 1.3
#: "0-4K and local within 10% of the best 4K-trained drafter" - its far 0-4K and its local 0-4K tau each at
#: least 0.9x the best of the run's 4K drafters (any architecture) in that bucket: long context not bought
#: with short context.
PAYS_SHORT_FRACTION = 0.9
#: the buckets the recipe table reads (GPU scale): far context, and the context a 4K drafter was trained on
FAR_BUCKETS = ((16384, 32768), (32768, None))
SHORT_BUCKET = (0, 4096)
_NONE = [None] * len(FAR_BUCKETS)  # a drafter not evaluated: n/a at every far bucket


def _tau_index(records: list[dict]) -> dict[tuple, float | None]:
    """(drafter, eval set, bucket start, bucket end) -> tau, of one run's records."""
    index = {}
    for s in EVAL_SETS:
        for r in tau_records(records, s):
            index[(r["drafter"], s, r["bucket_start"], r["bucket_end"])] = r["tau"]
    return index


def _four_k(arch: str) -> str:
    """The architecture's drafter trained from scratch on the short store."""
    return "short" if arch == "full" else f"{arch}-short"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _tau_cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _ratio_cell(ratios: list[float | None]) -> str:
    return " / ".join("n/a" if r is None else f"{r:.2f}x" for r in ratios)


def _bar(what: str, ratios: list[float | None], threshold: float) -> tuple[str | None, str | None]:
    """(failed, missing) of one condition: every ratio >= threshold."""
    if any(r is None for r in ratios):
        return None, f"{what} n/a"
    if min(ratios) < threshold:
        return f"{what} {_ratio_cell(ratios)} < {threshold:g}x", None
    return None, None


def _meets(vs_full: list, vs_arch: list, short_fractions: dict[str, float | None]) -> str:
    """"yes", "no: <the failed conditions>" or "n/a: <what is missing>" of a drafter trained on the long
    store (PAYS_*)."""
    checks = [_bar("vs full 4K", vs_full, PAYS_VS_FULL_4K), _bar("vs same-arch 4K", vs_arch, PAYS_VS_ARCH_4K)]
    checks += [_bar(f"{what} vs best 4K", [f], PAYS_SHORT_FRACTION) for what, f in short_fractions.items()]
    failed = [f for f, _ in checks if f]
    missing = [m for _, m in checks if m]
    if failed:
        return "no: " + "; ".join(failed + missing)
    return "n/a: " + "; ".join(missing) if missing else "yes"


def _recipe_rows(run: StudyRun, name_of_run: str) -> list[str]:
    """The run's rows: per evaluated architecture, its 4K drafter, then its drafters that trained on the long
    store (from scratch or from the 4K weights), in the grid's order."""
    taus = tau_records(run.records, "far") + tau_records(run.records, "local")
    present = set(drafter_names(taus))
    labels = {r["drafter"]: label(r) for r in taus}
    tau = _tau_index(run.records)
    far = {n: [tau.get((n, "far", *b)) for b in FAR_BUCKETS] for n in present}
    short = {n: {s: tau.get((n, s, *SHORT_BUCKET)) for s in EVAL_SETS} for n in present}
    fours = [_four_k(a) for a in ARCHS if _four_k(a) in present]
    # the best 4K drafter per short bucket: the bar a long-store drafter keeps its short context against
    best = {s: max((v for n in fours if (v := short[n][s]) is not None), default=None) for s in EVAL_SETS}
    rows = []
    for arch in ARCHS:
        base = _four_k(arch)
        long_store = [d.name for d in DRAFTERS if d.arch == arch and d.store == "long"]
        for name in [n for n in (base, *long_store) if n in present]:
            vs_full = [_ratio(a, b) for a, b in zip(far[name], far.get("short", _NONE))]
            vs_arch = [_ratio(a, b) for a, b in zip(far[name], far.get(base, _NONE))]
            meets = "-" if name == base else _meets(vs_full, vs_arch, {
                f"{s} {_kspan(SHORT_BUCKET)}": _ratio(short[name][s], best[s]) for s in EVAL_SETS})  # fmt: skip
            cells = [name_of_run, name, labels[name], *map(_tau_cell, far[name]), _ratio_cell(vs_full),
                     _ratio_cell(vs_arch), _tau_cell(short[name]["far"]), _tau_cell(short[name]["local"]),
                     _tau_cell(tau.get((name, "local", *FAR_BUCKETS[-1]))), meets]  # fmt: skip
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens and tokens % 1024 == 0 else str(tokens)


def _kspan(bucket: tuple[int, int | None]) -> str:
    """A bucket in thousands of tokens (16K-32K, 32K+): the recipe table's columns are read, not parsed."""
    start, end = bucket
    return f"{_k(start)}+" if end is None else f"{_k(start)}-{_k(end)}"


def _recipe_head() -> list[str]:
    far = [_kspan(b) for b in FAR_BUCKETS]
    short, farthest = _kspan(SHORT_BUCKET), far[-1]
    cells = ["run", "drafter", "architecture + recipe", *(f"far {b}" for b in far),
             f"vs full-attention 4K ({' / '.join(far)})", f"vs same architecture 4K ({' / '.join(far)})",
             f"far {short}", f"local {short}", f"local {farthest}", "meets"]  # fmt: skip
    return ["| " + " | ".join(cells) + " |", "|---" * len(cells) + "|"]


def _meets_caption() -> str:
    """The `meets` column's rule in words, from the PAYS_* constants: the rule shown is the rule applied."""
    return (f"meets: both far ratios >= {PAYS_VS_FULL_4K:g}x the run's 4K full-attention drafter and >= "
            f"{PAYS_VS_ARCH_4K:g}x its architecture's 4K drafter, far and local {_kspan(SHORT_BUCKET)} tau >= "
            f"{PAYS_SHORT_FRACTION:g}x the run's best 4K drafter's (any architecture).")  # fmt: skip


def recipe_table(records: list[dict]) -> str:
    """The study's final table (markdown, generated from the records): per run (newest first) and evaluated
    architecture, the 4K drafter and the drafters trained on the long store (from scratch, two-stage) at far
    context (16K-32K, 32K+), their ratios to the run's 4K full-attention drafter and to their architecture's
    4K drafter, their short-context tau, and whether the recipe pays (PAYS_*). A missing bucket or drafter is
    n/a."""
    runs = study_runs(records)
    rows = [row for run, name in zip(runs, run_names(runs)) for row in _recipe_rows(run, name)]
    lines = [*_recipe_head(), *rows] if rows else ["No run has a drafter of the grid evaluated yet."]
    return "\n".join([*lines, "", _meets_caption()]) + "\n"

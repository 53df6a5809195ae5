"""The long-context study's report (studies/long_context/report.py, recipe.py) on small hand-made records: one record
file per study run, a section per run, the recipe table's ratios and verdicts, the docs' two blocks, the plot.
No training: every number here is typed in the test."""

from __future__ import annotations

import json

import pytest

from specforge_csbp.studies.long_context import recipe, report
from specforge_csbp.studies.long_context.recipe import recipe_table
from specforge_csbp.studies.long_context.report import (RECIPE_BEGIN, RECIPE_END, REPORT_BEGIN, REPORT_END,
                                                        load_runs, plot_study, study_runs, tables_markdown,
                                                        update_docs)  # fmt: skip

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
FAR_16K, FAR_32K, SHORT = (16384, 32768), (32768, None), (0, 4096)
#: the fields every benchmark record carries (bench/records.py), the same in every record here
COMMON = {"workload": "longctx", "world_size": 1, "context_len": 65536, "block_size": 8, "command": ""}


def tau(drafter: str, eval_set: str, bucket: tuple, value: float | None, *, date: str, device: str,
        overall: float | None = None, train_len: int = 4096, label: str | None = None) -> dict:  # fmt: skip
    """A tau record as the report reads it (the fields records.jsonl carries for one bucket)."""
    return {**COMMON, "mode": "dp", "metric": "tau", "drafter": drafter, "eval_set": eval_set,
            "bucket_start": bucket[0], "bucket_end": bucket[1], "tau": value, "verify_steps": 10,
            "tau_overall": overall, "label": label or f"trained at {train_len} tokens", "train_len": train_len,
            "max_context": 65536, "date": date, "device": device}  # fmt: skip


def acc(dependency: str, start: int, end: int | None, accuracy: float, *, date: str, device: str) -> dict:
    return {**COMMON, "mode": "reference", "metric": "target_accuracy", "dependency": dependency,
            "distance_start": start, "distance_end": end, "accuracy": accuracy, "count": 100, "date": date,
            "device": device}  # fmt: skip


def curve(drafter: str, far: tuple, local: tuple, *, date: str, device: str, **kw) -> list[dict]:
    """A drafter's records: far and local tau at 0-4K, 16K-32K and 32K+ (None: that bucket missing)."""
    out = []
    for eval_set, values in (("far", far), ("local", local)):
        out += [tau(drafter, eval_set, b, v, date=date, device=device, **kw)
                for b, v in zip((SHORT, FAR_16K, FAR_32K), values) if v is not None]  # fmt: skip
    return out


def write_jsonl(path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def two_run_files(tmp_path) -> tuple[str, str]:
    """An older H200 run and a newer H100 run, each with its own `short` (different numbers)."""
    old = [acc("repeat", 16384, None, 0.858, date="2026-12-03", device=H200),
           *curve("short", (1.96, 1.09, 1.04), (4.12, 1.18, 1.05), date="2026-12-03", device=H200, overall=1.25)]
    new = [acc("repeat", 16384, None, 0.869, date="2026-12-07", device=H100),
           *curve("short", (2.34, 1.01, 1.02), (3.62, 1.03, 1.01), date="2026-12-07", device=H100, overall=1.16)]
    return write_jsonl(tmp_path / "longctx_old.jsonl", old), write_jsonl(tmp_path / "longctx_new.jsonl", new)


def test_each_record_file_is_a_run_and_a_shared_drafter_name_keeps_both_rows(tmp_path):
    old, new = two_run_files(tmp_path)
    records = load_runs([old, new])
    assert {(r["study_run"], r["study_run_file"]) for r in records} == {
        (f"2026-12-03, {H200}", old), (f"2026-12-07, {H100}", new)}  # the run's date and device
    assert [run.name for run in study_runs(records)] == [f"2026-12-07, {H100}", f"2026-12-03, {H200}"]
    text = tables_markdown(records)
    heads = [line for line in text.splitlines() if line.startswith("**Study run")]
    assert heads == [f"**Study run 2026-12-07, {H100}** (records: `longctx_new.jsonl`); its own target, so its "
                     "drafters compare with each other only:",
                     f"**Study run 2026-12-03, {H200}** (records: `longctx_old.jsonl`); its own target, so its "
                     "drafters compare with each other only:"]  # fmt: skip
    new_part, old_part = text.split(heads[1])
    # each section: its own target's accuracy, and its own `short` in both tau tables - nothing overwritten
    assert "| repeat | 16384+ | 0.869 | 100 |" in new_part and "0.858" not in new_part
    assert "| repeat | 16384+ | 0.858 | 100 |" in old_part and "0.869" not in old_part
    assert "| short | trained at 4096 tokens | 2.34 (10) | 1.01 (10) | 1.02 (10) | 1.16 |" in new_part
    assert "| short | trained at 4096 tokens | 1.96 (10) | 1.09 (10) | 1.04 (10) | 1.25 |" in old_part
    assert text.count("| dependency | distance (tokens) |") == 2 and text.count("| short | ") == 4


def test_one_run_writes_the_tables_as_without_runs(tmp_path):
    """One record file (or records never tagged with a run): no section heading, the accuracy table first,
    then a tau table per evaluated set - the format the docs page has always had."""
    records = [acc("query", 0, 256, 1.0, date="2026-12-03", device=H200),
               acc("repeat", 16384, None, 0.8582, date="2026-12-03", device=H200),
               *curve("short", (1.96, 1.09, 1.04), (None, None, None), date="2026-12-03", device=H200,
                      overall=1.25),
               tau("short-then-long", "far", SHORT, 2.0, date="2026-12-03", device=H200, overall=2.18,
                   train_len=65536, label="trained at 4096, then at 65536 tokens")]  # fmt: skip
    expected = """\
| dependency | distance (tokens) | target greedy accuracy | tokens |
|---|---|---|---|
| query | 0-256 | 1.000 | 100 |
| repeat | 16384+ | 0.858 | 100 |

Tau by context position, held-out prompts cut inside a far repeat (the continuation is copied from far back); \
verify steps in brackets:

| drafter | recipe | 0-4096 | 16384-32768 | 32768+ | all |
|---|---|---|---|---|---|
| short | trained at 4096 tokens | 1.96 (10) | 1.09 (10) | 1.04 (10) | 1.25 |
| short-then-long | trained at 4096, then at 65536 tokens | 2.00 (10) | n/a | n/a | 2.18 |
"""
    assert tables_markdown(records) == expected
    assert tables_markdown(load_runs([write_jsonl(tmp_path / "one.jsonl", records)])) == expected
    assert tables_markdown([]) == "| dependency | distance (tokens) | target greedy accuracy | tokens |\n|---|---|---|---|\n"


def _recipe_records() -> list[dict]:
    """Run A (newer): a row for every verdict. Run B (older): no `short`, and a bucket missing."""
    a = {"date": "2026-12-07", "device": H100}
    ok_short = (4.0, 1.0, 1.0)  # local: 0-4K, 16K-32K, 32K+
    records = [acc("repeat", 16384, None, 0.87, **a),
               *curve("short", (2.0, 1.0, 1.0), ok_short, **a),
               *curve("swa-short", (2.0, 1.0, 1.0), (3.0, 1.0, 1.0), **a),
               *curve("swa-full-short", (1.5, 1.5, 1.5), (3.0, 1.0, 1.0), **a),
               *curve("short-then-long", (2.0, 2.0, 1.6), (4.0, 2.0, 2.5), **a),  # pays
               *curve("swa-short-then-long", (2.0, 1.4, 1.8), ok_short, **a),  # 1.40x the full 4K
               *curve("swa-full-short-then-long", (2.0, 1.8, 1.8), ok_short, **a),  # 1.20x its arch's 4K
               *curve("swa-short-then-long-locality", (1.7, 2.0, 2.0), ok_short, **a),  # far 0-4K: 0.85x best
               *curve("swa-full-short-then-long-locality", (2.0, 2.0, 2.0), (3.4, 1.0, 1.0), **a),  # local 0.85x
               *curve("swa-long", (2.0, 1.4, 1.4), ok_short, train_len=65536, **a),  # learns from scratch
               *curve("long", (1.0, 1.0, 1.0), ok_short, overall=1.04, train_len=65536, **a),
               *curve("long-lr3x", (1.0, 1.0, 1.0), ok_short, overall=1.05, train_len=65536, **a)]  # fmt: skip
    b = {"date": "2026-12-03", "device": H200}
    records += [*curve("swa-short", (2.0, 1.0, 1.0), ok_short, **b),
                *curve("swa-short-then-long", (2.0, 1.5, None), ok_short, **b)]  # fmt: skip
    tag = {"2026-12-07": ("A", "a.jsonl"), "2026-12-03": ("B", "b.jsonl")}
    return [{**r, "study_run": tag[r["date"]][0], "study_run_file": tag[r["date"]][1]} for r in records]


def _row(table: str, run: str, drafter: str) -> list[str]:
    rows = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith(f"| {run} | {drafter} |")]
    assert len(rows) == 1, (run, drafter, rows)
    return rows[0]


def test_recipe_table_ratios_and_verdicts():
    table = recipe_table(_recipe_records())
    a, b = f"2026-12-07, {H100}", f"2026-12-03, {H200}"
    head = table.splitlines()[0].strip("| ").split(" | ")
    assert head == ["run", "drafter", "architecture + recipe", "far 16K-32K", "far 32K+",
                    "vs full-attention 4K (16K-32K / 32K+)", "vs same architecture 4K (16K-32K / 32K+)",
                    "far 0-4K", "local 0-4K", "local 32K+", "meets"]  # fmt: skip
    # run A first (newest); per architecture its 4K drafter, then its long-store drafters in the grid's order
    drafters = [line.split(" | ")[1] for line in table.splitlines()[2:] if line.startswith("| ")]
    assert drafters == ["short", "long", "long-lr3x", "short-then-long", "swa-short", "swa-long",
                        "swa-short-then-long", "swa-short-then-long-locality", "swa-full-short",
                        "swa-full-short-then-long", "swa-full-short-then-long-locality", "swa-short",
                        "swa-short-then-long"]  # fmt: skip
    assert _row(table, a, "short")[3:] == ["1.00", "1.00", "1.00x / 1.00x", "1.00x / 1.00x", "2.00", "4.00", "1.00",
                                           "-"]  # fmt: skip
    assert _row(table, a, "swa-full-short")[5:7] == ["1.50x / 1.50x", "1.00x / 1.00x"]
    assert _row(table, a, "short-then-long")[3:] == ["2.00", "1.60", "2.00x / 1.60x", "2.00x / 1.60x", "2.00", "4.00",
                                                     "2.50", "yes"]  # fmt: skip
    assert _row(table, a, "swa-short-then-long")[5:7] == ["1.40x / 1.80x", "1.40x / 1.80x"]
    assert _row(table, a, "swa-short-then-long")[-1] == "no: vs full 4K 1.40x / 1.80x < 1.5x"
    assert _row(table, a, "swa-full-short-then-long")[5:7] == ["1.80x / 1.80x", "1.20x / 1.20x"]
    assert _row(table, a, "swa-full-short-then-long")[-1] == "no: vs same-arch 4K 1.20x / 1.20x < 1.3x"
    # the best 4K drafter: 2.00 far and 4.00 local at 0-4K (`short`; any architecture counts)
    assert _row(table, a, "swa-short-then-long-locality")[-1] == "no: far 0-4K vs best 4K 0.85x < 0.9x"
    assert _row(table, a, "swa-full-short-then-long-locality")[-1] == "no: local 0-4K vs best 4K 0.85x < 0.9x"
    # run B: no full-attention 4K drafter, a bucket missing: n/a, never a crash and never "yes"
    assert _row(table, b, "swa-short-then-long")[3:] == ["1.50", "n/a", "n/a / n/a", "1.50x / n/a", "2.00", "4.00",
                                                         "1.00", "n/a: vs full 4K n/a; vs same-arch 4K n/a"]  # fmt: skip
    assert _row(table, b, "swa-short")[5] == "n/a / n/a"
    # drafters trained from scratch on the long store: rows with the same ratios and verdict
    assert _row(table, a, "long")[2:] == ["trained at 65536 tokens", "1.00", "1.00", "1.00x / 1.00x",
                                          "1.00x / 1.00x", "1.00", "4.00", "1.00",
                                          "no: vs full 4K 1.00x / 1.00x < 1.5x; vs same-arch 4K 1.00x / 1.00x "
                                          "< 1.3x; far 0-4K vs best 4K 0.50x < 0.9x"]  # fmt: skip
    assert _row(table, a, "swa-long")[-1] == "no: vs full 4K 1.40x / 1.40x < 1.5x"  # 1.40x its own 4K: met
    # below the table: the rule
    assert table.endswith("meets: both far ratios >= 1.5x the run's 4K full-attention drafter and >= 1.3x its "
                          "architecture's 4K drafter, far and local 0-4K tau >= 0.9x the run's best 4K drafter's "
                          "(any architecture).\n")  # fmt: skip


def test_recipe_table_thresholds_are_the_module_constants(monkeypatch):
    """The verdict reads PAYS_*: moving the bar moves the verdict (the numbers live in one place)."""
    monkeypatch.setattr(recipe, "PAYS_VS_FULL_4K", 1.4)
    assert _row(recipe_table(_recipe_records()), f"2026-12-07, {H100}", "swa-short-then-long")[-1] == "yes"
    assert recipe_table([]).startswith("No run has a drafter of the grid evaluated yet.")


def test_update_docs_replaces_both_blocks_and_needs_the_tables_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# page\n\n{REPORT_BEGIN}\nstale tables\n{REPORT_END}\n\nmiddle\n\n{RECIPE_BEGIN}\nstale recipe\n"
                    f"{RECIPE_END}\n\nafter\n")  # fmt: skip
    update_docs(str(page), "TABLES\n", "RECIPE\n")
    assert page.read_text() == (f"# page\n\n{REPORT_BEGIN}\n\nTABLES\n\n{REPORT_END}\n\nmiddle\n\n{RECIPE_BEGIN}\n\n"
                                f"RECIPE\n\n{RECIPE_END}\n\nafter\n")  # fmt: skip
    only_tables = tmp_path / "only.md"  # a page without the recipe block: its tables, nothing else
    only_tables.write_text(f"a\n{REPORT_BEGIN}\nold\n{REPORT_END}\nb\n")
    update_docs(str(only_tables), "T\n", "RECIPE\n")
    assert only_tables.read_text() == f"a\n{REPORT_BEGIN}\n\nT\n\n{REPORT_END}\nb\n"
    bare = tmp_path / "bare.md"
    bare.write_text(f"# no tables block\n{RECIPE_BEGIN}\nkept\n{RECIPE_END}\n")
    with pytest.raises(ValueError, match=r"^--docs: .*bare.md has no `<!-- report: tables") as err:
        update_docs(str(bare), "T\n", "R\n")
    assert "\n" not in str(err.value) and "kept" in bare.read_text()


def test_report_stage_from_two_record_files_writes_docs_recipe_and_plot(tmp_path):
    """--stage report --from-records A,B --docs: both blocks of the page, the run's recipe file and both
    plots, from two runs."""
    from specforge_csbp.studies.long_context.study import run_stage

    docs = tmp_path / "docs" / "page.md"
    docs.parent.mkdir()
    docs.write_text(f"{REPORT_BEGIN}\n{REPORT_END}\n{RECIPE_BEGIN}\n{RECIPE_END}\n")
    run = tmp_path / "run"
    run_stage("report", "gpu", str(run), docs=str(docs), from_records=two_run_files(tmp_path))
    text = docs.read_text()
    assert text.count("**Study run ") == 2
    recipe = text[text.index(RECIPE_BEGIN) : text.index(RECIPE_END)]
    assert f"| 2026-12-07, {H100} | short | " in recipe and f"| 2026-12-03, {H200} | short | " in recipe
    assert (run / "long_context_recipe.md").read_text() in recipe
    assert (docs.parent / "long_context.png").stat().st_size > 0 and (run / "long_context.png").stat().st_size > 0


def test_plot_of_two_runs_labels_each_curve_with_its_run(tmp_path, monkeypatch):
    """Every run's curves: the label names the run, the marker tells runs apart, color and line style stay the
    recipe's and the architecture's; the accuracy panel has a curve per run."""
    figures = []
    save = report.save_figure_atomic
    monkeypatch.setattr(report, "save_figure_atomic", lambda fig, path: (figures.append(
        {ax.get_title(): [(ln.get_label(), ln.get_marker(), ln.get_color()) for ln in ax.get_lines()]
         for ax in fig.axes}), save(fig, path)))  # fmt: skip
    path = tmp_path / "plot.png"
    plot_study(load_runs(two_run_files(tmp_path)), str(path))
    assert path.stat().st_size > 0
    (panels,) = figures
    far = panels["tau by context position, far continuations"]
    assert [(label, marker) for label, marker, _ in far] == [("[12-07] short: trained at 4096 tokens", "o"),
                                                             ("[12-03] short: trained at 4096 tokens", "s")]
    assert far[0][2] == far[1][2] == "tab:orange"
    assert [label for label, _, _ in panels["the target's long-range accuracy"]] == ["[12-07] repeat",
                                                                                     "[12-03] repeat"]


def test_two_runs_of_one_date_and_device_are_told_apart_by_their_file(tmp_path):
    """Two study runs on the same day and kind of GPU: the recipe table's run cell names each record file,
    so no row can be read as the other run's; a run whose name is its own keeps the plain name."""
    one = {"date": "2026-12-07", "device": H100}
    first = [acc("repeat", 16384, None, 0.869, **one), *curve("short", (2.3, 1.0, 1.0), (3.6, 1.0, 1.0), **one)]
    second = [acc("repeat", 16384, None, 0.871, **one), *curve("short", (2.5, 1.1, 1.0), (3.7, 1.2, 1.0), **one)]
    other = [acc("repeat", 16384, None, 0.858, date="2026-12-03", device=H200),
             *curve("short", (2.0, 1.1, 1.0), (4.1, 1.2, 1.1), date="2026-12-03", device=H200)]  # fmt: skip
    files = [write_jsonl(tmp_path / f"{n}.jsonl", rs) for n, rs in (("a", first), ("b", second), ("c", other))]
    records = load_runs(files)
    assert report.run_names(study_runs(records)) == [f"2026-12-07, {H100}, a.jsonl", f"2026-12-07, {H100}, b.jsonl",
                                                     f"2026-12-03, {H200}"]  # fmt: skip
    table = recipe_table(records)
    assert _row(table, f"2026-12-07, {H100}, a.jsonl", "short")[3] == "1.00"
    assert _row(table, f"2026-12-07, {H100}, b.jsonl", "short")[3] == "1.10"
    assert _row(table, f"2026-12-03, {H200}", "short")[3] == "1.10"

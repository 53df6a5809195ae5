"""docs/benchmarks.md's headline and plots show the newest measurement of each problem only (bench/latest.py);
superseded records (an older day, an earlier launch of one configuration) stay on the every-record page."""

from __future__ import annotations

import json
from pathlib import Path

from specforge_csbp.bench import plots
from specforge_csbp.bench.latest import headline_rows, latest_records
from specforge_csbp.bench.records import BenchRecord, load_records
from specforge_csbp.bench.report import write_report


def _rec(mode, ctx, tps, *, date="2026-11-30", command="bench new", status="ok", ws=2, **extra) -> dict:
    r = dict(workload="drafter", mode=mode, world_size=ws, context_len=ctx, block_size=16, status=status,
             device="H200", date=date, command=command, anchors=512, **extra)  # fmt: skip
    if status == "ok":
        r.update(step_ms=1000.0 * ctx / tps, tokens_per_s=tps, peak_mem_gib=tps / 1000.0)
    return r


def _history() -> list[dict]:
    """In run order. The superseded records carry tokens/s ending in .5 so that the page can be searched."""
    return [
        # 64K: an older day where CSBP lost badly (with code from before the `schedule` switch existed, so a
        # configuration of its own); the newest day has it ahead
        _rec("cp", 1 << 16, 3000.5, date="2026-11-29", command="bench old"),
        _rec("csbp", 1 << 16, 1000.5, date="2026-11-29", command="bench old"),
        _rec("cp", 1 << 16, 2000.0, schedule="fused"),
        _rec("csbp", 1 << 16, 2600.0, schedule="fused"),
        # 256K: one configuration launched twice on the newest day; the earlier launch (faster CSBP) is superseded
        _rec("cp", 1 << 18, 900.0, command="bench first"),
        _rec("csbp", 1 << 18, 1500.5, command="bench first"),
        _rec("csbp", 1 << 18, 1100.0, command="bench second"),
        # ... a switch variant of the same day is a configuration of its own and stays
        _rec("csbp", 1 << 18, 1200.0, command="bench ahead", gather_ahead=True),
        # ... a retired switch never stands in the headline, however fast
        _rec("csbp", 1 << 18, 5000.5, command="bench reversed", reverse_queries=True),
        # 1M: the other mode did not fit; one GPU against stock SpecForge
        _rec("cp", 1 << 20, 0.0, status="oom"),
        _rec("csbp", 1 << 20, 400.0),
        _rec("specforge", 1 << 16, 1300.0, ws=1, command="bench one"),
        _rec("csbp", 1 << 16, 1690.0, ws=1, command="bench one"),
    ]


def _records(raw: list[dict]) -> list[BenchRecord]:
    return [BenchRecord(**r) for r in raw]


def test_latest_keeps_the_newest_day_and_launch_of_each_configuration():
    latest = latest_records(_records(_history()))
    kept = sorted((r.world_size, r.context_len, r.mode, r.command) for r in latest)
    assert kept == [
        (1, 1 << 16, "csbp", "bench one"), (1, 1 << 16, "specforge", "bench one"),
        (2, 1 << 16, "cp", "bench new"), (2, 1 << 16, "csbp", "bench new"),
        (2, 1 << 18, "cp", "bench first"),  # cp's newest launch is still the first one
        (2, 1 << 18, "csbp", "bench ahead"), (2, 1 << 18, "csbp", "bench second"),
        (2, 1 << 20, "cp", "bench new"), (2, 1 << 20, "csbp", "bench new"),
    ]  # fmt: skip


def test_a_record_with_a_library_digest_is_newer_than_one_without_on_the_same_day():
    """Records from before provenance carry no `code`; on one day they ran earlier code than those that do,
    whatever their place in load order."""
    raw = [_rec("csbp", 1 << 16, 700.0, command="bench digest", code="abc123def456"),
           _rec("csbp", 1 << 16, 800.0, command="bench no digest")]  # fmt: skip
    assert [r.command for r in latest_records(_records(raw))] == ["bench digest"]
    # without digests, load order decides: the later record is the newer one
    raw[0].pop("code")
    assert [r.command for r in latest_records(_records(raw))] == ["bench no digest"]


def test_headline_row_per_problem_against_the_best_other_mode_and_specforge():
    rows = {(h.csbp.world_size, h.csbp.context_len): h for h in headline_rows(latest_records(_records(_history())))}
    assert set(rows) == {(2, 1 << 16), (2, 1 << 18), (2, 1 << 20), (1, 1 << 16)}
    assert rows[(2, 1 << 16)].over_other == 2600.0 / 2000.0 and rows[(2, 1 << 16)].specforge_status is None
    # the fastest non-superseded CSBP configuration (the gather ahead), not the superseded 1500.5
    assert rows[(2, 1 << 18)].csbp.tokens_per_s == 1200.0 and rows[(2, 1 << 18)].over_other == 1200.0 / 900.0
    assert rows[(2, 1 << 20)].other_mode == "cp" and rows[(2, 1 << 20)].other_status == "oom"
    assert rows[(2, 1 << 20)].over_other is None
    assert rows[(1, 1 << 16)].over_specforge == 1690.0 / 1300.0 == rows[(1, 1 << 16)].over_other


def test_superseded_records_stay_out_of_the_headline_page_and_its_plots(tmp_path, monkeypatch):
    raw = _history()
    (tmp_path / "results").mkdir()
    # two files, loaded in name order = run order
    (tmp_path / "results" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw[:4]))
    (tmp_path / "results" / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw[4:]))
    drawn: dict[str, dict[str, dict[int, float]]] = {}
    real_save = plots._save

    def capture(fig, ax, path, contexts, title, ylabel):
        drawn[Path(path).stem] = {line.get_label(): dict(zip(line.get_xdata(), line.get_ydata()))
                                  for line in ax.get_lines() if not line.get_label().startswith("_")}  # fmt: skip
        real_save(fig, ax, path, contexts, title, ylabel)

    monkeypatch.setattr(plots, "_save", capture)
    rerun = {1: "one-gpu", 2: "two-gpus"}
    write_report(tmp_path / "results", tmp_path / "docs" / "benchmarks.md",
                 rerun=lambda r: f"{rerun[r.world_size]} --contexts {r.context_len}" if r.context_len < 1 << 20 else None)
    summary = (tmp_path / "docs" / "benchmarks.md").read_text()
    appendix = (tmp_path / "docs" / "benchmarks_records.md").read_text()

    headline = summary.split("## Headline")[1].split("Runs:")[0]
    rows = [line for line in headline.splitlines() if line.startswith("| drafter")]
    assert len(rows) == 4
    assert "| drafter | 2 | 64K | 2026-11-30 | 2,600 | 2.60 | cp | 2,000 | 2.00 | 1.30x | — | [" in headline
    assert "| drafter | 2 | 1M | 2026-11-30 | 400.0 | 0.4 | cp | oom | — | cp oom | — | [" in headline
    assert "| drafter | 1 | 64K | 2026-11-30 | 1,690 | 1.69 | specforge | 1,300 | 1.30 | 1.30x | 1.30x | [" in headline
    assert "] | `two-gpus --contexts 65536` |" in headline and "] | `one-gpu --contexts 65536` |" in headline
    assert next(x for x in rows if "| 1M |" in x).endswith("] | — |")  # no scenario reruns that row
    for superseded in ("3,000", "1,000", "1,500", "5,000", "bench old", "bench reversed"):
        assert superseded not in summary, superseded
        assert superseded in appendix, superseded  # every record is still on the appendix page

    # the plots draw the same newest records: no superseded value on any line
    assert {"drafter_tokens_per_s", "drafter_speedup", "drafter_peak_mem"} <= set(drawn)
    values = {float(v) for lines in drawn.values() for pts in lines.values() for v in pts.values()}
    assert {2600.0, 2.6} <= values  # tokens/s and peak GiB (tokens/s / 1000) of a newest record
    for superseded in (3000.5, 1000.5, 1500.5, 5000.5, 3.0005, 1.0005, 1.5005, 5.0005):
        assert superseded not in values, superseded
    speedup = drawn["drafter_speedup"]
    assert speedup["P=2 S=16"] == {1 << 16: 2600.0 / 2000.0, 1 << 18: 1200.0 / 900.0}
    assert speedup["P=1 S=16"] == {1 << 16: 1690.0 / 1300.0}
    assert len(load_records(tmp_path / "results")) == len(raw)

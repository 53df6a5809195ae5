"""`specforge-csbp report`: markdown, speedups, CSV and PNGs regenerated from synthetic records."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specforge_csbp.bench.compare import speedups
from specforge_csbp.bench.records import BenchRecord, load_records
from specforge_csbp.bench.report import write_report
from specforge_csbp.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _rec(workload, mode, ctx, tps, *, status="ok", date="2025-11-30", device="H200", ws=2, bs=16, **extra):
    r = dict(workload=workload, mode=mode, world_size=ws, context_len=ctx, block_size=bs, status=status,
             device=device, date=date, command=f"bench --context {ctx} --date {date}")  # fmt: skip
    if status == "ok":
        r.update(step_ms=1000.0 * ctx / tps, tokens_per_s=tps, peak_mem_gib=ctx / 2**16 * 1.5)
    r.update(extra)
    return r


def _synthetic(tmp: Path) -> list[dict]:
    """Attention and drafter records (a JSON list file and a JSON-lines file) with OOM and error points."""
    attn = []
    for i, ctx in enumerate((1 << 16, 1 << 17, 1 << 18)):
        for mode, tps in (("cp", 1000.0 - 100 * i), ("bp", 1100.0 - 200 * i), ("csbp", 1700.0 - 150 * i)):
            status = "oom" if (mode == "bp" and ctx == 1 << 18) else "ok"
            attn.append(_rec("attention", mode, ctx, tps, status=status, useful_tflops_per_gpu=100.0 + i,
                             exposed_comm_ms=0.5 * i))  # fmt: skip
    # a second day: must never be compared with the first day's records
    attn.append(_rec("attention", "cp", 1 << 16, 10.0, date="2025-12-01"))
    drafter = [
        _rec("drafter", "cp", 1 << 16, 300.0, anchors=512),
        _rec("drafter", "csbp", 1 << 16, 450.0, anchors=512),
        _rec("drafter", "csbp", 1 << 16, 470.0, anchors=512),  # a repeat: the faster one stands
        _rec("drafter", "cp", 1 << 17, 0.0, status="error", anchors=512),
        _rec("drafter", "csbp", 1 << 17, 200.0, anchors=512),
        _rec("drafter", "csbp", 1 << 17, 900.0, anchors=1024),  # other config: no partner
    ]
    (tmp / "results").mkdir()
    (tmp / "results" / "attn.json").write_text(json.dumps(attn))
    (tmp / "results" / "sub").mkdir()
    (tmp / "results" / "sub" / "drafter.jsonl").write_text("".join(json.dumps(r) + "\n" for r in drafter))
    return attn + drafter


def _render(tmp: Path, name: str) -> tuple[str, dict[str, str]]:
    """The every-record page's text (benchmarks_records.md, beside --out by default) and the PNGs' digests."""
    doc = tmp / name / "benchmarks.md"
    rc = main(["report", "--results", str(tmp / "results"), "--out", str(doc), "--csv", str(tmp / name / "r.csv")])
    assert rc == 0
    imgs = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((tmp / name / "img").glob("*.png"))}
    return (tmp / name / "benchmarks_records.md").read_text(), imgs


def test_report_tables_speedups_plots_csv_deterministic(tmp_path):
    raw = _synthetic(tmp_path)
    text, imgs = _render(tmp_path, "a")
    text2, imgs2 = _render(tmp_path, "b")
    summary = (tmp_path / "a" / "benchmarks.md").read_text()
    assert text == text2 and imgs == imgs2  # same records -> same bytes (markdown and PNGs)
    assert summary == (tmp_path / "b" / "benchmarks.md").read_text()

    # one section per workload on both pages; every plot written and linked from the headline page
    assert text.count("\n## ") == 2 and "## attention" in text and "## drafter" in text
    assert "](benchmarks_records.md)" in summary and "](benchmarks.md)" in text and "![" not in text
    for w in ("attention", "drafter"):
        assert f"\n## {w}\n" in summary
        for kind in ("tokens_per_s", "speedup", "peak_mem"):
            assert f"{w}_{kind}.png" in imgs
            assert f"](img/{w}_{kind}.png)" in summary
    # every record is one table row (rows end with a run reference) and one CSV row
    assert sum(line.startswith("| ") and line.rstrip().endswith("] |") for line in text.splitlines()) == len(raw)
    with open(tmp_path / "a" / "r.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(raw) and {"anchors", "useful_tflops_per_gpu"} <= set(rows[0])
    # attention-only columns and extras appear; every distinct command is listed with device and date
    assert "useful TFLOP/s/GPU" in text and "exposed comm ms" in text and "| anchors |" in text
    for r in raw:
        assert f"{r['device']}, {r['date']}: `{r['command']}`" in text

    # speedups: recomputed here from the raw numbers, compared with what the report printed
    attn = [r for r in raw if r["workload"] == "attention" and r["date"] == "2025-11-30"]
    for ctx in (1 << 16, 1 << 17, 1 << 18):
        at = {r["mode"]: r for r in attn if r["context_len"] == ctx}
        cells = [f"{at['csbp']['tokens_per_s'] / at['cp']['tokens_per_s']:.2f}x"]
        cells.append("bp oom" if at["bp"]["status"] == "oom" else
                     f"{at['csbp']['tokens_per_s'] / at['bp']['tokens_per_s']:.2f}x")  # fmt: skip
        line = next(x for x in text.splitlines() if x.startswith(f"| {ctx} | 2 | 16 | H200 | 2025-11-30"))
        number = next(x.split(".")[0] for x in text.splitlines() if x.endswith(f"`{at['csbp']['command']}`"))
        # the run the group came from, then "no": these records do not say fresh_compile
        assert line.endswith(" | ".join(cells) + f" | [{number}] | no |"), line
    recs = load_records(tmp_path / "results")
    spd = {(s.key[0], s.key[1], s.key[4], s.other_mode): s for s in speedups(recs)}
    assert not any(k[2] == "2025-12-01" for k in spd)  # the lone second-day record has no partner
    d = spd[("drafter", 1 << 16, "2025-11-30", "cp")]
    assert d.value == pytest.approx(470.0 / 300.0)  # the faster CSBP repeat stands for the mode
    assert spd[("drafter", 1 << 17, "2025-11-30", "cp")].text == "cp error"
    assert sum(s.key[0] == "drafter" for s in spd.values()) == 2  # anchors=1024 is never compared


def test_report_empty_and_bad_records(tmp_path):
    (tmp_path / "results").mkdir()
    recs = write_report(tmp_path / "results", tmp_path / "doc.md")
    assert recs == [] and "No records yet." in (tmp_path / "doc.md").read_text()
    assert "No records yet." in (tmp_path / "doc_records.md").read_text()
    (tmp_path / "results" / "bad.json").write_text(json.dumps([{"workload": "x", "mode": "warp"}]))
    with pytest.raises(ValueError, match="mode"):
        write_report(tmp_path / "results", tmp_path / "doc.md")


def test_render_script_runs_from_any_directory(tmp_path):
    _synthetic(tmp_path)
    out = tmp_path / "doc" / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_benchmarks.py"), "--results", str(tmp_path / "results"),
         "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "MPLBACKEND": "Agg"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "15 records" not in proc.stdout and "16 records" in proc.stdout
    assert (tmp_path / "doc" / "img" / "drafter_speedup.png").exists()


def test_speedup_table_says_whether_every_mode_compiled_fresh(tmp_path):
    """A side-by-side group is `fresh compile: yes` only when every record of it started from a fresh
    compile state (bench/isolation.py's field, or a sweep point's own process)."""
    recs = [
        _rec("drafter", "cp", 1 << 16, 300.0, fresh_compile=True),
        _rec("drafter", "csbp", 1 << 16, 330.0, fresh_compile=True),
        _rec("drafter", "cp", 1 << 17, 200.0),  # an older launch: the later mode may carry the order effect
        _rec("drafter", "csbp", 1 << 17, 260.0, fresh_compile=True),
        _rec("drafter", "cp", 1 << 18, 100.0, point="drafter/cp/P2/L262144"),  # sweep: one process per point
        _rec("drafter", "csbp", 1 << 18, 110.0, point="drafter/csbp/P2/L262144"),
    ]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text, _ = _render(tmp_path, "fresh")
    table = text.split("### CSBP speedup, measured side by side")[1].split("### Runs")[0]
    rows = {line.split("|")[1].strip(): line.rstrip(" |").rsplit("|", 1)[-1].strip()
            for line in table.splitlines() if line[:3] in ("| 6", "| 1", "| 2")}  # fmt: skip
    assert rows == {"65536": "yes", "131072": "no", "262144": "yes"}, table


def test_speedup_table_names_the_configuration_that_tells_its_rows_apart(tmp_path):
    """Groups of one context that differ only in configuration fields (here gather_ahead and anchors; one
    record from before a switch existed) get those fields as columns and the run they came from; a field
    that is the same everywhere (dtype) gets none."""
    recs = []
    for launch, extra in enumerate(({"anchors": 512}, {"anchors": 512, "gather_ahead": True},
                                    {"anchors": 2048, "gather_ahead": False})):  # fmt: skip
        for mode, tps in (("cp", 100.0), ("csbp", 110.0 + launch)):
            r = _rec("drafter", mode, 1 << 20, tps, dtype="bfloat16", **extra)
            r["command"] = f"bench launch {launch}"
            recs.append(r)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text, _ = _render(tmp_path, "config")
    table = text.split("### CSBP speedup, measured side by side")[1].split("### Runs")[0]
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[5:7] == ["anchors", "gather_ahead"] and "dtype" not in header, header
    rows = {tuple(c.strip() for c in line.strip("|").split("|"))[5:] for line in lines[1:]}
    runs = text.split("### Runs")[1]
    number = {f"bench launch {i}": line.split(".")[0] for line in runs.splitlines() for i in range(3)
              if line.endswith(f"`bench launch {i}`")}  # fmt: skip
    assert rows == {
        ("512", "—", "110.0", "1.10x", f"[{number['bench launch 0']}]", "no"),
        ("512", "true", "111.0", "1.11x", f"[{number['bench launch 1']}]", "no"),
        ("2048", "false", "112.0", "1.12x", f"[{number['bench launch 2']}]", "no"),
    }, table


def test_records_pair_only_within_their_launch_and_sweep_points_within_their_sweep():
    """Two launches of one day never mix (command line when no `launch` is recorded); sweep points, each in
    its own process with its own launch, pair with each other."""
    recs = [
        _rec("drafter", "csbp", 1 << 16, 500.0, command="bench A"),
        _rec("drafter", "specforge", 1 << 16, 400.0, command="bench A"),
        _rec("drafter", "csbp", 1 << 16, 800.0, command="bench B"),  # faster CSBP, other launch
        _rec("drafter", "specforge", 1 << 16, 100.0, command="bench C"),  # slower SpecForge, third launch
        _rec("sft", "cp", 1 << 16, 100.0, launch="torchrun cp", point="sft/cp"),
        _rec("sft", "csbp", 1 << 16, 110.0, launch="torchrun csbp", point="sft/csbp"),
    ]
    got = sorted((s.csbp.workload, s.other_mode, round(s.value, 6)) for s in speedups(
        [BenchRecord(**r) for r in recs]))  # fmt: skip
    assert got == [("drafter", "specforge", 1.25), ("sft", "cp", 1.1)]

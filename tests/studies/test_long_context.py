"""The long-context study (docs/long_context.md): its documents, and its CPU miniature end to end.

The miniature runs every stage of scripts/long_context_study.py at --scale cpu (a 3-layer target, 256- vs
2048-token drafters and the two that start from the 256-token one, a few steps) and asserts the mechanics
only: every drafter trains under one budget, eval writes tau per context-position bucket for each, the report
writes records and the plot. Never the outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specforge_csbp.bench.records import load_records
from specforge_csbp.eval.metrics import parse_bucket_edges
from specforge_csbp.studies.long_context.documents import ASK, DocSpec, eval_prompts, make_document
from specforge_csbp.studies.long_context.study import DRAFTERS, SCALES

ROOT = Path(__file__).resolve().parents[2]


def test_documents_are_deterministic_and_their_dependencies_hold():
    spec = DocSpec(length=4096, seed=3)
    a, b, c = make_document(spec, 7), make_document(spec, 7), make_document(spec, 8)
    assert (a.tokens == b.tokens).all() and a.deps == b.deps and not (a.tokens == c.tokens).all()
    assert len(a.tokens) == 4096 and a.tokens.min() >= 4 and a.tokens.max() < 512
    kinds = {k for _, _, k in a.deps}
    assert kinds == {"query", "repeat"}
    for pos, src, kind in a.deps:  # every dependent token equals its source, and lies after it
        assert src < pos and a.tokens[pos] == a.tokens[src], (pos, src, kind)
    queries = [p for p, _, k in a.deps if k == "query"]
    assert all(ASK in a.tokens[p - 8 : p].tolist() for p in queries)
    assert max(p - s for p, s, _ in a.deps) > 1024  # long-range items exist


def test_eval_prompts_end_inside_a_far_repeat():
    spec = DocSpec(length=2048, seed=1)
    prompts = eval_prompts(spec, range(3), cuts_per_doc=3)
    assert len(prompts) >= 3
    for p in prompts:
        doc = make_document(spec, p["doc"])
        assert p["input_ids"] == doc.tokens[: p["position"]].tolist()
        assert (p["position"], p["position"] - p["distance"], "repeat") in doc.deps


def test_bucket_edges_parse():
    assert parse_bucket_edges("0,256,1K,4k") == (0, 256, 1024, 4096)
    for bad in ("", "256,1K", "0,4K,2K", "0,x"):
        try:
            parse_bucket_edges(bad)
        except ValueError as err:
            assert str(err).startswith("--bucket-edges: expected increasing positions starting at 0")
        else:
            raise AssertionError(bad)


#: the miniature's cover of the grid: sliding-window and full-attention layers, both stores, a warm start and
#: locality anchors; the rest of the grid differs from these in its configs only (test_grid_... below)
MINIATURE = ("swa-long", "swa-full-short", "swa-full-short-then-long-locality")


@pytest.mark.slow(reason="every stage of the long-context study, each a command")
def test_cpu_miniature_runs_every_stage(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "scripts" / "long_context_study.py"), "--scale", "cpu", "--run", str(run)]
    done = subprocess.run(cmd + ["--stage", "all", "--drafters", ",".join(MINIATURE)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    scale = SCALES["cpu"]
    # 4 steps from scratch leave a drafter on the plateau: the trainer says so (csbp.plateau_steps=4)
    assert "steps (csbp.plateau_steps=4): the drafter is still on the unigram plateau" in done.stderr
    # one budget: the same steps, context tokens and anchors per token; only the sequence length differs
    cfgs = {k: yaml.safe_load((run / f"{k}.yaml").read_text()) for k in ("swa-full-short", "swa-long")}
    assert cfgs["swa-full-short"]["data"]["max_length"] == scale.short_len
    assert cfgs["swa-long"]["data"]["max_length"] == scale.long_len
    t_s, t_l = cfgs["swa-full-short"]["training"], cfgs["swa-long"]["training"]
    assert t_s["batch_size"] * scale.short_len == t_l["batch_size"] * scale.long_len
    assert t_s["batch_size"] * t_s["num_anchors"] == t_l["batch_size"] * t_l["num_anchors"]
    assert t_s["num_epochs"] == t_l["num_epochs"]
    # a warm start: the same budget again, from its source's export, on the long store
    for name, source in (("swa-full-short-then-long-locality", "swa-full-short"),):
        cfg = yaml.safe_load((run / f"{name}.yaml").read_text())
        assert cfg["model"]["draft_checkpoint_path"] == str(run / f"drafter-{source}")
        assert cfg["training"] == cfgs["swa-long"]["training"]
        assert (run / f"drafter-{name}" / "model.safetensors").read_bytes() != (
            run / f"drafter-{source}" / "model.safetensors").read_bytes()  # it trained on
    assert yaml.safe_load((run / "swa-full-short-then-long-locality.yaml").read_text())["csbp"]["anchor_sampling"] == (
        "locality")  # fmt: skip
    # the exports are the architectures SGLang loads
    types = {n: json.loads((run / f"drafter-{n}" / "config.json").read_text())["layer_types"] for n in MINIATURE}
    assert types["swa-long"] == ["sliding_attention"] * 2
    assert types["swa-full-short"] == ["sliding_attention", "full_attention"]
    for name in MINIATURE:  # every one trained, and evaluated on both sets
        assert list((run / f"output-{name}").glob("*-latest")), name
        for suffix in ("", "-local"):
            summary = json.loads((run / f"eval-{name}{suffix}.json").read_text())
            assert [b["start"] for b in summary["buckets"]] == list(scale.bucket_edges[: len(summary["buckets"])])
            assert summary["verify_steps"] > 0
            assert any(b["tau"] is not None and b["start"] >= 1024 for b in summary["buckets"])
    records = load_records(run / "records.jsonl")
    taus = [r for r in records if getattr(r, "metric", None) == "tau"]
    assert {r.workload for r in records} == {"longctx"}
    assert {(r.drafter, r.eval_set) for r in taus} == {(n, s) for n in MINIATURE for s in ("far", "local")}
    assert all("specforge_csbp eval" in r.command and "specforge_csbp train --csbp" in r.train_command for r in taus)
    assert any(getattr(r, "metric", None) == "target_accuracy" for r in records)
    assert (run / "long_context.png").stat().st_size > 0
    tables = (run / "long_context_tables.md").read_text()
    for name in MINIATURE:  # a row per drafter in each set's table
        assert tables.count(f"| {name} | ") == 2, name
    assert f"sliding window {scale.window} + last full layer, trained at {scale.short_len}, then at {scale.long_len} " \
        "tokens, locality anchors" in tables
    # the plateau probe on what the run has: a store not captured is left out, each drafter init and trained
    (run / "store-short").rename(run / "store-short-off")
    probe = subprocess.run([sys.executable, str(ROOT / "scripts" / "long_context_probe.py"), "--scale", "cpu", "--run",
                            str(run), "--drafters", "swa-long", "--near", "16", "--blocks", "4"], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-2000:]
    assert f"probe: {run / 'store-short'} not captured: the short store is left out" in probe.stdout
    rows = json.loads((run / "probe.json").read_text())
    assert [(r["drafter"], r["state"], r["store"]) for r in rows] == [("swa-long", "init", "long"),
                                                                      ("swa-long", "trained", "long")]
    assert all(r["keys_seen"] <= scale.window - 1 and 0 < r["entropy_ratio"] <= 1 for r in rows)
    (run / "store-long").rename(run / "store-long-off")  # neither store: one line naming both, no probe.json
    (run / "probe.json").unlink()
    none = subprocess.run([sys.executable, str(ROOT / "scripts" / "long_context_probe.py"), "--scale", "cpu", "--run",
                           str(run), "--drafters", "swa-long"], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert none.returncode != 0 and not (run / "probe.json").exists()
    assert none.stderr.strip().splitlines()[-1] == f"--run: {run} has neither store-short/ nor store-long/ (run the " \
        "study's capture stage)"
    (run / "store-long-off").rename(run / "store-long")
    (run / "store-short-off").rename(run / "store-short")
    # idempotent: a second run of a stage skips what exists
    again = subprocess.run(cmd + ["--stage", "train", "--drafters", "swa-long"], env=env, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0 and "exists; skipped" in again.stdout
    # eval of the whole grid: what is evaluated is skipped, what is not trained is named and skipped
    every = subprocess.run(cmd + ["--stage", "eval", "--drafters", "all"], env=env, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert every.returncode == 0, every.stdout[-2000:] + every.stderr[-2000:]
    assert f"eval: {run / 'eval-swa-long.json'} exists; skipped" in every.stdout
    assert f"eval: {run / 'drafter-short'} not there (not trained, or not carried); skipped" in every.stdout


def test_grid_names_architectures_and_warm_starts():
    """Every architecture has every recipe; names are unique; a warm start trains after its source, on the
    same architecture; the full-attention column keeps the study's first names and configs."""
    from specforge_csbp.studies.long_context.grid import ARCHS, select
    from specforge_csbp.studies.long_context.study import drafter_config, train_config

    names = [d.name for d in DRAFTERS]
    assert len(set(names)) == len(names)
    assert names[:2] == ["short", "long"] and {"short-then-short", "short-then-long"} <= set(names)
    for arch in ARCHS:
        mine = [d for d in DRAFTERS if d.arch == arch]
        assert {(d.store, d.warm_start is None) for d in mine} >= {("short", True), ("long", True), ("long", False)}
    for i, d in enumerate(DRAFTERS):
        if d.warm_start is not None:
            src = names.index(d.warm_start)
            assert src < i and DRAFTERS[src].arch == d.arch and DRAFTERS[src].warm_start is None
    scale = SCALES["gpu"]
    assert drafter_config(scale)["layer_types"] == ["full_attention"] * scale.drafter_layers
    assert drafter_config(scale, "swa")["sliding_window"] == 2048
    assert "anchor_sampling" not in train_config("R", scale, "short-then-long")["csbp"]
    assert train_config("R", scale, "swa-short-then-long-locality")["csbp"]["anchor_sampling"] == "locality"
    assert train_config("R", scale, "swa-full-long")["model"]["draft_model_config"] == "R/drafter-swa-full.json"
    sweep = {n: train_config("R", scale, n)["training"] for n in ("long", "long-lr3x", "long-warmup25")}
    assert sweep["long-lr3x"]["learning_rate"] == 3 * sweep["long"]["learning_rate"]
    assert sweep["long-warmup25"]["warmup_ratio"] == 0.25 and sweep["long"]["warmup_ratio"] == 0.05
    assert {k: v for k, v in sweep["long-lr3x"].items() if k != "learning_rate"} == {
        k: v for k, v in sweep["long"].items() if k != "learning_rate"}  # only the schedule differs
    # selection: the named ones plus their sources, in training order; "all" and None: the grid
    assert [d.name for d in select("swa-full-short-then-long,long")] == ["long", "swa-full-short",
                                                                         "swa-full-short-then-long"]
    assert select("all") == select(None) == DRAFTERS
    for bad in ("nope", "short,nope", ","):
        with pytest.raises(ValueError, match="^--drafters: unknown drafter .*; allowed: all or a comma-separated"):
            select(bad)


def test_local_prompts_continue_with_filler_only():
    from specforge_csbp.studies.long_context.documents import far_positions, local_prompts

    spec = DocSpec(length=4096, seed=2, min_distance=64)
    prompts = local_prompts(spec, range(2), cuts_per_doc=4, span=24)
    assert len(prompts) == 8
    for p in prompts:
        doc = make_document(spec, p["doc"])
        far = far_positions(doc)
        assert p["input_ids"] == doc.tokens[: p["position"]].tolist()
        assert not far[p["position"] : p["position"] + 24].any()
        # filler only: no marker, no dependent token, nothing copied from far
        assert not set(doc.tokens[p["position"] : p["position"] + 24].tolist()) & {4, 5, 6, 7}
        assert not {q for q, _, _ in doc.deps} & set(range(p["position"], p["position"] + 24))
    doc = make_document(spec, 0)
    far = far_positions(doc)
    for q, _, kind in doc.deps:  # the marks: every dependency, and a repeat's cue before its first one
        assert far[q]
    assert far[doc.tokens == ASK].all()


def test_target_training_resumes_and_is_idempotent(tmp_path):
    from dataclasses import replace

    from specforge_csbp.studies.long_context.study import doc_spec
    from specforge_csbp.studies.long_context.target import _Steps, train_target

    scale = SCALES["cpu"]
    small = replace(scale.target, phases=((256, 3, 2), (512, 2, 1)))
    spec = doc_spec(scale, 2048, 0)
    steps = _Steps(small, spec)  # each step its own documents, a function of the step alone
    assert [tuple(steps[i].shape) for i in range(5)] == [(2, 256)] * 3 + [(1, 512)] * 2
    assert not (steps[3][0, :256] == steps[2][1]).all()
    logs: list[str] = []
    assert not train_target(str(tmp_path), small, spec, minutes=0.0, workers=2, log=logs.append)
    assert (tmp_path / "train_state.pt").is_file() and not (tmp_path / "target").exists()
    assert train_target(str(tmp_path), small, spec, workers=2, log=logs.append)
    assert any("resumed at step 0/5" in s for s in logs) and (tmp_path / "target" / "config.json").is_file()
    assert train_target(str(tmp_path), small, spec, log=logs.append) and "skipped" in logs[-1]


@pytest.mark.parametrize("name", sorted(SCALES))
def test_every_scale_is_a_valid_capture_and_training_config(name):
    """Each scale's drafter reads layers its target has, and its stores fit the batch and anchor split: the
    checks capture and training would make, before any device time is spent on the scale."""
    from specforge_csbp.data.capture import check_target_layer_ids

    scale = SCALES[name]
    check_target_layer_ids(scale.target_layer_ids, scale.target.layers)
    assert scale.long_len % scale.short_len == 0 and scale.anchors_long % scale.ratio == 0
    assert scale.long_len <= scale.target.max_position and max(scale.bucket_edges) < scale.long_len


def test_carry_keeps_results_and_only_the_exports_still_needed(tmp_path):
    """device_longctx.sh packs `--stage carry`: every eval result, and an export only while it is not
    evaluated on both sets or a warm start from it is still to train."""
    from specforge_csbp.studies.long_context.study import carry_paths

    def export(name):
        (tmp_path / f"drafter-{name}").mkdir()
        (tmp_path / f"drafter-{name}" / "model.safetensors").write_bytes(b"x")

    for name in ("short", "long", "swa-short"):
        export(name)
        (tmp_path / f"eval-{name}.json").write_text("{}")
    (tmp_path / "eval-short-local.json").write_text("{}")
    (tmp_path / "eval-long-local.json").write_text("{}")
    (tmp_path / "commands.json").write_text("{}")
    (tmp_path / "probe.json").write_text("[]")
    (tmp_path / "store-long").mkdir()  # never carried: capture writes it again
    kept = set(carry_paths(str(tmp_path)))
    # short: a source of short-then-long (not exported); long: evaluated on both sets, no one's source;
    # swa-short: its local set not evaluated yet
    assert kept == {"commands.json", "probe.json", "eval-short.json", "eval-short-local.json", "eval-long.json",
                    "eval-long-local.json", "eval-swa-short.json", "drafter-short", "drafter-swa-short"}


def test_report_from_records_writes_the_docs_block_and_plot(tmp_path):
    """--stage report --from-records --docs: the tables made from record files replace the docs' report block
    (and only it); the plot is written beside the docs; a file without the block is a one-line error."""
    from specforge_csbp.studies.long_context.report import REPORT_BEGIN, REPORT_END
    from specforge_csbp.studies.long_context.study import run_stage

    docs = tmp_path / "docs" / "page.md"
    docs.parent.mkdir()
    docs.write_text(f"# page\n\nbefore\n\n{REPORT_BEGIN}\nstale\n{REPORT_END}\n\nafter\n")
    files = tuple(str(ROOT / "benchmarks" / "results" / f"longctx_h200_{d}.jsonl") for d in ("2026-12-01", "2026-12-02"))
    run_stage("report", "gpu", str(tmp_path / "run"), docs=str(docs), from_records=files)
    text = docs.read_text()
    assert text.startswith("# page\n\nbefore\n\n") and text.endswith(f"{REPORT_END}\n\nafter\n") and "stale" not in text
    block = text[text.index(REPORT_BEGIN) : text.index(REPORT_END)]
    assert "| query | 16384+ |" in block  # the target's accuracy (first file)
    far = [line for line in block.splitlines() if line.startswith(("| short |", "| long |"))]
    assert [line.split(" | ")[1] for line in far] == ["trained at 4096 tokens", "trained at 65536 tokens"]
    assert "cut inside a far repeat" in block and "Markov filler only" not in block  # no local records yet
    assert (docs.parent / "long_context.png").stat().st_size > 0
    bare = tmp_path / "bare.md"
    bare.write_text("# no block\n")
    with pytest.raises(ValueError, match=r"^--docs: .*bare.md has no `<!-- report: tables"):
        run_stage("report", "gpu", str(tmp_path / "run"), docs=str(bare), from_records=files)

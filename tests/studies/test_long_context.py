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


@pytest.mark.slow(reason="every stage of the long-context study, each a command")
def test_cpu_miniature_runs_every_stage(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "scripts" / "long_context_study.py"), "--scale", "cpu", "--run", str(run)]
    done = subprocess.run(cmd + ["--stage", "all"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    scale = SCALES["cpu"]
    # one budget: the same steps, context tokens and anchors per token; only the sequence length differs
    cfgs = {k: yaml.safe_load((run / f"{k}.yaml").read_text()) for k in ("short", "long")}
    assert cfgs["short"]["data"]["max_length"] == scale.short_len and cfgs["long"]["data"]["max_length"] == scale.long_len
    t_s, t_l = cfgs["short"]["training"], cfgs["long"]["training"]
    assert t_s["batch_size"] * scale.short_len == t_l["batch_size"] * scale.long_len
    assert t_s["batch_size"] * t_s["num_anchors"] == t_l["batch_size"] * t_l["num_anchors"]
    assert t_s["num_epochs"] == t_l["num_epochs"]
    # the extension: the same budget again, from the short drafter's export, on each store
    for name, store in (("short-then-short", "short"), ("short-then-long", "long")):
        cfg = yaml.safe_load((run / f"{name}.yaml").read_text())
        assert cfg["model"]["draft_checkpoint_path"] == str(run / "drafter-short")
        assert cfg["data"] == cfgs[store]["data"] and cfg["training"] == cfgs[store]["training"]
    assert (run / "drafter-short-then-short" / "model.safetensors").read_bytes() != (
        run / "drafter-short" / "model.safetensors").read_bytes()  # it trained on
    for kind in (d.name for d in DRAFTERS):  # every one trained: a SpecForge checkpoint with the drafter's weights
        ckpts = list((run / f"output-{kind}").glob("*-latest"))
        assert ckpts, kind
        summary = json.loads((run / f"eval-{kind}.json").read_text())
        assert [b["start"] for b in summary["buckets"]] == list(scale.bucket_edges[: len(summary["buckets"])])
        assert summary["verify_steps"] > 0
        assert any(b["tau"] is not None and b["start"] >= 1024 for b in summary["buckets"])
    records = load_records(run / "records.jsonl")
    taus = [r for r in records if getattr(r, "metric", None) == "tau"]
    assert {r.workload for r in records} == {"longctx"}
    assert {r.drafter for r in taus} == {d.name for d in DRAFTERS}
    assert all("specforge_csbp eval" in r.command and "specforge_csbp train --csbp" in r.train_command for r in taus)
    assert any(getattr(r, "metric", None) == "target_accuracy" for r in records)
    assert (run / "long_context.png").stat().st_size > 0
    tables = (run / "long_context_tables.md").read_text()
    assert f"trained at {scale.short_len} tokens" in tables and f"trained at {scale.long_len} tokens" in tables
    assert f"trained at {scale.short_len}, then at {scale.long_len} tokens" in tables
    # idempotent: a second run of a stage skips what exists
    again = subprocess.run(cmd + ["--stage", "train"], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "exists; skipped" in again.stdout


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

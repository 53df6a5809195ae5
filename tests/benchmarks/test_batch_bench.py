"""benchmarks/batch_bench.py at tiny size on CPU: a batch of short samples and one long sample with the
same tokens per optimizer step, both through `specforge train --csbp` (trainer_bench runs each)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import batch_bench

DRAFTER = os.path.join(ROOT, "examples", "quickstart_drafter.json")


def test_two_runs_have_the_same_tokens_and_anchors_per_token(tmp_path):
    args = batch_bench.parse_args(["--draft-config", DRAFTER, "--context", "4K", "--batch-size", "16",
                                   "--anchors", "2048", "--batches", "3", "--work", str(tmp_path), "--out", "o"])  # fmt: skip
    runs = {k: trainer_bench_args(v) for k, v in batch_bench.runs(args).items()}
    assert (
        runs["long"]["context"] == "4096" and runs["long"]["batch_size"] == 1 and runs["long"]["samples"] == 3
    )
    assert (
        runs["short"]["context"] == "256"
        and runs["short"]["batch_size"] == 16
        and runs["short"]["samples"] == 48
    )
    assert runs["long"]["anchors"] == 2048 and runs["short"]["anchors"] == 128
    with pytest.raises(SystemExit):  # 4096 tokens do not split into 3 samples
        batch_bench.parse_args(["--draft-config", DRAFTER, "--context", "4K", "--batch-size", "3", "--work", "w",
                                "--out", "o"])  # fmt: skip
    c = batch_bench.compare({"step_ms": 100.0, "data_wait_ms": 1.0, "train_compute_ms": 90.0},
                            {"step_ms": 250.0, "data_wait_ms": 2.0, "train_compute_ms": 240.0}, 4)  # fmt: skip
    assert c["short_over_long"] == 2.5 and c["per_sample_overhead_ms"] == 50.0


def trainer_bench_args(argv):
    import trainer_bench

    return vars(trainer_bench.parse_args(argv))


@pytest.mark.slow(reason="a short batch and a long sample, each through the trainer")
def test_short_batch_against_long_sample_through_the_trainer(tmp_path, capsys):
    out = tmp_path / "rec.jsonl"
    rc = batch_bench.main(["--draft-config", DRAFTER, "--no-dflash2", "--context", "512", "--batch-size", "4",
                           "--anchors", "16", "--batches", "2", "--steps", "3", "--warmup", "1",
                           "--profile-steps", "1", "--work", str(tmp_path / "w"), "--out", str(out)])  # fmt: skip
    assert rc == 0
    recs = {r["batch_size"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == [1, 4]
    long, short = recs[1], recs[4]
    assert (
        long["workload"] == "trainer-quickstart_drafter-as-dflash-warm-cache"
        and short["workload"] == "trainer-quickstart_drafter-as-dflash-batch4-warm-cache"
    )
    assert (
        long["context_len"] == 512 and short["context_len"] == 128 and long["mode"] == short["mode"] == "csbp"
    )
    assert long["anchors"] == 16 and short["anchors"] == 4
    # same supervised tokens per step: tokens_per_s differ only by the step time
    assert long["tokens_per_s"] * long["step_ms"] == pytest.approx(
        short["tokens_per_s"] * short["step_ms"], rel=1e-3
    )
    for r in recs.values():
        assert r["status"] == "ok" and r["step_ms"] > 0 and r["timed_steps"] == 1
    # each run trained its own batches: B samples per step in the short run's log
    logged = (tmp_path / "trainer_logs" / "csbp_128_warm-cache.log").read_text()
    assert "'tokens_per_micro_step': 512.0" in logged
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if ln.startswith("batch_bench "))
    shown = json.loads(line.split(": ", 1)[1])
    assert shown["short_over_long"] == pytest.approx(short["step_ms"] / long["step_ms"], abs=1e-3)

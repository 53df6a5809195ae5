"""benchmarks/trainer_bench.py at tiny size on CPU: stock `specforge train` (dflash) and `specforge train
--csbp` on the same bytes, step times read from the trainers' own logs, each step broken down from
SpecForge's own profiler window."""

from __future__ import annotations

import gzip
import json
import os
import statistics
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import trainer_bench  # noqa: E402

DRAFTER = os.path.join(ROOT, "examples", "quickstart_drafter.json")


def test_step_lines_and_trace_summary(tmp_path):
    log = "noise\nstep 1: {'loss': 2.0, 'perf/optimizer_step_time_s': 0.5}\nstep 2: {'train/perf/optimizer_step_time_s': 0.25}\n"
    metrics = trainer_bench.step_metrics(log)
    assert sorted(metrics) == [1, 2]
    assert trainer_bench._metric(metrics[2], "perf/optimizer_step_time_s") == 0.25
    events = [
        {"ph": "X", "name": "Optimizer.step#AdamW.step", "dur": 3000},
        {"ph": "X", "name": "Optimizer.zero_grad#AdamW.zero_grad", "dur": 1000},
        {"ph": "X", "name": "cudaStreamSynchronize", "dur": 500, "cat": "cuda_runtime"},
        {"ph": "X", "name": "aten::_local_scalar_dense", "dur": 10},
        {"ph": "X", "name": "gemm", "dur": 8000, "cat": "kernel"},
        {"ph": "i", "name": "Optimizer.step#AdamW.step", "dur": 99000},  # not a complete event
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = trainer_bench.trace_summary(str(path), steps=2)
    assert s == {"optimizer": 2.0, "host_sync_ms": 0.25, "host_syncs": 0.5, "item_calls": 0.5, "gpu_kernels_ms": 4.0,
                 "compute_idle_ms": 0.0, "side_stream_ms": 0.0, "side_stream_hidden": 1.0}  # fmt: skip


def test_trace_summary_reads_the_side_streams_overlap(tmp_path):
    """Compute stream 7: kernels at [0, 10) and [15, 30) ms (5 ms idle between); side stream 20: a copy at
    [8, 18) ms - 2 + 3 of its 10 ms run while stream 7 is busy - and a memset inside [20, 21)."""
    ms = 1000.0
    events = [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 10 * ms, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 15 * ms, "dur": 15 * ms, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 8 * ms, "dur": 10 * ms, "args": {"stream": 20}},
        {"ph": "X", "cat": "gpu_memset", "name": "d", "ts": 20 * ms, "dur": 1 * ms, "args": {"stream": 20}},
    ]
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = trainer_bench.trace_summary(str(path), steps=1)
    assert s["compute_idle_ms"] == pytest.approx(5.0) and s["side_stream_ms"] == pytest.approx(11.0)
    assert s["side_stream_hidden"] == pytest.approx(6.0 / 11.0)


def test_bad_arguments_name_the_flag():
    with pytest.raises(SystemExit):
        trainer_bench.parse_args(["--draft-config", DRAFTER, "--work", "w", "--out", "o", "--modes", "csbp,bogus"])
    with pytest.raises(SystemExit):
        trainer_bench.parse_args(["--draft-config", DRAFTER, "--work", "w", "--out", "o", "--steps", "3",
                                  "--warmup", "2", "--profile-steps", "1"])  # fmt: skip


def test_the_plugins_keep_logits_choice_is_read_from_its_start_up_line():
    gpu = ("specforge-csbp: csbp.keep_logits_gib auto -> 0.0 GiB (free 62.3 GiB, predicted step 51.1 GiB, this "
           "rank's logits 3.6 GiB: recomputed)\nstep 1: {}")  # fmt: skip
    assert trainer_bench.keep_logits_choice(gpu) == "recomputed"
    assert trainer_bench.keep_logits_choice(gpu.replace("0.0 GiB", "17.9 GiB").replace("recomputed", "kept")) == "kept"
    assert trainer_bench.keep_logits_choice("specforge-csbp: csbp.keep_logits_gib auto -> 0 (no GPU: recomputed)") == "recomputed"
    assert trainer_bench.keep_logits_choice("step 1: {'loss': 1.0}") is None  # stock SpecForge: no such line


def test_first_and_later_pass_steps():
    """8 samples, 2 passes, steps 1-2 compile, 2 profiled: the first pass is steps 3-8, the later pass 10-14
    (9 starts an epoch, 15-16 are profiled)."""
    args = trainer_bench.parse_args(["--draft-config", DRAFTER, "--work", "w", "--out", "o", "--passes", "2",
                                     "--profile-steps", "2"])  # fmt: skip
    assert (args.samples, args.steps, args.warmup) == (8, 16, 2)
    assert trainer_bench.first_pass_steps(args) == list(range(3, 9))
    assert trainer_bench.later_pass_steps(args) == list(range(10, 15))
    assert trainer_bench.epoch_first_steps(args) == [9]
    assert trainer_bench.p90([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]) == pytest.approx(10.0)
    one = trainer_bench.parse_args(["--draft-config", DRAFTER, "--work", "w", "--out", "o"])
    assert one.steps == 8 and trainer_bench.later_pass_steps(one) == []  # the default: one pass
    for bad in ("full", "", "lazy,,trust"):
        with pytest.raises(SystemExit):
            trainer_bench.parse_args(["--draft-config", DRAFTER, "--work", "w", "--out", "o", "--store-verify", bad])
    # a value may repeat (the pair alternated in one invocation): each launch logs to its own file
    alt = trainer_bench.parse_args(["--draft-config", DRAFTER, "--work", "w", "--out", "o/r.jsonl",
                                    "--store-verify", "trust,lazy,trust,lazy", "--context", "64K"])  # fmt: skip
    paths = {trainer_bench.launch_log_path(alt, "csbp", v, f"-{k}")
             for k, v in enumerate(alt.store_verify.split(","), 1)}  # fmt: skip
    assert len(paths) == 4 and os.path.basename(sorted(paths)[0]) == "csbp-2_64K_cold-cache.log"


@pytest.mark.slow(reason="both trainers on the same bytes, each a 2-rank launch")
def test_both_trainers_on_identical_bytes(tmp_path):
    work, out = tmp_path / "work", tmp_path / "rec.jsonl"
    rc = trainer_bench.main([
        "--draft-config", DRAFTER, "--no-dflash2", "--context", "256", "--samples", "3", "--passes", "2",
        "--warmup", "1", "--profile-steps", "1", "--anchors", "8", "--work", str(work), "--out", str(out),
        "--trace-dir", str(tmp_path / "traces"), "--keep-data", "--store-verify", "trust,lazy", "--cache", "cold",
        "--fadvise-only",
    ])  # fmt: skip
    assert rc == 0
    recs = {(r["mode"], r.get("store_verify")): r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs, key=str) == [("csbp", "lazy"), ("csbp", "trust"), ("specforge", None)]
    # the plugin's launches run in the order --store-verify gives them
    assert (recs["csbp", "trust"]["verify_launch"], recs["csbp", "lazy"]["verify_launch"]) == (1, 2)
    assert len({r["launch"] for r in recs.values()}) == 1  # one launch: its records pair side by side
    sizes = {d: [f.stat().st_size for f in sorted((work / d).rglob("*")) if f.suffix in (".ckpt", ".safetensors")]
             for d in ("records", "store")}  # fmt: skip
    for (mode, verify), r in recs.items():
        folder = trainer_bench.run_name(mode, verify or "lazy")
        assert r["status"] == "ok" and r["block_size"] == 4 and r["trained_config"] == "quickstart_drafter-as-dflash"
        assert r["workload"] == "trainer-quickstart_drafter-as-dflash-cold-cache" + ("-store-trust" if verify == "trust" else "")
        assert r["world_size"] == 1 and r["context_len"] == 256 and r["timed_steps"] == 2
        # the trainer's own log: step 1 compiles, 2-3 are the first pass, 4 starts the second, 5 is the later
        # pass's one timed step, 6 is profiled
        # (streamed beside the records file, so a launch a scenario's limit stops still leaves its log)
        log = tmp_path / "trainer_logs" / f"{folder}_256_cold-cache.log"
        logged = trainer_bench.step_metrics(log.read_text())
        assert r["launch_s"] > 0
        assert sorted(logged) == [1, 2, 3, 4, 5, 6]
        ms = {s: logged[s]["perf/optimizer_step_time_s"] * 1e3 for s in logged}
        first = [ms[2], ms[3]]
        assert r["first_pass_steps"] == [2, 3] and r["later_pass_steps"] == [5] and r["left_out_steps"] == [1]
        assert r["step_ms"] == pytest.approx(statistics.median(first), abs=0.01) == r["first_pass_step_ms"]
        assert r["first_pass_p90_ms"] == pytest.approx(trainer_bench.p90(first), abs=0.01) and max(first) >= r["first_pass_p90_ms"]
        assert r["later_pass_step_ms"] == pytest.approx(ms[5], abs=0.01)
        assert r["first_vs_later"] == pytest.approx(statistics.median(first) / ms[5], rel=1e-3)
        assert r["epoch_first_step_ms"] == pytest.approx(ms[4], abs=0.01) and r["profiled_steps"] == [6]
        assert r["page_cache"] == "cold" and r["cache_prepared_by"] == "posix_fadvise DONTNEED"
        # the bytes a step reads: one sample's file (one rank reads every row), the rate that needs, the disk's
        data = sizes["records" if mode == "specforge" else "store"]
        assert r["data_bytes_per_step"] == round(sum(data) / len(data))
        assert r["read_gbps_needed"] == pytest.approx(r["data_bytes_per_step"] / (r["first_pass_step_ms"] / 1e3) / 1e9, rel=1e-2)
        best = max(r["disk_read_gbps"], r["disk_read_gbps_parallel"])
        assert r["disk_read_gbps"] > 0 and r["disk_read_gbps_parallel"] > 0
        # bound: the step's bytes at the disk's best rate take longer than the step with them in memory
        assert r["read_ms_at_disk_rate"] == pytest.approx(r["data_bytes_per_step"] / best / 1e6, rel=1e-2)
        assert r["read_bound"] == (r["read_ms_at_disk_rate"] > r["later_pass_step_ms"])
        assert r["peak_mem_gib"] > 0
        # no GPU: no free memory to record, and the plugin recomputes its logits (its start-up line says so)
        assert r.get("gpu_free_gib") is None  # (a record leaves out what is None)
        assert r.get("keep_logits") == ("recomputed" if mode == "csbp" else None)
        b = r["breakdown_ms"]
        assert set(b) == {"data", "forward_backward", "optimizer", "host_syncs", "logging"}
        assert b["optimizer"] > 0 and b["forward_backward"] > 0
        assert (tmp_path / "traces" / f"trainer_{folder}_256.trace.json.gz").exists()
        assert not (work / folder / "output").exists()  # checkpoints deleted even with --keep-data
    # identical bytes: every imported sample is the record SpecForge trained on
    from specforge_csbp.data.store import FeatureStore

    store = FeatureStore(str(work / "store"))
    for i in range(3):
        raw = torch.load(work / "records" / "rows_0-2000" / f"data_{i:06d}.ckpt", weights_only=True)
        ids, mask = store.read_tokens(f"{i:08d}")
        assert torch.equal(ids, raw["input_ids"]) and torch.equal(mask, raw["loss_mask"])
        assert torch.equal(store.read_intervals(f"{i:08d}", [(0, 256)]), raw["hidden_states"][0])
    # a later launch trains on the same store (csbp only: the records could have gone)
    rc = trainer_bench.main(["--draft-config", DRAFTER, "--no-dflash2", "--modes", "csbp", "--context", "256",
                             "--samples", "3", "--anchors", "8", "--work", str(work), "--out", str(out),
                             "--reuse-data", "--cache", "warm"])  # fmt: skip
    assert rc == 0
    last = json.loads(out.read_text().splitlines()[-1])
    assert last["launch"] != recs["csbp", "lazy"]["launch"]  # a later launch is a newer measurement
    assert last["workload"] == "trainer-quickstart_drafter-as-dflash-warm-cache"
    assert last["page_cache"] == "warm" and last["first_pass_steps"] == [3] and last["left_out_steps"] == [1, 2] and "later_pass_step_ms" not in last
    assert not (work / "store").exists() and not (work / "records").exists()  # no --keep-*: the data went
    with pytest.raises(SystemExit, match="--reuse-data: neither .* is left"):
        trainer_bench.main(["--draft-config", DRAFTER, "--no-dflash2", "--modes", "csbp", "--context", "256",
                            "--samples", "3", "--work", str(work), "--out", str(out), "--reuse-data"])  # fmt: skip
    with pytest.raises(SystemExit, match="--reuse-data"):
        trainer_bench.main(["--draft-config", DRAFTER, "--modes", "csbp", "--context", "512", "--samples", "3",
                            "--work", str(work), "--out", str(out), "--reuse-data"])  # fmt: skip


def test_a_dflash2_drafter_trains_under_csbp_and_stock_is_refused(tmp_path):
    """A DFlash2 config: `specforge train --csbp` runs it (strategy dflash2 -> the plugin's dflash2-csbp);
    stock SpecForge 0.2.0 cannot, so --modes specforge without --no-dflash2 stops with one line first."""
    work, out = tmp_path / "work", tmp_path / "rec.jsonl"
    with pytest.raises(SystemExit, match="trains plain DFlash only.*add --no-dflash2"):
        trainer_bench.main(["--draft-config", DRAFTER, "--context", "256", "--work", str(work), "--out", str(out)])
    assert not out.exists()
    rc = trainer_bench.main([
        "--draft-config", DRAFTER, "--modes", "csbp", "--context", "256", "--samples", "2", "--steps", "3",
        "--warmup", "1", "--profile-steps", "0", "--anchors", "8", "--work", str(work), "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    (rec,) = map(json.loads, out.read_text().splitlines())
    assert rec["status"] == "ok" and rec["mode"] == "csbp" and rec["dflash2"] is True
    assert rec["workload"] == "trainer-quickstart_drafter-cold-cache"

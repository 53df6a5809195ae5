"""benchmarks/train_bdlm_bench.py reads train-bdlm's own step lines into one record per recipe."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_bdlm_bench  # noqa: E402

from specforge_csbp.training.metrics import format_step  # noqa: E402


def test_step_lines_are_read_back_as_the_trainer_wrote_them():
    metrics = {"loss": 2.5, "lr": 1e-4, "grad_norm": 0.7, "tokens_per_s": 12345.6, "mfu": 0.2512,
               "peak_mem_gib": 41.25, "step_s": 5.301}  # fmt: skip
    text = "noise\n" + format_step(3, 5, metrics) + "\n" + format_step(4, 5, {**metrics, "mfu": None}) + "\n"
    steps = train_bdlm_bench.parse_steps(text)
    assert steps == [
        {"step": 3, "tokens_per_s": 12346.0, "mfu": 0.251, "peak_mem_gib": 41.25, "step_s": 5.301},
        {"step": 4, "tokens_per_s": 12346.0, "mfu": None, "peak_mem_gib": 41.25, "step_s": 5.301},
    ]


def test_a_tiny_recipe_gives_one_record_of_the_timed_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bdlm.jsonl"
    rc = train_bdlm_bench.main(["--recipe", str(ROOT / "examples/bdlm_sft_gemma3_tiny.yaml"), "--steps", "3",
                                "--warmup", "1", "--out", str(out), "--", "parallel.world_size=1",
                                "parallel.cp_degree=1"])  # fmt: skip
    assert rc == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["workload"] == "sft" and record["mode"] == "reference" and record["status"] == "ok"
    assert record["model"] == "gemma3_text" and record["context_len"] == 64 and record["block_size"] == 8
    assert [s["step"] for s in record["steps"]] == [1, 2, 3]
    timed = sorted(s["step_s"] for s in record["steps"][1:])
    assert record["step_ms"] == (timed[0] + timed[1]) / 2 * 1e3  # the median of steps 2 and 3


def test_a_failed_run_is_classified_by_the_trainers_own_error_line():
    rank_oom = ("[rank0]:   File \"specforge_csbp/training/step.py\", line 177, in train_step\n"
                "[rank0]: specforge_csbp.training.step.StepOutOfMemory: step 1: out of device memory on at least one rank\n"
                "Traceback (most recent call last):\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")  # fmt: skip
    status, error = train_bdlm_bench.classify(rank_oom, 1)
    assert status == "oom" and error.endswith("StepOutOfMemory: step 1: out of device memory on at least one rank")
    assert train_bdlm_bench.classify("torch.OutOfMemoryError: CUDA out of memory. Tried", 1)[0] == "oom"
    status, error = train_bdlm_bench.classify("specforge-csbp train-bdlm: error: data.max_length: must be > 0\n", 2)
    assert status == "error" and error == "specforge-csbp train-bdlm: error: data.max_length: must be > 0"
    assert train_bdlm_bench.classify("step 1/5 ...\ntimeout: no exit within 9 s\n", None) == (
        "error", "timeout: no exit within 9 s")
    assert train_bdlm_bench.classify("anything", 0) == ("ok", None)


def test_the_trainers_whole_output_is_kept_beside_the_records(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bdlm.jsonl"
    rc = train_bdlm_bench.main(["--recipe", str(ROOT / "examples/bdlm_sft_gemma3_tiny.yaml"), "--steps", "2",
                                "--warmup", "1", "--timeout", "1", "--out", str(out), "--",
                                "parallel.world_size=1", "parallel.cp_degree=1"])  # fmt: skip
    assert rc == 1  # a run cut by --timeout: no step line, the record says why and where the output is
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    log = Path(record["log"])
    assert record["status"] == "error" and record["error"] == "timeout: no exit within 1 s"
    assert log == tmp_path / "bdlm_bdlm_sft_gemma3_tiny.log" and log.read_text().startswith("+ ")

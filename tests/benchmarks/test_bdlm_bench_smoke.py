"""benchmarks/bdlm_bench.py --smoke runs every mode on 2 CPU gloo ranks and writes valid shared records
- here without pydantic installed (as on the GPU machines), so the fallback writer is what is checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specforge_csbp.bench.provenance import library_digest
from specforge_csbp.bench.records import load_records

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke_writes_records_without_pydantic(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pydantic.py").write_text("raise ImportError('pydantic is hidden for this test')\n")
    out = tmp_path / "bdlm.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bdlm_bench.py"),
            "--smoke",
            "--contexts",
            "32",
            "--out",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r.mode: r for r in load_records(out)}
    assert sorted(records) == ["bp", "cp", "csbp", "dp", "reference"]
    for mode, r in records.items():
        extra = r.model_extra
        assert r.status == "ok" and r.workload == "sft" and r.context_len == 32 and r.block_size == 4
        assert r.world_size == (1 if mode == "reference" else 2)
        assert r.step_ms > 0 and r.tokens_per_s > 0 and r.peak_mem_gib > 0
        assert extra["mlp_ms"] > 0 and extra["loss_ms"] > 0 and extra["attention_ms"] > 0  # the spans fired
        assert (extra["attn_comm_gib_per_step"] > 0) == (mode in ("csbp", "cp"))  # only these gather K/V
        assert ("scaling_efficiency" in extra) == (mode != "reference")
        assert extra["code"] == library_digest()  # the library code that ran (bench/provenance.py)
    assert records["dp"].tokens_per_s > 0 and "Qwen3" not in records["dp"].model_extra["model"]


def test_bench_smoke_runs_the_gpu_model_configs(tmp_path):
    """The Gemma-3 and Qwen3-MoE configs of the GPU runs, at tiny width on CPU: sliding + full layers, the
    router's aux loss on (the config's output_router_logits), one mode each."""
    for name, mode in (("gemma3-1b-shape", "csbp"), ("qwen3-moe-3b-a0.7b-shape", "bp")):
        out = tmp_path / f"{name}.jsonl"
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "bdlm_bench.py"), "--smoke", "--model-config",
             str(ROOT / "benchmarks" / "configs" / f"{name}.json"), "--modes", mode, "--contexts", "32",
             "--out", str(out)],
            check=False, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        (r,) = load_records(out)
        assert r.status == "ok" and r.mode == mode and r.model_extra["model"] == f"{name}-tiny"
        assert r.tokens_per_s > 0 and r.model_extra["attention_ms"] > 0

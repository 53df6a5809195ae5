"""benchmarks/eval_bench.py --smoke runs the GPU benchmark's code on CPU (tiny target, two short prompts) and
writes valid shared records of workload "eval" with the loop's own timings."""

from specforge_csbp.bench.provenance import library_digest
from tests.support.bench_smoke import run_bench_smoke


def test_eval_bench_smoke(tmp_path):
    records = run_bench_smoke("benchmarks/eval_bench.py", tmp_path / "eval.jsonl")
    assert [r.context_len for r in records] == [40, 100]
    for r in records:
        extra = r.model_extra or {}
        assert r.workload == "eval" and r.status == "ok" and r.block_size == 4
        assert extra["prefill_s"] > 0 and extra["verify_steps_per_s"] > 0 and r.step_ms > 0
        assert extra["generated_tokens"] == 8 and 1 <= extra["verify_steps"] <= 7
        assert 1.0 <= extra["tau"] <= 4.0
        assert extra["code"] == library_digest()

"""benchmarks/flex_layer_bench.py runs every variant's code path on CPU at a small size: the seam variants in
one process (eager FlexAttention, forward), the executor variants on 2 gloo ranks through torchrun."""

import re
import subprocess
import sys

from tests.support.bench_smoke import ROOT

# 1K of context: every variant's code path and query / key row counts at a few seconds each (eager flex on CPU
# grows with the square of the rows: 4K took minutes for the 2L bdlm call)
CONTEXT = 1024
ARGS = ["benchmarks/flex_layer_bench.py", "--shape", "a", "--context", str(CONTEXT), "--anchors", "16", "--iters",
        "1", "--warmup", "0"]  # fmt: skip
LINE = re.compile(r"^(\S+)\s+q\s+(\d+) k\s+(\S+) pack_gqa .* fwd\+bwd\s+([\d.]+) ms$", re.M)


def _run(cmd):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {m.group(1): m for m in LINE.finditer(proc.stdout)}


def test_seam_variants_run_on_cpu():
    variants = ["cp:static", "csbp:dynamic+divisible", "csbp:static+split", "csbp:static+rev+nopack"]
    lines = _run([sys.executable, *ARGS, "--variants", ",".join(variants)])
    assert set(lines) == set(variants)
    assert "+" in lines["csbp:static+split"].group(3)  # two calls: local keys + the other rank's keys
    assert lines["cp:static"].group(2) == str(16 * 16)  # CP: every anchor's block on every rank
    assert int(lines["csbp:static+rev+nopack"].group(2)) < 16 * 16  # CSBP: this rank's own blocks


def test_executor_variants_run_on_two_gloo_ranks():
    variants = ["cp:static+executor", "csbp:static+executor"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *ARGS,
           "--variants", ",".join(variants)]  # fmt: skip
    lines = _run(cmd)
    assert set(lines) == set(variants)


def test_bdlm_call_with_kernel_options_runs_on_cpu():
    """Mode bdlm times the full BDLM's 2L call (every clean and corrupted row on one rank); kernel options
    given as +NAME=VALUE reach the call (eager flex on CPU accepts and ignores them)."""
    variants = ["bdlm:static+divisible", "bdlm:static+divisible+USE_TMA=1+fwd_num_stages=2"]
    lines = _run([sys.executable, *ARGS, "--block-size", "32", "--variants", ",".join(variants)])
    assert set(lines) == set(variants)
    for m in lines.values():
        assert m.group(2) == m.group(3) == str(2 * CONTEXT)  # 2L query rows over 2L key rows


def test_variant_options_parse():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from flex_layer_bench import parse_variant

    mode, how, extra = parse_variant("bdlm:static+divisible+USE_TMA=1+fwd_BLOCK_N=128+bwd_USE_TMA=0")
    assert (mode, extra) == ("bdlm", {"USE_TMA": True, "fwd_BLOCK_N": 128, "bwd_USE_TMA": False})
    assert "divisible" in how

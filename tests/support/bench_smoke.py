"""Run a benchmark script's --smoke mode in a fresh process and load the records it wrote."""

import subprocess
import sys
from pathlib import Path

from specforge_csbp.bench.records import BenchRecord, load_records

ROOT = Path(__file__).resolve().parents[2]


def run_bench_smoke(script: str, out: Path, *args: str, timeout: int = 600) -> list[BenchRecord]:
    proc = subprocess.run([sys.executable, script, "--smoke", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return load_records(out)

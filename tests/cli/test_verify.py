"""`specforge-csbp verify` end to end (spawns gloo ranks) and its one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from specforge_csbp.cli.verify import _report
from specforge_csbp.distributed import spawn
from specforge_csbp.layout import bdlm_plan
from specforge_csbp.parallel import ShardedAttention
from specforge_csbp.parallel.check import CheckCase, CheckResult


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "specforge_csbp", "verify", *args], capture_output=True, text=True, timeout=300
    )


def test_verify_passes_and_reports_each_tensor_and_bytes():
    res = cli("--mode", "csbp", "--world-size", "2", "--seq-len", "40", "--block-size", "8", "--heads", "4",
              "--kv-heads", "2", "--head-dim", "8")  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for name in ("out", "lse", "dq", "dk", "dv"):
        line = next(ln for ln in lines if ln.strip().startswith(name + " "))
        assert "ok" in line and float(line.split("max_rel_err=")[1].split()[0]) <= 1e-10
    assert sum("sent" in ln and "all_gather" in ln for ln in lines) == 2
    assert lines[-1] == "verify: PASS"


def test_verify_fails_with_exit_1_when_an_error_is_over_tolerance(capsys):
    case = CheckCase("csbp", 16, 4)
    bad = CheckResult({"out": 0.0, "lse": 0.0, "dq": 1e-6, "dk": 0.0, "dv": 0.0}, [{}], 1e-10)
    assert _report(case, 1, bad) == 1
    assert "dq   max_rel_err=1.000e-06" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seq-len", "24", "--block-size", "8", "--world-size", "4"], "3 blocks < world_size = 4"),
        (["--seq-len", "30", "--block-size", "8"], "seq_len must be a positive multiple of block_size=8"),
        (["--heads", "6", "--kv-heads", "4"], r"heads \(6\) must be a multiple of kv_heads \(4\)"),
    ],
)
def test_verify_bad_input_is_one_line_naming_the_argument(args, message):
    res = cli(*args)
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and __import__("re").search(message, err[0]), res.stderr


def _mismatch_worker(rank, world, out_dir):
    plan = bdlm_plan("csbp", 24, 4, 3)[rank]
    try:
        ShardedAttention(plan, 4)
    except ValueError as err:
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(str(err), f)


def test_world_size_mismatch_between_plan_and_group_is_named(tmp_path):
    spawn(_mismatch_worker, 2, str(tmp_path))
    for rank in range(2):
        msg = json.loads((tmp_path / f"{rank}.json").read_text())
        assert msg == "world_size: plan has 3 ranks, process group has 2"

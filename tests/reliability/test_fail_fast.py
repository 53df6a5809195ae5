"""Fail fast: when a rank crashes or hangs, every rank exits non-zero within the configured timeout, the
error names the failed rank, and no process (rank, or anything a rank started) is left behind.

    crash   rank 1 raises at step 2 of 5 (each step ends in an all-reduce)      -> RankFailure(rank 1)
    hang    rank 1 sleeps in the forward of step 2 of a real training run
            (timeout 4 s): rank 0 waits in the attention all-gather              -> "rank 1 hung: ..."
    torchrun  the same hang under `torchrun --standalone --nproc-per-node 2` (gloo): the watchdog started
            by init_from_env makes the ranks exit 124 naming rank 1, and torchrun stops the job
    (SIGKILL of a rank and of the saving rank: tests/reliability/test_exact_resume.py)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from specforge_csbp.distributed import spawn
from specforge_csbp.distributed.launch import HANG_EXIT_CODE, RankFailure, hang_report, heartbeat
from tests.support.reliability_runs import all_gone, run_recipe


def _record_pids(out: str, rank: int) -> None:
    child = subprocess.Popen(["sleep", "120"])  # something the rank started: must die with it
    with open(os.path.join(out, f"pids{rank}"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")


def _pids(out) -> list[int]:
    return [
        int(p)
        for f in sorted(os.listdir(out))
        if f.startswith("pids")
        for p in open(os.path.join(out, f)).read().split()
    ]


def _crash(rank, world, out):
    _record_pids(out, rank)
    t = torch.ones(1)
    for step in range(5):
        heartbeat(f"step {step}")
        if step == 2 and rank == 1:
            raise RuntimeError("injected failure")
        dist.all_reduce(t)


def _hang(rank, world, out):
    _record_pids(out, rank)
    run_recipe(["train.steps=3", f"train.output_dir={out}/run"], fault={"kind": "hang", "rank": 1, "step": 1})


def test_a_crashing_rank_stops_every_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        spawn(_crash, 3, str(tmp_path), timeout_s=60)
    assert time.monotonic() - start < 60
    assert err.value.rank == 1 and err.value.kind == "exception"
    assert str(err.value).startswith("rank 1 failed: RuntimeError: injected failure")
    pids = _pids(tmp_path)
    assert len(pids) == 6
    assert all_gone(pids), pids


def test_a_hung_rank_is_named_and_every_rank_stops_within_the_timeout(tmp_path):
    timeout = 4.0
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        spawn(_hang, 2, str(tmp_path), timeout_s=timeout)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert err.value.rank == 1 and err.value.kind == "hang", message
    assert len(message.splitlines()) == 1
    assert message.startswith("rank 1 hung: rank 0 waited"), message
    assert "at step 2: micro batch 0 forward/backward" in message  # where both ranks were, from heartbeats
    assert "rank 1 was not in one" in message
    assert elapsed < 60, elapsed
    pids = _pids(tmp_path)
    assert len(pids) == 4 and all_gone(pids), pids
    assert (tmp_path / "run" / "latest").read_text() == "step_00000001"  # the last good checkpoint stands


TORCHRUN_SCRIPT = """
    import sys, time, torch, torch.distributed as dist
    from specforge_csbp.distributed.launch import heartbeat, init_from_env
    rank, world = init_from_env(timeout_s=3.0)
    t = torch.ones(1)
    for step in range(4):
        heartbeat(f"step {step}")
        if step == 2 and rank == 1:
            time.sleep(120)
        dist.all_reduce(t)
"""


def test_a_hung_rank_under_torchrun_is_named(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        check=False, capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specforge-csbp: rank")]
    assert lines, proc.stderr[-3000:]
    assert all(": rank 1 hung: rank 0 waited" in line and "(at step 2)" in line for line in lines), lines
    # the exit torchrun reports is the first worker's to end: the watchdog's 124, or, on a loaded machine, the
    # waiting rank's own collective timeout (gloo aborts: SIGABRT) when it fires a moment before the watchdog
    assert "exitcode: 124" in proc.stderr or "Signal 6 (SIGABRT)" in proc.stderr, proc.stderr[-3000:]


def _status(progress, wait, label="step 1", done=False, stale=False, ready=True, in_collective=None):
    return {
        "progress": progress, "wait": wait, "label": label, "where": "x.py:1 in f", "done": done, "stale": stale,
        "ready": ready, "in_collective": wait > 0 if in_collective is None else in_collective,
    }  # fmt: skip


def test_hang_report_names_the_rank_that_is_not_waiting():
    w = {0: _status(5, 9.0), 1: _status(4, 0.0, "step 1: forward"), 2: _status(5, 2.0)}
    hung, msg = hang_report(w, 3, 5.0)
    assert (
        hung == [1] and msg.startswith("rank 1 hung: rank 0 waited 9.0 s") and "rank 1 was not in one" in msg
    )
    assert hang_report({0: _status(5, 4.9), 1: _status(4, 0.0)}, 2, 5.0) is None  # not yet
    assert hang_report({0: _status(5, 9.0)}, 2, 5.0) is None  # rank 1 has not started: rendezvous
    assert hang_report({0: _status(5, 9.0), 1: _status(0, 0.0, ready=False)}, 2, 5.0) is None
    # everyone waits: the least progress is the culprit; level progress is a mismatch of collectives
    hung, msg = hang_report({0: _status(5, 9.0), 1: _status(4, 7.0), 2: _status(5, 8.0)}, 3, 5.0)
    assert hung == [1] and "made the least progress" in msg
    hung, msg = hang_report({0: _status(5, 9.0), 1: _status(5, 7.0)}, 2, 5.0)
    assert hung == [0, 1] and msg.startswith("every rank waited")
    # a finished rank and a silent one are named as such
    hung, msg = hang_report(
        {0: _status(5, 9.0), 1: _status(6, 0.0, done=True), 2: _status(5, 3.0, stale=True)}, 3, 5.0
    )
    assert hung == [1, 2] and "rank 1 had finished" in msg and "rank 2 stopped responding" in msg
    # a rank that has just entered the collective (blocked 0 s so far) is not blamed
    hung, _ = hang_report(
        {0: _status(5, 9.0), 1: _status(4, 0.0), 2: _status(5, 0.0, in_collective=True)}, 3, 5.0
    )
    assert hung == [1]
    assert HANG_EXIT_CODE != 0

"""Faults in a drafter run (`specforge train --csbp`, SpecForge 0.2.0's loop, 2 gloo ranks, cp_size 2):

    nan loss    rank 1, step 3   -> every rank raises NonFiniteError naming rank 1 and `loss numerator`
                                    (rank 0 "also": the NaN reaches its gradients through the attention);
                                    the step-2 checkpoint is the last one and equals an unpoisoned run's
    inf grad    rank 0, step 1   -> named before DDP's all-reduce: rank 0 and the parameter; nothing saved
    crash       rank 1, step 2   -> every rank exits within 60 s (a few seconds), the crashed rank's own
                                    `[rank1]:` line names it, the launcher's last line is that rank's one
                                    line (no torchrun report), no process of the run is left

The faults come from the test-only sitecustomize of tests/reliability/test_drafter_resume.py.
"""

from __future__ import annotations

import os
import re
import time

import torch

from tests.reliability.test_drafter_resume import RUN_ID, build_run, draft_weights, specforge_train


def _left_behind(mark: str) -> list[int]:
    """Pids of live processes started with CSBP_TEST_MARK=mark (the run's torchrun and workers)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"CSBP_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def _text(done) -> str:
    return done.stdout + done.stderr


def test_nonfinite_loss_or_gradient_stops_every_rank_and_keeps_the_checkpoint(tmp_path):
    build_run(tmp_path, steps=3, save_interval=2)
    done = specforge_train(["-c", "run.yaml", "output_dir=nan"], tmp_path, fault="nan:1:3:loss")
    text = _text(done)
    assert done.returncode != 0
    line = (
        "step 3: non-finite value on rank 1 (also on rank 0): first offending tensor loss numerator (nan); the "
        "step was not "
        "applied (weights, optimizer state and checkpoints are those of step 2)"
    )
    # raised on both ranks (rank 0 is "also" named: the NaN reached its gradients through the sharded
    # attention's backward, after rank 1's loss); one line, the launcher's last, and no rank's traceback
    assert done.stderr.strip().splitlines()[-1] == f"specforge train: error: {line}", done.stderr[-4000:]
    assert text.count(line) == 1 and "NonFiniteError" not in text and "[rank" not in text, text[-4000:]
    latest = os.path.realpath(tmp_path / "nan" / f"{RUN_ID}-latest")
    assert latest.endswith(f"{RUN_ID}-step2") and not (tmp_path / "nan" / f"{RUN_ID}-step3").exists()
    clean = specforge_train(["-c", "run.yaml", "output_dir=clean"], tmp_path)  # the same run, unpoisoned
    assert clean.returncode == 0, _text(clean)[-3000:]
    got, want = draft_weights(latest), draft_weights(tmp_path / "clean" / f"{RUN_ID}-step2")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    param = "layers.1.mlp.down_proj.weight"
    done = specforge_train(["-c", "run.yaml", "output_dir=inf"], tmp_path, fault=f"nan:0:1:{param}")
    text = _text(done)
    assert done.returncode != 0
    assert re.search(
        rf"step 1: non-finite value on rank 0: first offending tensor draft_model\.{re.escape(param)}\.grad "
        r"\(\d+ nan, \d+ inf of \d+\); the step was not applied",
        text,
    ), text[-4000:]
    assert not any(p.name.startswith(f"{RUN_ID}-step") for p in (tmp_path / "inf").glob("*"))


def test_a_crashed_rank_stops_every_rank_and_is_named(tmp_path):
    build_run(tmp_path, steps=3, save_interval=0)
    start = time.monotonic()
    done = specforge_train(["-c", "run.yaml", "output_dir=crash"], tmp_path, fault="raise:1:2", timeout=60)
    elapsed = time.monotonic() - start
    text = _text(done)
    assert done.returncode != 0 and elapsed < 60
    assert "RuntimeError: injected crash" in text
    # the crashed rank is named by its own line (its traceback: a bug), the launcher prints that rank's one
    # line last (relay.py), torchrun's ChildFailedError report is gone (distributed/torchrun.py), and no
    # process of the run is left: every rank exited
    assert "[rank1]: RuntimeError: injected crash" in text, text[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "specforge train: error: rank 1: RuntimeError: injected crash (unexpected: the rank's traceback is above; "
        "exit code 1)"
    ), done.stderr[-2000:]
    assert "ChildFailedError" not in text and "Root Cause" not in text, text[-3000:]
    assert _left_behind(str(tmp_path)) == []


def test_one_rank_names_a_nonfinite_gradient_and_applies_nothing(tmp_path):
    """One rank has nothing to all-reduce (its DDP hook passes the gradients through): the optimizer's own
    gradient norms decide, the update it queued is skipped on the device, and the error names the tensor as on
    several ranks; no checkpoint is written."""
    build_run(tmp_path, steps=2, save_interval=1)
    param = "layers.0.self_attn.q_proj.weight"
    one_rank = ["deployment.trainer.nproc_per_node=1", "csbp.cp_size=1"]
    done = specforge_train(["-c", "run.yaml", "output_dir=inf", *one_rank], tmp_path, fault=f"nan:0:1:{param}")
    text = _text(done)
    assert done.returncode != 0
    assert re.search(
        rf"step 1: non-finite value on rank 0: first offending tensor draft_model\.{re.escape(param)}\.grad "
        r"\(\d+ nan, \d+ inf of \d+\); the step was not applied",
        done.stderr.strip().splitlines()[-1],
    ), text[-4000:]
    assert not any(p.name.startswith(f"{RUN_ID}-step") for p in (tmp_path / "inf").glob("*"))

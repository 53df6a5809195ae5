"""A fault inside a rank of `train-bdlm` ends as one clear line and every rank exits non-zero, on each path
that starts ranks (cli/train_bdlm.py):

    gloo ranks (spawn)      python -m specforge_csbp train-bdlm ... parallel.device=cpu       exit 2
    torchrun started here   run_torchrun(torchrun_command(...)) (what a GPU machine runs)     the rank's code
    the user's torchrun     python -m torch.distributed.run ... -m specforge_csbp train-bdlm  torchrun's

Faults are injected in the ranks by tests/support/fault_site/sitecustomize.py (on PYTHONPATH, read from
SPECFORGE_CSBP_TEST_FAULT=KIND:RANK:STEP): a CUDA out-of-memory error, a ValueError and a NaN loss on rank 1
are one line naming the fault and what to change, with no traceback; an unexpected KeyError keeps the rank's
traceback, and the launch ends in one line naming the rank, not in torchrun's ChildFailedError report.
DP 2 x CP 1 on 2 gloo ranks, so a rank's forward has no collective the fault would leave unmatched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specforge_csbp.distributed import relay
from specforge_csbp.errors import RunFault, is_user_error
from specforge_csbp.training.step import NonFiniteError, StepOutOfMemory, out_of_memory
from tests.support.spawned import one_rank_group

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "tests" / "support" / "fault_site"
SFT = str(ROOT / "examples" / "bdlm_sft_tiny.yaml")
PROG = "specforge-csbp train-bdlm:"
RUN = ["parallel.device=cpu", "parallel.world_size=2", "parallel.cp_degree=1", "train.steps=2",
       "train.progress=false", "data.max_length=32", "train.micro_batch_size=1"]  # fmt: skip
OOM = ("step 1: device out of memory on rank 1 (tried to allocate 2.00 GiB); set train.activation_checkpointing: "
       "true (now auto, which chose off), lower data.max_length (now 32) or objective.ce_chunk_size (now 4096), "
       "or add GPUs (parallel.cp_degree, now 1)")  # fmt: skip
NAN = "step 1: non-finite value on rank 1: first offending tensor loss numerator of micro batch 0 (nan)"
VALUE = "rank 1: data.path: injected.jsonl:3 has no records"
LAUNCH_HERE = ("import sys; from specforge_csbp.cli.train_bdlm import run_torchrun, torchrun_command; "
               "sys.exit(run_torchrun(torchrun_command(sys.argv[1], sys.argv[2:], 2)))")  # fmt: skip


def _run(path: str, fault: str, out: Path) -> tuple[int, str]:
    args = ["-c", SFT, *RUN, f"train.output_dir={out}"]
    cmd = {
        "spawn": [sys.executable, "-m", "specforge_csbp", "train-bdlm", *args],
        "here": [sys.executable, "-c", LAUNCH_HERE, SFT, *args[2:]],
        "user": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                 "-m", "specforge_csbp", "train-bdlm", *args],
    }[path]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{SITE}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "SPECFORGE_CSBP_TEST_FAULT": f"{fault}:1:0"}  # fmt: skip
    env.pop(relay.ENV, None)
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return proc.returncode, proc.stderr


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(PROG)]


@pytest.mark.parametrize(
    "path, fault, code, expected",
    [
        ("spawn", "oom", 2, OOM),
        ("here", "oom", 1, OOM),
        pytest.param("spawn", "value", 2, VALUE, marks=pytest.mark.slow),
        pytest.param("here", "nan", 1, NAN, marks=pytest.mark.slow),
    ],
    ids=["spawn-oom", "here-oom", "spawn-value", "here-nan"],
)
def test_a_known_fault_is_one_line_without_a_traceback(path, fault, code, expected, tmp_path):
    rc, err = _run(path, fault, tmp_path / "out")
    assert rc == code, err
    lines = _lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"{PROG} error: {expected}"), err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert "failed (exitcode" not in err and "closing signal" not in err, err  # torchrun's agent: quiet
    assert not (tmp_path / "out" / "step_00000001").exists()  # the failed step wrote nothing


def test_under_the_users_torchrun_rank_0_says_it_once(tmp_path):
    """torchrun's own report follows (the user's launcher), but no rank prints a traceback."""
    rc, err = _run("user", "oom", tmp_path / "out")
    assert rc == 1, err
    assert _lines(err) == [f"{PROG} error: {OOM}"], err
    assert "[rank0]" not in err and "[rank1]" not in err and "KeyError" not in err, err
    assert err.count("Traceback") == 1 and "ChildFailedError" in err, err  # torchrun's, after the line
    assert err.index(PROG) < err.index("Traceback")


@pytest.mark.parametrize("path", ["here", pytest.param("spawn", marks=pytest.mark.slow)])
def test_an_unexpected_error_keeps_the_ranks_traceback_and_ends_in_one_line(path, tmp_path):
    rc, err = _run(path, "bug", tmp_path / "out")
    assert rc == 1, err
    assert "KeyError: 'injected'" in err and "Traceback" in err, err  # the rank's (a bug)
    assert "ChildFailedError" not in err and "RankFailure" not in err, err  # not the launcher's
    (last,) = _lines(err)
    assert err.rindex(PROG) > err.rindex("Traceback"), err  # after the traceback
    assert last.startswith(f"{PROG} error: rank 1") and "KeyError: 'injected'" in last, last
    assert "unexpected: the rank's traceback is above" in last, last


# -- the pieces, in process ----------------------------------------------------------------------------------
def test_run_faults_are_the_users_and_the_relay_names_the_job_not_a_rank(tmp_path, monkeypatch):
    assert issubclass(StepOutOfMemory, RunFault) and issubclass(NonFiniteError, RunFault)
    assert is_user_error(StepOutOfMemory("x")) and not is_user_error(KeyError("x"))
    monkeypatch.setenv(relay.ENV, str(tmp_path))
    for rank in ("1", "0"):  # every rank raises the same RunFault; one job-wide line
        monkeypatch.setenv("RANK", rank)
        relay.record(StepOutOfMemory("step 3: device out of memory on rank 1"))
    monkeypatch.setenv("RANK", "0")
    relay.record(RuntimeError("Connection closed by peer"))
    assert sorted(os.listdir(tmp_path)) == ["job.txt", "rank0.txt"]
    assert relay.root_cause(str(tmp_path), 1) == "step 3: device out of memory on rank 1"
    (tmp_path / "job.txt").unlink()
    assert relay.root_cause(str(tmp_path), 1) == (
        "rank 0: RuntimeError: Connection closed by peer (unexpected: the rank's traceback is above; exit code 1)"
    )


def test_the_oom_line_names_the_rank_and_torchs_allocation():
    """... and says "out of memory", which the benchmark runners classify as status "oom"."""
    from specforge_csbp.bench.runner import classify_failure

    with one_rank_group():
        line = out_of_memory(4, "tried to allocate 2.00 GiB", None)
        assert line == "step 5: device out of memory on rank 0 (tried to allocate 2.00 GiB)"
        assert out_of_memory(0, "", None) == "step 1: device out of memory on rank 0"
    assert classify_failure(1, f"{PROG} error: {line}", False)[0] == "oom"


def test_the_advice_names_the_prediction_and_the_recipes_fields(monkeypatch):
    """On a GPU the line adds the memory model's prediction (here: the 1.7B shape at 16K on a mocked 139 GiB
    device) and, with checkpointing on for some layers, says how many."""
    import torch

    from specforge_csbp.training.checkpointing import CheckpointingChoice, bdlm_peaks
    from specforge_csbp.training.config import TrainConfig
    from specforge_csbp.training.trainer import _out_of_memory_advice
    from tests.training.test_activation_checkpointing_auto import _run

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 139 * 2**30))
    workload, model, ctx = _run(16384)
    recipe = {"data": {"max_length": 16384}, "objective": {"ce_chunk_size": 4096}}
    peaks = bdlm_peaks(workload, model, ctx)
    off = CheckpointingChoice(False)
    assert _out_of_memory_advice(workload, model, ctx, TrainConfig(), recipe, off) == (
        f"predicted peak {peaks.none:.1f} GiB of 139.0 GiB; set train.activation_checkpointing: true (now auto, "
        "which chose off), lower data.max_length (now 16384) or objective.ce_chunk_size (now 4096), or add GPUs "
        "(parallel.cp_degree, now 1)"
    )
    layers = model.config.num_hidden_layers
    train = TrainConfig(micro_batch_size=2)  # auto, which checkpointed all but the last 4 layers
    four = CheckpointingChoice(True, keep_layers=4, layers=layers)
    assert _out_of_memory_advice(workload, model, ctx, train, {}, four) == (
        f"predicted peak {peaks.peak(4):.1f} GiB of 139.0 GiB; set "
        f"train.activation_checkpointing: true (auto checkpointed {layers - 4} of {layers} layers), lower "
        "train.micro_batch_size (now 2), or add GPUs (parallel.cp_degree, now 1)"
    )
    kept = CheckpointingChoice(True, layers=layers, attention_layers=(20, 21, 22))  # auto kept 3 outputs
    assert _out_of_memory_advice(workload, model, ctx, train, {}, kept) == (
        f"predicted peak {peaks.peak(0, 3):.1f} GiB of 139.0 GiB; set train.recompute_attention: true (now auto, "
        "which kept 3 layers' outputs), lower train.micro_batch_size (now 2), or add GPUs (parallel.cp_degree, "
        "now 1)"
    )
    ctx.device = torch.device("cpu")  # no prediction off the GPU; every layer checkpointed: sizes and GPUs
    assert _out_of_memory_advice(workload, model, ctx, train, recipe, CheckpointingChoice(True)) == (
        "lower data.max_length (now 16384), objective.ce_chunk_size (now 4096) or train.micro_batch_size (now 2), "
        "or add GPUs (parallel.cp_degree, now 1)"
    )


def _train_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


#: every un-checkpointed step runs out of memory on rank 1, and auto sees a GPU with 1000 GiB (faked on the CPU)
OOM_UNLESS_CHECKPOINTED = {"SPECFORGE_CSBP_TEST_FAULT": "oom-full:1:0", "SPECFORGE_CSBP_TEST_MEMORY_GIB": "1000"}


def _train(out: Path, extra_env: dict, *overrides: str) -> subprocess.CompletedProcess:
    """`train-bdlm` on 2 gloo ranks (spawned by the CLI) with the fault site's variables in `extra_env`."""
    args = ["-m", "specforge_csbp", "train-bdlm", "-c", SFT, *RUN, f"train.output_dir={out}", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{SITE}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1", **extra_env}
    env.pop(relay.ENV, None)
    return subprocess.run([sys.executable, *args], check=False, env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip


def test_auto_decides_again_when_a_step_runs_out_of_memory(tmp_path):
    """`activation_checkpointing: auto` chose off from the memory model (here: 1000 GiB available, faked on
    the CPU); every step without checkpointing runs out of memory on rank 1. Every rank decides again with
    the model's peaks scaled up, checkpoints, and retries the step: the run finishes with the losses of a run
    that never ran out (checkpointing recomputes exactly)."""
    faulty = _train(tmp_path / "auto", OOM_UNLESS_CHECKPOINTED)
    assert faulty.returncode == 0, faulty.stdout[-3000:] + faulty.stderr[-3000:]
    out = faulty.stdout
    assert out.count("auto decides again") == 1, out
    assert "step 1: device out of memory on rank 1 (tried to allocate 4.00 GiB)" in out, out
    first, second = [line for line in out.splitlines() if "train.activation_checkpointing auto ->" in line]
    assert "auto -> off" in first and "auto -> on" in second and "after a step ran out of memory" in second, out
    reference = _train(tmp_path / "ref", {}, "train.activation_checkpointing=false")
    assert reference.returncode == 0, reference.stderr[-3000:]
    got, want = _train_log(tmp_path / "auto"), _train_log(tmp_path / "ref")
    assert [m["step"] for m in got] == [1, 2]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-6)


def test_nothing_smaller_left_stops_with_the_advice(tmp_path):
    """Explicit settings are never changed: with checkpointing off as set, the out-of-memory step stops the
    run with its one line, as before."""
    proc = _train(tmp_path / "out", OOM_UNLESS_CHECKPOINTED, "train.activation_checkpointing=false")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "auto decides again" not in proc.stdout
    (line,) = _lines(proc.stderr)
    assert line.startswith(f"{PROG} error: step 1: device out of memory on rank 1"), line
    assert "set train.activation_checkpointing: true (now false)" in line, line

"""benchmarks/scenarios.toml and its runner (bench/scenarios.py): every scenario builds its commands, a dry run
prints them and runs nothing, a real run executes each launch under its own limit, bad files fail in one line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from specforge_csbp.bench.processes import run_group
from specforge_csbp.bench.scenarios import BENCHES, build_command, load_scenarios, main, run_scenarios

ROOT = Path(__file__).resolve().parents[2]


def test_every_scenario_of_the_file_builds_commands_for_existing_scripts():
    scenarios = load_scenarios(ROOT / "benchmarks" / "scenarios.toml")
    assert {"drafter-27b", "drafter-27b-anchors2048", "drafter-8b", "drafter-27b-1gpu", "attention", "sft"} <= set(
        scenarios
    )
    for sc in scenarios.values():
        assert sc.description and sc.runs, sc.name
        for run in sc.runs:
            argv = build_command(run, "/o")
            script = BENCHES[run.bench][0]
            if script:
                assert script in argv and (ROOT / script).exists(), (sc.name, argv)
                assert argv[-2:] == ["--out", f"/o/{BENCHES[run.bench][1]}"]


def test_dry_run_prints_the_512k_comparison_and_runs_nothing(capsys):
    rc = main(["drafter-27b", "--contexts", "512K", "--dry-run", "--out", "/nowhere"])
    assert rc == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("#")]
    assert lines == ["torchrun --nproc-per-node=2 benchmarks/drafter_bench.py --shape a --modes cp,csbp,dp "
                     "--contexts 512K --anchors 512 --out /nowhere/drafter.jsonl"]  # fmt: skip
    assert not Path("/nowhere").exists()


def _write(tmp: Path, text: str) -> Path:
    path = tmp / "scenarios.toml"
    path.write_text(text)
    return path


def test_each_bench_spells_its_own_arguments(tmp_path):
    path = _write(tmp_path, """
[one]
description = "every kind"
gpus = 2
modes = ["cp", "csbp"]
runs = [
  { bench = "attention", contexts = ["64K", "32768"], args = ["--iters", "4"] },
  { bench = "bdlm", contexts = ["128K"], block_size = 32 },
  { bench = "drafter", gpus = 1, shape = "b", contexts = ["1M"], anchors = 512 },
  { bench = "sweep", workload = "sft", contexts = ["64K"], block_size = 32, args = ["--steps", "1"] },
  { bench = "command", command = "echo {out}" },
]
""")
    runs = load_scenarios(path)["one"].runs
    got = [build_command(r, "O", python="py") for r in runs]
    assert got == [
        ["torchrun", "--nproc-per-node=2", "benchmarks/attention_bench.py", "--modes", "cp,csbp",
         "--contexts", "32768,65536", "--iters", "4", "--out", "O/attention.jsonl"],
        ["torchrun", "--standalone", "--nproc-per-node=2", "benchmarks/bdlm_bench.py", "--modes", "cp", "csbp",
         "--contexts", "131072", "--block-size", "32", "--out", "O/bdlm_sft.jsonl"],
        ["env", "CUDA_VISIBLE_DEVICES=0", "py", "benchmarks/drafter_bench.py", "--shape", "b", "--modes", "cp,csbp",
         "--contexts", "1M", "--anchors", "512", "--out", "O/drafter.jsonl"],
        ["py", "-m", "specforge_csbp", "sweep", "--workload", "sft", "--contexts", "64K", "--modes", "cp,csbp",
         "--world-sizes", "2", "--timeout", "300", "--out-dir", "/tmp/sweep-sft", "--no-progress",
         "--block-sizes", "32", "--args", "--steps 1"],
        ["bash", "-c", "echo O"],
    ]  # fmt: skip


def test_a_real_run_executes_each_launch_under_its_own_limit(tmp_path):
    """Three launches: one writes into {out}, one runs past its 1 s limit and is stopped (with the child it
    started), one fails; the failures are counted and never stop the launches after them."""
    path = _write(tmp_path, f"""
[tiny]
description = "cheap real launches"
bench = "command"
runs = [
  {{ command = "{sys.executable} -c 'open(\\"{{out}}/a.txt\\", \\"w\\").write(\\"ran\\")'" }},
  {{ command = "sleep 60 & echo $! > {{out}}/child.pid; wait", limit_s = 1 }},
  {{ command = "exit 3" }},
  {{ command = "touch {{out}}/last" }},
]
""")
    out = tmp_path / "out"
    echoed: list[str] = []
    start = time.monotonic()
    failed = run_scenarios(list(load_scenarios(path).values()), str(out), echo=echoed.append)
    assert time.monotonic() - start < 30
    assert failed == 2 and (out / "a.txt").read_text() == "ran" and (out / "last").exists()
    assert any("exit 3" in line for line in echoed) and any("exit 124 (stopped at its 1 s limit)" in line for line in echoed)
    child = int((out / "child.pid").read_text())
    deadline = time.monotonic() + 10  # stopped; a killed child may take a moment to be reaped by init
    while Path(f"/proc/{child}").exists() and "zombie" not in _state(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "zombie" in _state(child)


@pytest.mark.parametrize("grace_s", [0.0, 2.0])
def test_run_group_stops_the_whole_group_at_its_limit(tmp_path, grace_s):
    """The one group runner behind the sweep (SIGKILL at once) and the scenarios (SIGTERM, grace, SIGKILL):
    the leader and the child it started both stop; output goes where asked; a quick command keeps its code."""
    log = tmp_path / "log"
    with open(log, "w") as f:
        rc, stopped = run_group(["sh", "-c", f"echo hi; sleep 60 & echo $! > {tmp_path}/pid; wait"], 1,
                                grace_s=grace_s, stdout=f)  # fmt: skip
    assert stopped and rc != 0 and log.read_text() == "hi\n"
    child = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "zombie" not in _state(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "zombie" in _state(child)
    assert run_group(["sh", "-c", "exit 3"], 30, grace_s=grace_s) == (3, False)


def _state(pid: int) -> str:
    try:
        return next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("State:"))
    except (OSError, StopIteration):
        return "gone zombie"


@pytest.mark.parametrize(
    "text, message",
    [
        ('[a]\nruns = [{ bench = "gpu", contexts = ["1K"] }]', "a.runs[0].bench: must be one of drafter, attention"),
        ('[a]\nbench = "drafter"\nruns = [{ contexts = ["64Q"] }]', "a.runs[0].contexts must be an integer >= 1 with an optional K/M/G suffix"),
        ('[a]\nbench = "drafter"\nrun = [{ contexts = ["64K"] }]', "a: unknown field 'run'; allowed: anchors, args"),
        ('[a]\nbench = "drafter"\nruns = [{ contexts = ["64K"], gpus = "2" }]', "a.runs[0].gpus: must be an integer; got '2'"),
        ('[a]\nbench = "drafter"\nruns = [{ limit_s = 10 }]', "a.runs[0].contexts: at least one context"),
        ('[a]\nbench = "command"\nruns = [{ limit_s = 10 }]', "a.runs[0].command: required with bench = 'command'"),
        ('[a]\nbench = "sweep"\nruns = [{ contexts = ["64K"] }]', "a.runs[0].workload: required for bench = 'sweep'"),
        ('[a]\nbench = "drafter"\nruns = []', "a.runs: at least one run"),
        ('[a]\nbench = "drafter"\nruns = [{ contexts = ["64K"], reproduces = 3 }]', "a.runs[0].reproduces: must be a string or a list; got 3"),
    ],
)
def test_a_bad_scenarios_file_is_one_line_naming_the_field(tmp_path, capsys, text, message):
    path = _write(tmp_path, text)
    assert main(["a", "--file", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_an_unknown_scenario_name_lists_the_allowed_ones(capsys):
    assert main(["the-512k-comparison", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "scenario: unknown the-512k-comparison; allowed: drafter-27b," in err and err.count("\n") == 1


def test_the_script_lists_the_scenarios_from_any_directory(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_scenario.py"), "--list"], cwd=tmp_path,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("drafter-27b: headline:")


def test_the_headline_rows_each_name_the_scenario_that_reruns_them():
    """Every row of docs/benchmarks.md's headline (the committed records) has a named scenario that measures
    CSBP at that point again, and the name matches the problem (GPUs, context, anchors)."""
    import json

    from specforge_csbp.bench.latest import headline_rows, latest_records
    from specforge_csbp.bench.records import load_records
    from specforge_csbp.bench.scenarios import rerun_command

    scenarios = load_scenarios(ROOT / "benchmarks" / "scenarios.toml")
    code = json.loads((ROOT / "benchmarks" / "results-code.json").read_text())
    rows = headline_rows(latest_records(load_records(ROOT / "benchmarks" / "results", code_by_file=code)))
    assert len(rows) >= 20
    for h in rows:
        c = h.csbp
        assert rerun_command(scenarios, c.workload, c.world_size, c.context_len, (c.model_extra or {}).get("anchors")), c
    assert rerun_command(scenarios, "drafter-qwen3.6-27b", 2, 1 << 19, 512) == "drafter-27b --contexts 512K"
    assert rerun_command(scenarios, "drafter-qwen3.6-27b", 2, 1 << 20, 2048) == "drafter-27b-anchors2048 --contexts 1M"
    assert rerun_command(scenarios, "drafter-qwen3.6-27b", 1, 1 << 18, 512) == "drafter-27b-1gpu --contexts 256K"
    assert rerun_command(scenarios, "drafter-qwen3.6-27b", 2, 1 << 19, 1024) is None  # no scenario at 1024 anchors
    assert rerun_command(scenarios, "sft", 2, 1 << 18) == "sft --contexts 256K"
    # a run's own `reproduces` names the workloads that run measures; the scenario's holds for the rest
    first_pass = scenarios["trainer-64k-first-pass"].runs
    assert "trainer-qwen3.6-27b-dflash-warm-cache" in first_pass[0].reproduces
    assert first_pass[1].reproduces == ("trainer-qwen3.6-27b-dflash-cold-cache", "trainer-qwen3.6-27b-dflash")
    assert scenarios["trainer-64k-vs-specforge"].runs[0].reproduces == (
        "trainer-qwen3.6-27b-dflash2-as-dflash-warm-cache", "trainer-qwen3.6-27b-dflash2-as-dflash")

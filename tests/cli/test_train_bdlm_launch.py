"""`train-bdlm` without torchrun on a machine with GPUs (torch.cuda.device_count mocked): one torchrun launch
with a rank per GPU (or the recipe's parallel.world_size), never a CPU run; clear one-line errors when the
GPUs cannot hold the ranks or parallel.device=cuda finds none; gloo ranks on the CPU otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from specforge_csbp.cli import train_bdlm
from specforge_csbp.cli.main import main
from specforge_csbp.training import trainer

SFT = Path(__file__).resolve().parents[2] / "examples" / "bdlm_sft_tiny.yaml"


@pytest.fixture
def machine(monkeypatch):
    """Mocked GPU count; records torchrun launches (returning `rc`) and in-process gloo launches."""

    class Machine:
        gpus, rc = 0, 0
        torchrun: list[list[str]] = []
        gloo: list[int] = []

    m = Machine()
    m.torchrun, m.gloo = [], []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: m.gpus)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    def fake_run(cmd):
        m.torchrun.append(list(cmd))
        return m.rc

    monkeypatch.setattr(train_bdlm, "run_torchrun", fake_run)
    monkeypatch.setattr(trainer, "launch", lambda entry, parallel, recipe: m.gloo.append(parallel.world_size))
    return m


def _recipe_without_world_size(tmp_path) -> str:
    raw = yaml.safe_load(SFT.read_text())
    del raw["parallel"]["world_size"]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_one_rank_per_gpu_through_torchrun(machine, tmp_path, capsys):
    machine.gpus = 4
    recipe = _recipe_without_world_size(tmp_path)
    assert main(["train-bdlm", "-c", recipe, "train.steps=3"]) == 0
    assert machine.gloo == []  # no CPU run
    assert machine.torchrun == [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                                 "-m", "specforge_csbp", "train-bdlm", "-c", recipe, "train.steps=3"]]  # fmt: skip
    assert "4 rank(s), one per GPU" in capsys.readouterr().err


def test_recipe_world_size_is_kept_and_torchrun_exit_code_returned(machine):
    machine.gpus, machine.rc = 8, 3
    assert main(["train-bdlm", "-c", str(SFT)]) == 3  # the tiny recipe sets parallel.world_size: 2
    assert machine.torchrun[0][4] == "--nproc-per-node=2"


def test_more_ranks_than_gpus_is_one_line_naming_torchrun(machine, capsys):
    machine.gpus = 2
    assert main(["train-bdlm", "-c", str(SFT), "parallel.world_size=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("specforge-csbp train-bdlm: error: parallel.world_size=4:")
    assert "this machine has 2 GPU(s)" in err and "torchrun" in err
    assert machine.torchrun == [] and machine.gloo == []


def test_device_cuda_without_gpu_is_one_line(machine, capsys):
    assert main(["train-bdlm", "-c", str(SFT), "parallel.device=cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parallel.device=cuda: this machine has no GPU" in err
    assert machine.torchrun == [] and machine.gloo == []


@pytest.mark.parametrize("gpus, extra", [(0, []), (2, ["parallel.device=cpu"])])
def test_flex_backend_on_the_cpu_is_one_line(machine, capsys, gpus, extra):
    """FlexAttention has no backward on the CPU: a CPU run asked for it stops before any rank starts."""
    machine.gpus = gpus
    assert main(["train-bdlm", "-c", str(SFT), "parallel.attention_backend=flex", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parallel.attention_backend=flex" in err and "allowed here: auto" in err
    assert machine.torchrun == [] and machine.gloo == []


def test_cpu_runs_only_without_gpus_or_when_asked(machine):
    assert main(["train-bdlm", "-c", str(SFT)]) == 0  # no GPU: gloo ranks
    machine.gpus = 2
    assert main(["train-bdlm", "-c", str(SFT), "parallel.device=cpu"]) == 0
    assert machine.gloo == [2, 2] and machine.torchrun == []


def test_under_torchrun_it_joins(machine, monkeypatch):
    machine.gpus = 2
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train-bdlm", "-c", str(SFT)]) == 0
    assert machine.gloo == [2] and machine.torchrun == []  # `launch` joins torchrun's process group

"""The supported stack: pyproject's bounds are the ranges start-up enforces, the pinned stack is SpecForge
0.2.0's own pins, the venv the tests run in is inside the range, and start-up (CLI, plugin routing) refuses a
release outside it in one line naming the package, the version found and the range."""

from __future__ import annotations

import tomllib
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from specforge_csbp import stack
from specforge_csbp.cli.main import main as cli_main
from specforge_csbp.plugin.dispatch import dispatch

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_bounds() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["specforge"]]
    return {r.name: str(r.specifier) for r in reqs if r.name in stack.SUPPORTED}


def _normal(spec: str) -> str:
    return ",".join(sorted(spec.split(",")))


def test_pyproject_bounds_are_the_enforced_ranges():
    bounds = _pyproject_bounds()
    assert {k: _normal(v) for k, v in bounds.items()} == {k: _normal(v) for k, v in stack.SUPPORTED.items()}


def test_pinned_stack_is_specforges_own_pins_at_the_low_end_of_the_range():
    pinned = [Requirement(line) for line in (ROOT / "constraints/pinned.txt").read_text().splitlines()
              if line and not line.startswith(("#", "-c"))]  # fmt: skip
    theirs = {r.name: str(r.specifier) for r in map(Requirement, requires("specforge") or []) if r.marker is None}
    for req in pinned:
        assert str(req.specifier) == theirs[req.name], f"{req.name}: pinned {req.specifier}, SpecForge {theirs[req.name]}"
        assert req.specifier.contains(stack.SUPPORTED[req.name].split(",")[0].lstrip(">="))
    assert {r.name for r in pinned} == {"transformers"}  # torch: its pin is a CUDA build (constraints/cpu.txt)


def test_the_stack_under_test_is_supported():
    stack.check_stack(stack.PLUGIN)


@pytest.mark.parametrize(
    ("found", "ok"),
    [("2.11.0+cu130", True), ("2.13.0+cpu", True), ("2.13.1", True), ("2.10.2", False), ("2.14.0", False)],
)
def test_torch_range_ignores_local_build_tags(monkeypatch, found, ok):
    monkeypatch.setattr(stack, "version", lambda name: found)
    reason = stack.unsupported("torch")
    assert (reason is None) == ok
    if not ok:
        assert reason.startswith(f"torch {found} is outside the supported range torch>=2.11,<2.14")


def test_a_missing_package_is_named(monkeypatch):
    def missing(name):
        raise stack.PackageNotFoundError(name)

    monkeypatch.setattr(stack, "version", missing)
    assert stack.unsupported("specforge").startswith("specforge is not installed (supported: specforge==0.2.0")


def _old_transformers(monkeypatch):
    real = stack.version
    monkeypatch.setattr(stack, "version", lambda name: "5.7.0" if name == "transformers" else real(name))


def test_cli_refuses_an_unsupported_release_in_one_line(monkeypatch, capsys):
    _old_transformers(monkeypatch)
    assert cli_main(["plan"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "specforge-csbp plan: error: transformers 5.7.0 is outside the supported range transformers>=5.8.1,<5.26 "
        "(scripts/setup_env.sh builds the tested stack)\n"
    )


def test_plugin_routing_refuses_an_unsupported_release_and_leaves_stock_specforge_alone(monkeypatch, capsys):
    _old_transformers(monkeypatch)
    stock = []
    assert dispatch(lambda argv: stock.append(argv) or 0, ["train", "--csbp", "-c", "run.yaml"]) == 2
    assert capsys.readouterr().err.startswith("specforge train: error: transformers 5.7.0 is outside")
    assert stock == []
    assert dispatch(lambda argv: stock.append(argv) or 0, ["export", "x"]) == 0  # not CSBP's: SpecForge's own
    assert stock == [["export", "x"]]

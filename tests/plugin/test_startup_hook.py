"""The start-up hook: installed, wraps `specforge.cli.main` only, routes only CSBP command lines, can be
switched off - checked in fresh interpreters, as `specforge` itself runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import types

import pytest

from specforge_csbp.plugin import _hook
from specforge_csbp.plugin.dispatch import claims, dispatch, strategy_of

PTH = "specforge-csbp-hook.pth"
_PROBE = "import specforge.cli as c; print(getattr(c.main, '__specforge_csbp_wrapped__', False))"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != _hook.DISABLE_ENV}
    env.update(extra)
    return env


def _specforge_script() -> str:
    return os.path.join(os.path.dirname(sys.executable), "specforge")


def test_hook_pth_is_installed_next_to_specforge():
    path = os.path.join(sysconfig.get_paths()["purelib"], PTH)
    assert os.path.isfile(path), (
        f"{path} is missing: the package must install specforge_csbp/plugin/{PTH} at the site-packages root "
        "(setup.py's build_py / editable_wheel hooks); without it `specforge train --csbp` is not routed"
    )
    with open(path) as f, open(os.path.join(os.path.dirname(_hook.__file__), PTH)) as g:
        assert f.read() == g.read()


def test_fresh_interpreter_wraps_specforge_cli_unless_disabled():
    on = subprocess.run(
        [sys.executable, "-c", _PROBE], env=_env(), capture_output=True, text=True, check=True
    )
    off = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=_env(SPECFORGE_CSBP_DISABLE="1"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert on.stdout.strip() == "True"
    assert off.stdout.strip() == "False"


def test_specforge_console_script_help_lists_plugin_flags_unless_disabled():
    on = subprocess.run(
        [_specforge_script(), "train", "--help"], env=_env(), capture_output=True, text=True, check=False
    )
    off = subprocess.run(
        [_specforge_script(), "train", "--help"], env=_env(SPECFORGE_CSBP_DISABLE="1"), capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert on.returncode == 0 and off.returncode == 0
    assert "--cp-size N" in on.stdout and "SPECFORGE_CSBP_DISABLE" in on.stdout
    assert "--cp-size" not in off.stdout and "--config" in off.stdout  # SpecForge's own help, untouched


def test_disabled_hook_leaves_csbp_an_unknown_argument(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model: {target_model_path: x}\ndata: {hidden_states_path: y}\ntraining: {strategy: dflash}\n"
    )
    off = subprocess.run(
        [_specforge_script(), "train", "--csbp", "-c", str(cfg)], env=_env(SPECFORGE_CSBP_DISABLE="1"),
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert off.returncode == 2 and "unrecognized arguments: --csbp" in off.stderr


def test_finder_answers_only_for_specforge_cli_and_install_is_idempotent():
    _hook.install()
    _hook.install()
    finders = [f for f in sys.meta_path if isinstance(f, _hook._SpecForgeCliFinder)]
    assert len(finders) == 1
    assert finders[0].find_spec("json", None) is None
    assert finders[0].find_spec("specforge.config", None) is None
    import specforge

    spec = finders[0].find_spec("specforge.cli", specforge.__path__)
    assert isinstance(spec.loader, _hook._WrappingLoader)


def test_wrapped_main_routes_through_dispatch_and_passes_other_commands_through(monkeypatch):
    calls = []
    module = types.SimpleNamespace(main=lambda argv=None: calls.append(argv) or 7)
    _hook.wrap_cli_module(module)
    _hook.wrap_cli_module(module)  # once only
    assert module.main.__wrapped__.__name__ == "<lambda>"
    assert module.main(["export", "--to", "hf"]) == 7 and calls == [["export", "--to", "hf"]]
    monkeypatch.setenv(_hook.DISABLE_ENV, "1")
    assert module.main(["train", "--csbp", "-c", "x.yaml"]) == 7  # disabled: SpecForge sees everything
    assert calls[-1] == ["train", "--csbp", "-c", "x.yaml"]


@pytest.mark.parametrize(
    "strategy,args,expected",
    [
        ("dflash", ["--csbp"], True),
        ("dflash", ["--cp-size=2"], True),
        ("dflash", ["--dp-replicas", "2"], True),
        ("dflash", [], False),
        ("eagle3", [], False),
        ("dflash2-csbp", [], True),
        ("dflash2", [], True),
        ("dflash", ["training.strategy=dflash-csbp"], True),
        ("dflash2-csbp", ["training.strategy=eagle3"], False),
    ],
)
def test_claims_follow_flags_and_strategy(tmp_path, strategy, args, expected):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"model": {}, "data": {}, "training": {"strategy": strategy}}))
    argv = ["train", "-c", str(cfg), *args]
    assert claims(argv) is expected
    assert not claims(["export", "-c", str(cfg), "--csbp"])
    assert strategy_of(["--config=" + str(cfg)]) == strategy


def test_routing_reads_the_config_with_the_shared_reader_and_leaves_bad_ones_to_specforge(tmp_path):
    """strategy_of reads YAML or JSON through errors.load_config; a config it cannot read (missing, a
    directory, not UTF-8, bad YAML, not a mapping) is not claimed, so SpecForge reports it in its own words."""
    good = tmp_path / "run.yaml"
    good.write_text("training:\n  strategy: dflash2-csbp\n")
    assert strategy_of(["-c", str(good)]) == "dflash2-csbp" and claims(["train", f"-c{good}"])
    (tmp_path / "bad.yaml").write_text("training: [\n")
    (tmp_path / "latin1.json").write_bytes(b'{"training": {"strategy": "caf\xe9"}}')
    (tmp_path / "list.yml").write_text("- training\n")
    for path in ("missing.yaml", "bad.yaml", "latin1.json", "list.yml", "."):
        assert strategy_of(["--config", str(tmp_path / path)]) is None
        assert not claims(["train", "--config", str(tmp_path / path)])


def test_dispatch_passes_unclaimed_train_to_specforge(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("training:\n  strategy: dflash\n")
    seen = []
    assert dispatch(lambda argv: seen.append(argv) or 0, ["train", "-c", str(cfg)]) == 0
    assert seen == [["train", "-c", str(cfg)]]

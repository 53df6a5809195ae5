"""Route one `specforge ...` command line: to the CSBP launcher when it asks for CSBP, else to SpecForge.

A `train` command line is CSBP's when it carries a plugin flag (`--csbp`, `--cp-size`, `--dp-replicas`) or
when its config (after `training.strategy=...` overrides) names one of the plugin's strategies
(`dflash-csbp`, `dflash2-csbp`, `dflash2`). Every other command line - other strategies, `export`,
`benchmark`, `--help` - goes to SpecForge's own `main` unchanged; `specforge train --help` additionally
prints the plugin's flags after SpecForge's help.

This module imports only the standard library, PyYAML, the package's readers (errors.py) and
the supported-stack check (stack.py, installed metadata only); the launcher
(torch, specforge) loads only when the command line is the plugin's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from ..errors import load_config
from ..stack import PLUGIN, check_stack

__all__ = ["PLUGIN_FLAGS", "PLUGIN_STRATEGIES", "claims", "dispatch", "strategy_of"]

PLUGIN_FLAGS = ("--csbp", "--cp-size", "--dp-replicas")
#: strategies this plugin registers (kept here, import-free, so routing needs no registry import)
PLUGIN_STRATEGIES = ("dflash-csbp", "dflash2-csbp", "dflash2")

_HELP_EPILOG = """
specforge-csbp plugin (installed; SPECFORGE_CSBP_DISABLE=1 turns it off):
  --csbp                run a DFlash / DFlash2 config under context-sharded block parallelism
                        (training.strategy dflash -> dflash-csbp, dflash2 -> dflash2-csbp)
  --cp-size N           ranks that share one sample's context (default: all ranks)
  --dp-replicas N       data-parallel replicas of the CP group (default: world size / cp size)
  YAML equivalent: training.strategy: dflash2-csbp, plus an optional `csbp:` section (cp_size, ...).
  Full help: specforge-csbp train --help
"""


def _flag_present(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _config_path(args: Sequence[str]) -> str | None:
    for i, a in enumerate(args):
        if a in ("-c", "--config") and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a.startswith("-c") and len(a) > 2 and not a.startswith("--"):
            return a[2:]
    return None


def strategy_of(args: Sequence[str]) -> str | None:
    """`training.strategy` of a `train` command line: the last override, else the config file's."""
    for a in reversed(list(args)):
        if a.startswith("training.strategy="):
            return a.split("=", 1)[1].strip()
    path = _config_path(args)
    if path is None:
        return None
    try:
        raw = load_config(path, "--config")
    except ValueError:  # unreadable config: SpecForge reports it in its own words
        return None
    training = raw.get("training") if isinstance(raw, dict) else None
    return str(training.get("strategy")) if isinstance(training, dict) and "strategy" in training else None


def claims(args: Sequence[str]) -> bool:
    """Is this `specforge` command line a CSBP training run?"""
    if not args or args[0] != "train":
        return False
    rest = list(args[1:])
    if any(_flag_present(rest, f) for f in PLUGIN_FLAGS):
        return True
    return strategy_of(rest) in PLUGIN_STRATEGIES


def _stock_train_help(original: Callable, argv) -> int:
    try:
        return original(argv)
    except SystemExit as done:
        if done.code in (0, None):
            print(_HELP_EPILOG.rstrip())
        raise


def dispatch(original: Callable, argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if claims(args):
        try:  # before torch loads: a release outside the tested range is refused in one line
            check_stack(PLUGIN)
        except ValueError as err:
            print(f"specforge train: error: {err}", file=sys.stderr)
            return 2
        # lazy: start-up of every `specforge` command (torch, pydantic: CSBP runs only)
        from .launch import train_main

        return train_main(args[1:], prog="specforge train")
    if args[:1] == ["train"] and any(a in ("-h", "--help") for a in args[1:]):
        return _stock_train_help(original, argv)
    return original(argv)

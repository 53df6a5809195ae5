"""The start-up hook that makes `specforge train --csbp ...` reach this plugin (no SpecForge file is patched).

How it gets there:

    site-packages/specforge-csbp-hook.pth      one line, run by Python's `site` at interpreter start-up:
        -> specforge_csbp.plugin._hook.install()   puts `_SpecForgeCliFinder` first on sys.meta_path
                                                    (imports nothing else: no torch, no specforge)
    `specforge ...` console script does `from specforge.cli import main`
        -> the finder sees the import of `specforge.cli` (and only that module), lets the normal finder
           load it, then replaces `specforge.cli.main` by `_dispatching_main`
        -> `_dispatching_main(argv)` hands the call to `specforge_csbp.plugin.dispatch`, which runs the
           CSBP launcher for `train` invocations that ask for it (`--csbp`, `--cp-size`, `--dp-replicas`,
           or a config whose `training.strategy` is one of the plugin's) and calls SpecForge's own `main`,
           untouched, for everything else.

Worker processes never need the hook: the CSBP launcher starts its workers as
`python -m torch.distributed.run --no-python ... python -m specforge_csbp train ...`, so each worker runs
this package's entry point directly (see `plugin/launch.py`).

Switch it off with `SPECFORGE_CSBP_DISABLE=1` (stock SpecForge behaviour; `--csbp` then becomes an unknown
argument) or remove the `.pth` file; `specforge-csbp train ...` keeps working either way.
Not covered: `python -m specforge.cli ...` runs SpecForge's module as `__main__`, which this hook does not
touch; use `python -m specforge_csbp train ...` (same arguments) for module-style launches.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys

__all__ = ["DISABLE_ENV", "TARGET_MODULE", "disabled", "install", "installed", "wrap_cli_module"]

DISABLE_ENV = "SPECFORGE_CSBP_DISABLE"
TARGET_MODULE = "specforge.cli"
_WRAPPED = "__specforge_csbp_wrapped__"


def disabled() -> bool:
    """True when `SPECFORGE_CSBP_DISABLE` is set to anything but '', '0', 'false', 'no'."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _dispatching_main(original):
    @functools.wraps(original)
    def main(argv=None):
        if disabled():
            return original(argv)
        # lazy: interpreter start-up (the .pth hook imports nothing until `specforge.cli` runs)
        from .dispatch import dispatch

        return dispatch(original, argv)

    setattr(main, _WRAPPED, True)
    main.__wrapped__ = original
    return main


def wrap_cli_module(module) -> None:
    """Replace `module.main` (SpecForge's CLI entry) by the dispatching wrapper, once."""
    original = getattr(module, "main", None)
    if callable(original) and not getattr(original, _WRAPPED, False):
        module.main = _dispatching_main(original)


class _WrappingLoader(importlib.abc.Loader):
    """Delegates everything to SpecForge's own loader and wraps `main` after the module body ran."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        if not disabled():
            wrap_cli_module(module)

    def __getattr__(self, name):  # get_code, get_source, is_package, get_filename, ...
        return getattr(self._inner, name)


class _SpecForgeCliFinder(importlib.abc.MetaPathFinder):
    """Answers only for `specforge.cli`; finds it with the remaining finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE or disabled():
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _SpecForgeCliFinder):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WrappingLoader(spec.loader)
                return spec
        return None


def installed() -> bool:
    return any(isinstance(f, _SpecForgeCliFinder) for f in sys.meta_path)


def install() -> None:
    """Idempotent (site may process a .pth twice when lib64 links to lib). Never raises."""
    try:
        if disabled():
            return
        if not installed():
            sys.meta_path.insert(0, _SpecForgeCliFinder())
        cli = sys.modules.get(TARGET_MODULE)
        if cli is not None:  # imported before the hook ran (e.g. install() called late)
            wrap_cli_module(cli)
    except Exception:  # noqa: BLE001, S110 - a broken hook must never break interpreter start-up
        pass

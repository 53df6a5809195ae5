"""`specforge-csbp <command>`: every module in this package that defines `register(subparsers)` adds one
subcommand (its parser must set `func`), so a new command is a new file and nothing else."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from .. import __version__
from ..errors import is_user_error, one_line
from ..progress import quiet_library_bars
from ..stack import CORE, PLUGIN, check_stack

__all__ = ["build_parser", "main"]


class _ArgumentError(ValueError):
    """A bad flag value or a missing flag, raised by the parser instead of printing the usage block."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line like every other user error (the usage stays in --help)."""

    def error(self, message: str):  # type: ignore[override]
        raise _ArgumentError(self.prog, f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specforge-csbp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"specforge-csbp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    package = importlib.import_module(__package__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name == "main":
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except _ArgumentError as err:
        print(f"{err.prog}: error: {err}", file=sys.stderr)
        return 2
    try:
        check_stack(PLUGIN if args.command == "train" else CORE)  # `train` runs SpecForge's trainer
        quiet_library_bars()  # transformers' "Loading weights" bar would leave carriage returns in a log
        return int(args.func(args) or 0)
    except Exception as err:  # a user's input or machine (bad value, file, disk full): one line; bugs: traceback
        if not is_user_error(err):
            raise
        print(f"specforge-csbp {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`specforge-csbp train`: the direct entry of `specforge train --csbp` (same arguments, no start-up hook).

    specforge-csbp train --csbp -c run.yaml [--cp-size N] [--dp-replicas N] [section.field=value ...]

See specforge_csbp/plugin/launch.py for what it runs and docs/specforge.md for the recipe fields.
"""

from __future__ import annotations

import argparse

from ..plugin.arguments import add_train_arguments

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a DFlash/DFlash2 drafter through SpecForge (CSBP with --csbp)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_train_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # lazy: CLI start-up
    from ..plugin.launch import run

    return run(args, prog="specforge-csbp train")

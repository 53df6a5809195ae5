"""The arguments of `specforge-csbp train` / `specforge train --csbp`, apart from the launcher that runs them,
so building the CLI's parser (`specforge-csbp --help`) imports neither torch nor SpecForge."""

from __future__ import annotations

import argparse

__all__ = ["add_train_arguments"]


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c", "--config", required=True, help="SpecForge YAML/JSON run config (may hold a csbp: section)"
    )
    p.add_argument(
        "--csbp", action="store_true", help="run training.strategy dflash/dflash2 as dflash-csbp/dflash2-csbp"
    )
    p.add_argument(
        "--cp-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks sharing one sample's context (default: all)",
    )
    p.add_argument(
        "--dp-replicas",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel replicas (default: world / cp)",
    )
    p.add_argument("--role", choices=("auto", "all", "producer", "consumer", "both"), default="auto",
                   help="SpecForge launch role (CSBP strategies are offline: auto = all)")  # fmt: skip
    p.add_argument("--node-rank", type=int, default=None, help="node rank of an explicit multi-node launch")
    p.add_argument(
        "--plan", action="store_true", help="print the resolved layout and process plan, start nothing"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_steps=10 csbp.mode=cp")

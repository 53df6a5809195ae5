"""`specforge-csbp train-bdlm -c recipe.yaml [section.field=value ...]`: train a Hugging Face causal LM as a
block-diffusion LM (SFT or AR->BDLM conversion) with DP x CSBP/CP/BP.

On CPU it spawns `parallel.world_size` gloo ranks; under torchrun it joins the launch (NCCL, one GPU per
rank). Every check that can fail before a process starts does (one line, naming the field).
"""

from __future__ import annotations

import argparse
import os

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-bdlm", help="train a causal LM as a block-diffusion LM (SFT / AR->BDLM conversion)"
    )
    p.add_argument("-c", "--config", required=True, help="recipe YAML (see examples/bdlm_*_tiny.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="recipe overrides")
    p.set_defaults(func=run)


def _rank_main(rank: int, world: int, recipe) -> None:
    from ..models.bdlm.recipe import build_workload
    from ..training.trainer import train

    train(build_workload(recipe), recipe.train, recipe.parallel, recipe=recipe.model_dump(mode="json"))


def run(args: argparse.Namespace) -> int:
    from ..models.bdlm.recipe import BDLMRecipe, preflight
    from ..training.config import load_recipe
    from ..training.trainer import launch, under_torchrun

    recipe = load_recipe(BDLMRecipe, args.config, args.overrides)
    from ..preflight import check_local_path

    check_local_path(recipe.model.pretrained, "model.pretrained")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else recipe.parallel.world_size
    preflight(recipe, world)
    launch(_rank_main, recipe.parallel, recipe)
    return 0

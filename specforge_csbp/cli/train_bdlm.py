"""`specforge-csbp train-bdlm -c recipe.yaml [section.field=value ...]`: train a Hugging Face causal LM as a
block-diffusion LM (SFT or AR->BDLM conversion) with DP x CSBP/CP/BP.

Where the ranks run (`parallel.device`, default auto):

    under torchrun                      joins the launch (NCCL, one GPU per rank)
    GPUs here, no torchrun (auto|cuda)  starts `python -m torch.distributed.run --standalone
                                        --nproc-per-node W -m specforge_csbp train-bdlm ...` with W =
                                        parallel.world_size when the recipe sets it, else one rank per GPU
                                        (as `specforge train` launches its workers); never a CPU run
    no GPU (auto), or parallel.device=cpu   spawns parallel.world_size gloo ranks on the CPU
    parallel.device=cuda, no GPU        one-line error

Every check that can fail before a process starts does (one line, naming the field).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from ..preflight import check_flex_backend_on_cpu, check_local_path

__all__ = ["register", "run", "torchrun_command"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-bdlm", help="train a causal LM as a block-diffusion LM (SFT / AR->BDLM conversion)"
    )
    p.add_argument("-c", "--config", required=True, help="recipe YAML (see examples/bdlm_*_tiny.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="recipe overrides")
    p.set_defaults(func=run)


def _rank_main(rank: int, world: int, recipe) -> None:
    # lazy: CLI start-up
    from ..models.bdlm.recipe import build_workload
    from ..training.trainer import train

    train(build_workload(recipe), recipe.train, recipe.parallel, recipe=recipe.model_dump(mode="json"))


def _gpus() -> int:
    import torch

    return int(torch.cuda.device_count())


def torchrun_command(config: str, overrides: list[str], world: int) -> list[str]:
    """This command line again, as one torchrun launch of `world` ranks on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "specforge_csbp", "train-bdlm", "-c", config, *overrides]  # fmt: skip


def check_cpu_backend(parallel) -> None:
    """A CPU run trains through the dense backend (preflight.check_flex_backend_on_cpu)."""
    check_flex_backend_on_cpu(
        "parallel.attention_backend", parallel.attention_backend, "flex",
        where="this run is on the CPU", allowed="auto (dense on the CPU, flex on GPUs) or dense",
    )  # fmt: skip


def gpu_world_size(parallel, gpus: int) -> int | None:
    """Ranks to start through torchrun on this machine's `gpus` GPUs, or None for a CPU (gloo) run."""
    if parallel.device == "cuda" and gpus == 0:
        raise ValueError(
            "parallel.device=cuda: this machine has no GPU (torch.cuda.device_count() = 0); allowed: auto "
            "(GPUs when present, else CPU ranks) or cpu"
        )
    if parallel.device == "cpu" or gpus == 0:
        check_cpu_backend(parallel)
        return None
    world = parallel.world_size if "world_size" in parallel.model_fields_set else gpus
    if world > gpus:
        raise ValueError(
            f"parallel.world_size={world}: this machine has {gpus} GPU(s) and a rank runs on each; set at most "
            f"{gpus}, run under torchrun across nodes (docs/reliability.md), or parallel.device=cpu"
        )
    return world


def run(args: argparse.Namespace) -> int:
    # lazy: CLI start-up
    from ..models.bdlm.recipe import BDLMRecipe, preflight
    from ..training.config import load_recipe
    from ..training.trainer import launch, under_torchrun

    recipe = load_recipe(BDLMRecipe, args.config, args.overrides)

    check_local_path(recipe.model.pretrained, "model.pretrained")
    if under_torchrun():
        if recipe.parallel.device == "cpu" or _gpus() == 0:
            check_cpu_backend(recipe.parallel)
        preflight(recipe, int(os.environ["WORLD_SIZE"]))
        launch(_rank_main, recipe.parallel, recipe)
        return 0
    world = gpu_world_size(recipe.parallel, _gpus())
    if world is not None:
        preflight(recipe, world)
        cmd = torchrun_command(args.config, list(args.overrides), world)
        print(f"specforge-csbp train-bdlm: {world} rank(s), one per GPU: {' '.join(cmd[2:])}", file=sys.stderr,
              flush=True)  # fmt: skip
        return subprocess.run(cmd, check=False).returncode
    preflight(recipe, recipe.parallel.world_size)
    launch(_rank_main, recipe.parallel, recipe)
    return 0

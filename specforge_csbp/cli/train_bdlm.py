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

Every check that can fail before a process starts does (one line, naming the field). A fault after the
ranks started (a user's error such as bad data or a full disk, or a RunFault: out of device memory, a
non-finite loss) is one line too, without a traceback, and every rank exits non-zero:

    path                   the failing rank                      the one line, printed by
    gloo ranks (spawn)     sends its line to this process        this process (cli/main.py), exit 2
    torchrun started here  writes it to the relay directory      this process, which runs torchrun's agent
                             (distributed/relay.py), exits 1       itself: no ChildFailedError report; exit
                                                                   = the failed rank's exit code
    the user's torchrun    prints it, exits 1                    rank 0 for a RunFault (every rank raises
                                                                   it), else each failing rank

An unexpected error (a bug) keeps the rank's traceback; the launch still ends in one line naming the rank
(and its exit code, or the hang).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..distributed import relay
from ..errors import RunFault, is_user_error, one_line
from ..preflight import check_flex_backend_on_cpu, check_local_path

__all__ = ["register", "run", "run_torchrun", "torchrun_command"]

PROG = "specforge-csbp train-bdlm"
_QUIET_RANK_DELAY_S = 2.0  # >> torchrun's agent's monitor interval plus rank 0's time to print


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


def _torchrun_rank_main(rank: int, world: int, recipe) -> None:
    """A rank of a torchrun launch: a user's error or a RunFault becomes one line (where no launcher of
    this package relays it) and exit 1 at once - no teardown, which could wait on a peer that is gone."""
    try:
        _rank_main(rank, world, recipe)
    except Exception as err:
        relay.record(err)  # for run_torchrun, when it started this launch (a no-op otherwise)
        if not is_user_error(err):
            raise  # a bug: its traceback
        if not os.environ.get(relay.ENV):  # else the launcher prints it
            if not isinstance(err, RunFault):
                print(f"{PROG}: error: rank {rank}: {one_line(err)}", file=sys.stderr, flush=True)
            elif rank == 0:  # every rank raises a RunFault, naming the ranks
                print(f"{PROG}: error: {one_line(err)}", file=sys.stderr, flush=True)
            else:  # let rank 0 say it before torchrun's agent, seeing this exit, stops it
                time.sleep(_QUIET_RANK_DELAY_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _spawned(launch, recipe) -> int:
    """Gloo ranks on this machine: a rank's user error or RunFault comes back as a ValueError (cli/main.py
    prints its line); any other failure (a bug's traceback, printed by the rank; a signal; a hang) is one
    line here instead of the RankFailure's traceback. Exit 124 for a hang (as timeout(1)), else 1."""
    from ..distributed.launch import HANG_EXIT_CODE, RankFailure  # lazy: CLI start-up

    try:
        launch(_rank_main, recipe.parallel, recipe)
    except RankFailure as err:
        if isinstance(err, ValueError):
            raise
        line = (str(err).splitlines() or [""])[0]
        if err.kind == "exception":
            if err.peer:  # no rank said more than that a peer went away: the one traceback there is
                print(err.traceback, file=sys.stderr, end="")
            line += " (unexpected: the rank's traceback is above)"
        print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
        return HANG_EXIT_CODE if err.kind == "hang" else 1
    return 0


def run_torchrun(cmd: list[str]) -> int:
    """Run `cmd` (torchrun_command's) with torchrun's agent in this process (distributed/torchrun.py); a
    failed launch is one line (the failed rank's relayed error) instead of torchrun's ChildFailedError
    report, and its exit status is the failed rank's (128 + N for signal N)."""
    # lazy: CLI start-up
    from ..distributed.torchrun import run_agent

    if cmd[1:3] != ["-m", "torch.distributed.run"]:
        raise ValueError(f"not a torchrun command line: {' '.join(cmd[:3])}")
    with relay.error_dir() as errors:
        result = run_agent(cmd[3:])
        if result.stopped_by:  # Ctrl-C / SIGTERM to this process: the agent stopped the ranks
            print(f"{PROG}: stopped by {result.stopped_by}; every rank was stopped", file=sys.stderr, flush=True)
        elif result.status:
            if os.listdir(errors):
                line = relay.root_cause(errors, result.status)
            else:
                line = f"rank {result.failed_rank} {result.how} without reporting an error; its output above names it"
            print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    return result.status


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
        launch(_torchrun_rank_main, recipe.parallel, recipe)
        return 0
    world = gpu_world_size(recipe.parallel, _gpus())
    if world is not None:
        preflight(recipe, world)
        cmd = torchrun_command(args.config, list(args.overrides), world)
        print(f"specforge-csbp: train-bdlm on {world} rank(s), one per GPU: {' '.join(cmd[2:])}", file=sys.stderr,
              flush=True)  # fmt: skip
        return run_torchrun(cmd)
    preflight(recipe, recipe.parallel.world_size)
    return _spawned(launch, recipe)

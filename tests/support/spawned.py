"""Run a test worker on gloo ranks and hand rank 0's JSON-able result back to the test; or open a one-rank
gloo group in the test's own process, for code that needs a process group.

    worker(rank, world, out_dir) ... save_results(out_dir, results)      (rank 0)
    results = spawn_results(worker, world, out_dir)                      (the test / a module fixture)
    with one_rank_group(): train(...)                                    (in the test's process)
"""

import contextlib
import json
import os

import torch.distributed as dist

from specforge_csbp.distributed import spawn
from specforge_csbp.distributed.launch import free_port

__all__ = ["one_rank_group", "save_results", "spawn_results"]

RESULTS = "results.json"


def save_results(out_dir, results) -> None:
    with open(os.path.join(out_dir, RESULTS), "w") as f:
        json.dump(results, f)


def spawn_results(worker, world: int, out_dir, **spawn_kwargs):
    spawn(worker, world, str(out_dir), **spawn_kwargs)
    with open(os.path.join(out_dir, RESULTS)) as f:
        return json.load(f)


@contextlib.contextmanager
def one_rank_group():
    """A gloo process group of world size 1 in this process, destroyed on exit."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

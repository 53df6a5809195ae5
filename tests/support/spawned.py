"""Run a test worker on gloo ranks and hand rank 0's JSON-able result back to the test.

    worker(rank, world, out_dir) ... save_results(out_dir, results)      (rank 0)
    results = spawn_results(worker, world, out_dir)                      (the test / a module fixture)
"""

import json
import os

from specforge_csbp.distributed import spawn

__all__ = ["save_results", "spawn_results"]

RESULTS = "results.json"


def save_results(out_dir, results) -> None:
    with open(os.path.join(out_dir, RESULTS), "w") as f:
        json.dump(results, f)


def spawn_results(worker, world: int, out_dir, **spawn_kwargs):
    spawn(worker, world, str(out_dir), **spawn_kwargs)
    with open(os.path.join(out_dir, RESULTS)) as f:
        return json.load(f)

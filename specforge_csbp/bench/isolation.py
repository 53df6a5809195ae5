"""Give every mode of one benchmark launch the same starting state.

Why: FlexAttention is compiled with automatic dynamic shapes (attention/flex.py). The first shape a call
site sees gets a static kernel; the first *different* shape recompiles it as a dynamic kernel, which is
slower (docs/performance.md, "Fresh compile state per mode"). Without a reset, whichever mode runs second
inherits the first mode's compile history and pays for it - an order effect, not a property of the mode.

    launch:  [mode A: compile, warm up, time] -> fresh_point() -> [mode B: compile, warm up, time]
                                                 (dynamo caches, allocator cache, garbage)

Warm-up to a steady compile state (`warm_up`): automatic dynamic shapes recompile a call site each time one
of its lengths changes for the first time, and a drafter step's lengths change every step (anchors are drawn
per step). A fixed number of warm-up steps is not enough: a schedule with more seam calls per layer (overlap
has P where fused has one) keeps compiling new graphs for longer, and a median taken over compiling steps
measures the compiler. So the warm-up runs on until a step compiles nothing new; the timed steps still
report what they compiled. A shape that changes
for the first time after the warm-up (CSBP's per-rank block count can repeat for a few steps: anchors are
owned by cost, not by count) still recompiles once in the timed steps - hence at least 4 warm-up steps in
benchmarks/drafter_bench.py, and the median of the timed steps.

    step:      1      2      3      4      5 ...
    new graphs 5      2      1      0  ->  timed steps start (at least `min_steps`, at most `max_steps`)
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

__all__ = ["compiled_graphs", "fresh_point", "warm_up"]


def fresh_point() -> None:
    """Forget compiled graphs and their shape history, collect garbage and return cached device memory."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's unique-graph counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warm_up(
    step: Callable[[], object], min_steps: int, max_steps: int, agree: Callable[[float], float] = float
) -> int:
    """Run `step` `min_steps` times, then on until a step compiles no new graph, at most `max_steps` in all.

    `agree` turns this rank's count of new graphs into one number every rank sees (e.g. the max over ranks),
    so ranks that compile differently still run the same number of steps (a step holds collectives).
    Returns the number of steps run.
    """
    if min_steps < 0 or max_steps < min_steps:
        raise ValueError(f"warm-up steps: need 0 <= min_steps <= max_steps; got {min_steps}, {max_steps}")
    done, new = 0, 1.0
    while done < max_steps and (done < min_steps or new > 0):
        before = compiled_graphs()
        step()
        done += 1
        new = agree(float(compiled_graphs() - before))
    return done

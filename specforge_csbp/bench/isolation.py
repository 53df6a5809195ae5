"""Give every mode of one benchmark launch the same starting state.

Why: FlexAttention is compiled with automatic dynamic shapes (attention/flex.py). The first shape a call
site sees gets a static kernel; the first *different* shape recompiles it as a dynamic kernel, which was
measured 14-16% slower on H200 (Qwen3-1.7B SFT, 64K: CP's attention 5.9 s in its own process, 6.9 s when it
ran after CSBP in the same launch). Without a reset, whichever mode runs second inherits the first mode's
compile history and pays for it - an order effect, not a property of the mode.

    launch:  [mode A: compile, warm up, time] -> fresh_point() -> [mode B: compile, warm up, time]
                                                 (dynamo caches, allocator cache, garbage)
"""

from __future__ import annotations

import gc

import torch

__all__ = ["fresh_point"]


def fresh_point() -> None:
    """Forget compiled graphs and their shape history, collect garbage and return cached device memory."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

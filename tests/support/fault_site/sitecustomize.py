"""Fault injection for command-line runs (tests/reliability/test_rank_faults.py): put this directory first on
PYTHONPATH and set SPECFORGE_CSBP_TEST_FAULT=KIND:RANK:STEP; every process of the run (the CLI, torchrun's
agent, each rank) imports it at start-up, and the BDLM workload's forward on rank RANK at 0-based step STEP
raises:

    oom     torch.OutOfMemoryError with CUDA's wording ("CUDA out of memory. Tried to allocate 2.00 GiB ...")
    value   ValueError("data.path: injected.jsonl:3 has no records")   (a user's error found in one rank)
    nan     the loss numerator times NaN                               (the non-finite guard's fault)
    bug     KeyError('injected')                                       (unexpected: keeps its traceback)

Unset, it does nothing (and imports nothing).
"""

import os

_SPEC = os.environ.get("SPECFORGE_CSBP_TEST_FAULT")

if _SPEC:
    import torch

    from specforge_csbp.models.bdlm.workload import BDLMWorkload

    _KIND, _RANK, _STEP = _SPEC.split(":")
    _microbatches, _loss_numerator = BDLMWorkload.microbatches, BDLMWorkload.loss_numerator

    def microbatches(self, ctx, step):
        self._fault_here = (ctx.rank, step) == (int(_RANK), int(_STEP))
        return _microbatches(self, ctx, step)

    def loss_numerator(self, model, batch, ctx=None):
        if getattr(self, "_fault_here", False):
            if _KIND == "oom":
                raise torch.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB"
                )
            if _KIND == "value":
                raise ValueError("data.path: injected.jsonl:3 has no records")
            if _KIND == "nan":
                return _loss_numerator(self, model, batch, ctx) * float("nan")
            raise KeyError("injected")
        return _loss_numerator(self, model, batch, ctx)

    BDLMWorkload.microbatches, BDLMWorkload.loss_numerator = microbatches, loss_numerator

"""Fault injection for command-line runs (tests/reliability/test_rank_faults.py): put this directory first on
PYTHONPATH and set SPECFORGE_CSBP_TEST_FAULT=KIND:RANK:STEP; every process of the run (the CLI, torchrun's
agent, each rank) imports it at start-up, and the BDLM workload's forward on rank RANK at 0-based step STEP
raises:

    oom     torch.OutOfMemoryError with CUDA's wording ("CUDA out of memory. Tried to allocate 2.00 GiB ...")
    oom-full  the same, at every step from STEP on, while no decoder layer is checkpointed (a step that does
            not fit without checkpointing)
    value   ValueError("data.path: injected.jsonl:3 has no records")   (a user's error found in one rank)
    nan     the loss numerator times NaN                               (the non-finite guard's fault)
    bug     KeyError('injected')                                       (unexpected: keeps its traceback)

SPECFORGE_CSBP_TEST_MEMORY_GIB=G makes the CPU run decide `auto` from the memory model as on a GPU with G GiB
available to every rank (training/checkpointing.py `models_memory`, `available_gib`).

Unset, they do nothing (and import nothing).
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

    def microbatches_from(self, ctx, step):
        self._fault_here = ctx.rank == int(_RANK) and step >= int(_STEP)
        return _microbatches(self, ctx, step)

    def _checkpointed(model) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())

    def loss_numerator(self, model, batch, ctx=None):
        if _KIND == "oom-full" and getattr(self, "_fault_here", False) and not _checkpointed(model):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB.")
        if getattr(self, "_fault_here", False) and _KIND != "oom-full":
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

    BDLMWorkload.microbatches = microbatches_from if _KIND == "oom-full" else microbatches
    BDLMWorkload.loss_numerator = loss_numerator

_MEMORY = os.environ.get("SPECFORGE_CSBP_TEST_MEMORY_GIB")

if _MEMORY:
    from specforge_csbp.training import checkpointing, trainer

    for module in (checkpointing, trainer):
        module.models_memory = lambda ctx: True
        module.available_gib = lambda device: float(_MEMORY)

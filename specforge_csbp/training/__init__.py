"""A generic trainer core: recipe config, DP x CP mesh, the step, checkpoints, metrics, and the loop.

Anything trainable plugs in through the small `Workload` protocol (workload.py); BDLM training
(`models/bdlm/workload.py`) and the DFlash drafter reuse the same loop.

    config.py      pydantic sections (ParallelConfig, TrainConfig), YAML + `section.field=value` overrides
    context.py     TrainContext: dp x cp DeviceMesh, device, precision, partition-free sequence ids
    workload.py    the Workload protocol
    step.py        global denominator, micro-batch backward, summed gradients, clipping, AdamW step
    schedule.py    warmup + cosine
    checkpoint.py  atomic checkpoints (temporary name, manifest, rename) with a `latest` pointer
    validate.py    what the trainer refuses before writing (output_dir, resume) and the non-finite scan
    metrics.py     tokens/s, MFU, peak memory
    trainer.py     the loop (tqdm, one log line per step) and the torchrun / gloo launcher
"""

import importlib

# Lazy exports: importing the step or context does not import pydantic (benchmark machines may lack it).
_EXPORTS = {
    "ParallelConfig": "config", "Section": "config", "TrainConfig": "config", "apply_overrides": "config",
    "load_recipe": "config", "TrainContext": "context", "build_context": "context", "StepResult": "step",
    "reduce_gradients": "step", "train_step": "step", "launch": "trainer", "train": "trainer",
    "under_torchrun": "trainer", "MicroBatch": "workload", "Workload": "workload", "NonFiniteError": "step",
    "StepOutOfMemory": "step", "seed_step": "trainer",
}  # fmt: skip
__all__ = [
    "MicroBatch", "NonFiniteError", "ParallelConfig", "Section", "StepOutOfMemory", "StepResult", "TrainConfig",
    "TrainContext", "Workload", "apply_overrides", "build_context", "launch", "load_recipe", "reduce_gradients",
    "seed_step", "train", "train_step", "under_torchrun",
]  # fmt: skip


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)

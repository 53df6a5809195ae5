"""Offline greedy speculative decoding of a DFlash / DFlash2 drafter against its target (`eval` command).

    choices.py  the command's device and dtype names (no torch: the CLI parser imports it alone)
    prompts.py  token ids from JSONL (input_ids | text | chat messages) or a feature store's samples
    load.py     drafter (checkpoint, training output, SGLang export; or untrained) + target, pair checks
    target.py   chunked prefill and block verification over one transformers KV cache
    drafter.py  the drafter's appended-only context K/V and one block's proposals (DFlash2: selector walk)
    loop.py     the verify loop (longest matching prefix + bonus), as SGLang's DFLASH worker runs it
    metrics.py  tau, accepted-length histogram, per-slot acceptance, context-position buckets
    run.py      evaluate(): all of it, the summary line, the JSON and the PNG

docs/eval.md says what tau is, how it maps to SGLang's `spec_accept_length`, and what is left out.
"""

import importlib

# Lazy exports: the CLI's parser imports eval.choices alone, without torch or the models behind the rest.
_EXPORTS = {
    "DraftContext": "drafter", "block_visibility": "drafter", "check_pair": "load", "check_positions": "load",
    "load_drafter": "load", "load_eval_target": "load", "SequenceResult": "loop", "VerifyStep": "loop",
    "speculative_generate": "loop", "BUCKET_EDGES": "metrics", "summarize": "metrics",
    "jsonl_prompts": "prompts", "store_prompts": "prompts", "EvalOptions": "run", "evaluate": "run",
    "plot_tau": "run", "run_prompts": "run", "summary_line": "run", "TargetRunner": "target",
}  # fmt: skip
__all__ = [
    "BUCKET_EDGES",
    "DraftContext",
    "EvalOptions",
    "SequenceResult",
    "TargetRunner",
    "VerifyStep",
    "block_visibility",
    "check_pair",
    "check_positions",
    "evaluate",
    "jsonl_prompts",
    "load_drafter",
    "load_eval_target",
    "plot_tau",
    "run_prompts",
    "speculative_generate",
    "store_prompts",
    "summarize",
    "summary_line",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)

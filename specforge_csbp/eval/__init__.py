"""Offline greedy speculative decoding of a DFlash / DFlash2 drafter against its target (`eval` command).

    prompts.py  token ids from JSONL (input_ids | text | chat messages) or a feature store's samples
    load.py     drafter (checkpoint, training output, SGLang export; or untrained) + target, pair checks
    target.py   chunked prefill and block verification over one transformers KV cache
    drafter.py  the drafter's appended-only context K/V and one block's proposals (DFlash2: selector walk)
    loop.py     the verify loop (longest matching prefix + bonus), as SGLang's DFLASH worker runs it
    metrics.py  tau, accepted-length histogram, per-slot acceptance, context-position buckets
    run.py      evaluate(): all of it, the summary line, the JSON and the PNG

docs/eval.md says what tau is, how it maps to SGLang's `spec_accept_length`, and what is left out.
"""

from .drafter import DraftContext, block_visibility
from .load import check_pair, check_positions, load_drafter, load_eval_target
from .loop import SequenceResult, VerifyStep, speculative_generate
from .metrics import BUCKET_EDGES, summarize
from .prompts import jsonl_prompts, store_prompts
from .run import EvalOptions, evaluate, plot_tau, run_prompts, summary_line
from .target import TargetRunner

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

"""The long-context study: does a drafter trained on long sequences keep its acceptance deep into the context?

    documents.py  synthetic documents, deterministic from a seed: local Markov text, key-value records queried
                  much later, spans repeated verbatim far away; every long-range token knows its source
    target.py     the study's small Qwen3 target: config per scale, training on the fly, accuracy by distance
    grid.py       the drafter grid: architecture (full, swa, swa-full) x recipe (short, long, short-then-long, ...)
    study.py      the stages (target, capture, train, eval, report) and their scales (cpu, gpu)
    report.py     records of the eval results, the plot and the tables (docs/long_context.md's report block)
"""

__all__ = ["documents", "grid", "report", "study", "target"]

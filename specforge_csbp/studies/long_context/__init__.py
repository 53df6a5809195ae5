"""The long-context study: does a drafter trained on long sequences keep its acceptance deep into the context?

    documents.py  synthetic documents, deterministic from a seed: local Markov text, key-value records queried
                  much later, spans repeated verbatim far away; every long-range token knows its source
    target.py     the study's small Qwen3 target: config per scale, training on the fly, accuracy by distance
    study.py      the stages (target, capture, train, eval, report) and their scales (cpu, gpu)
"""

__all__ = ["documents", "study", "target"]

"""Synthetic documents that mix local structure with long-range dependencies, deterministic from a seed.

A document is a run of segments over a 512-token vocabulary (ids 0-7 are reserved / markers):

    filler   a word Markov chain: each word has 4 successors drawn from a seeded table (p = .55 .25 .12 .08),
             so the next word is often guessable from the last one alone - the local structure
    record   KEY k1 k2 SEP v1 v2 v3 v4 END            (early in the document: the first `record_zone`)
    query    ASK k1 k2 SEP v1 v2 v3 v4 END            (a record's key asked again, far later; the values
                                                      must be copied from the record)
    repeat   a span of 32-128 earlier tokens copied verbatim, from a source distance drawn log-uniform in
             [min_distance, position]: thousands to tens of thousands of tokens back in a long document

          0                record_zone                                           length
          |KEY..END filler KEY..END|  filler  [repeat of s..s+n]  filler  ASK..END  ...|
                 ^ source -----------------------------------------------------^ dependent token

`Document.deps` lists every dependent token: (position, source position, kind) with kind "query" (a value
after ASK .. SEP) or "repeat" (offset >= 4 inside a copied span: the first tokens name the span, the rest
follow from the source). Accuracy by dependency distance is measured over those positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ASK", "END", "FIRST_WORD", "KEY", "SEP", "DocSpec", "Document", "eval_prompts", "far_positions",
           "local_prompts", "make_document"]

KEY, ASK, SEP, END = 4, 5, 6, 7
FIRST_WORD = 8  # ids 0-3: the tokenizer's pad / bos / eos / mask; 4-7: markers; words from 8 on
KEY_RANGE = (8, 72)  # key tokens: 64 x 64 distinct keys
SUCCESSORS, SUCCESSOR_P = 4, np.array([0.55, 0.25, 0.12, 0.08])
REPEAT_HEAD = 4  # the first tokens of a repeat are its cue, not a dependency


@dataclass(frozen=True)
class DocSpec:
    """What a document family looks like; `seed` fixes the Markov table, (seed, index) each document."""

    length: int
    vocab_size: int = 512
    seed: int = 0
    record_zone: float = 0.25  # records are written in the first quarter of the document
    p_record: float = 0.25  # per segment, inside the record zone
    p_query: float = 0.12  # per segment, once records exist
    p_repeat: float = 0.06  # per segment, once min_distance tokens exist
    min_distance: int = 64
    repeat_len: tuple[int, int] = (32, 128)
    filler_len: tuple[int, int] = (8, 48)
    random_filler: float = 0.0  # share of filler segments of uniform words (the target's dense warm-up only)

    def __post_init__(self) -> None:
        if self.length < 16:
            raise ValueError(f"length must be >= 16 tokens; got {self.length}")
        if self.vocab_size < KEY_RANGE[1] + 8:
            raise ValueError(f"vocab_size must be >= {KEY_RANGE[1] + 8}; got {self.vocab_size}")


@dataclass
class Document:
    tokens: np.ndarray  # int64 [length]
    deps: list[tuple[int, int, str]] = field(default_factory=list)  # (position, source position, kind)


def _successors(spec: DocSpec) -> np.ndarray:
    rng = np.random.default_rng([spec.seed, 0x5EED])
    return rng.integers(FIRST_WORD, spec.vocab_size, size=(spec.vocab_size, SUCCESSORS))


def make_document(spec: DocSpec, index: int) -> Document:
    """Document `index` of the family `spec` (the same tokens for the same (spec, index), on every machine)."""
    table = _successors(spec).tolist()
    rng = np.random.default_rng([spec.seed, index, 1])
    out = np.empty(spec.length + 256, dtype=np.int64)
    deps: list[tuple[int, int, str]] = []
    records: list[tuple[int, int, int]] = []  # (k1, k2, position of v1)
    n, word = 0, int(rng.integers(FIRST_WORD, spec.vocab_size))
    zone = int(spec.record_zone * spec.length)
    while n < spec.length:
        u = rng.random()
        if n < zone and u < spec.p_record:
            k1, k2 = rng.integers(*KEY_RANGE, size=2)
            vals = rng.integers(FIRST_WORD, spec.vocab_size, size=4)
            out[n : n + 9] = [KEY, k1, k2, SEP, *vals, END]
            records.append((int(k1), int(k2), n + 4))
            n += 9
        elif records and u < spec.p_record + spec.p_query and n >= zone // 2:
            k1, k2, src = records[int(rng.integers(len(records)))]
            out[n : n + 4] = [ASK, k1, k2, SEP]
            out[n + 4 : n + 8] = out[src : src + 4]
            deps.extend((n + 4 + j, src + j, "query") for j in range(4))
            out[n + 8] = END
            n += 9
        elif n > spec.min_distance + spec.repeat_len[1] and u < spec.p_record + spec.p_query + spec.p_repeat:
            span = int(rng.integers(*spec.repeat_len))
            dist = int(np.exp(rng.uniform(np.log(spec.min_distance + span), np.log(n))))
            src = n - dist
            out[n : n + span] = out[src : src + span]
            deps.extend((n + j, src + j, "repeat") for j in range(REPEAT_HEAD, span))
            n += span
        else:
            size = int(rng.integers(*spec.filler_len))
            if spec.random_filler and rng.random() < spec.random_filler:
                words = rng.integers(FIRST_WORD, spec.vocab_size, size=size).tolist()  # only a copy predicts these
                word = words[-1]
            else:
                words = []
                for c in rng.choice(SUCCESSORS, p=SUCCESSOR_P, size=size).tolist():
                    word = table[word][c]
                    words.append(word)
            out[n : n + len(words)] = words
            n += len(words)
    deps = [d for d in deps if d[0] < spec.length]
    return Document(out[: spec.length].copy(), deps)


def eval_prompts(spec: DocSpec, indices: range | list[int], cuts_per_doc: int) -> list[dict]:
    """Held-out prompts: each document cut just inside `cuts_per_doc` of its repeats (after the cue), so the
    continuation is the rest of a span whose source lies far back; returns {"input_ids", "position",
    "distance"} records, cut positions spread over the document."""
    prompts = []
    for i in indices:
        doc = make_document(spec, i)
        heads = [(p, s) for p, s, kind in doc.deps if kind == "repeat"]
        starts = [(p, s) for j, (p, s) in enumerate(heads) if j == 0 or heads[j - 1][0] != p - 1]
        if not starts:
            continue
        picks = np.linspace(0, len(starts) - 1, num=min(cuts_per_doc, len(starts))).round().astype(int)
        for j in sorted(set(picks.tolist())):
            p, s = starts[j]
            prompts.append({"input_ids": doc.tokens[:p].tolist(), "position": p, "distance": p - s, "doc": i})
    return prompts


def far_positions(doc: Document) -> np.ndarray:
    """A mask over the document: True where the token is not predictable from the tokens just before it - a
    dependent token (`deps`), a repeat's cue (the first tokens of a copied span, not in `deps`), a marker or
    anything between KEY and END (records and queries: random keys and values), and the token after any of
these (the filler resumes from the word before the interruption)."""
    far = np.zeros(len(doc.tokens), dtype=bool)
    repeats = sorted(p for p, _, kind in doc.deps if kind == "repeat")
    for j, p in enumerate(repeats):
        far[p] = True
        if j == 0 or repeats[j - 1] != p - 1:  # a span's first dependent token: its cue lies just before
            far[max(0, p - REPEAT_HEAD) : p] = True
    for p, _, kind in doc.deps:
        far[p] = True
    inside = False
    for i, t in enumerate(doc.tokens.tolist()):
        if t in (KEY, ASK):
            inside = True
        far[i] |= inside
        if t == END:
            inside = False
    far[1:] |= far[:-1].copy()  # after a record, query or repeat the filler resumes from the word before it
    return far


def local_prompts(spec: DocSpec, indices: range | list[int], cuts_per_doc: int, span: int) -> list[dict]:
    """Held-out prompts whose continuation is local: each document cut at `cuts_per_doc` positions (spread over
    the document) followed by `span` tokens of Markov filler only (`far_positions` false), so the next tokens
    follow from the last word alone. Returns {"input_ids", "position", "doc"} records."""
    prompts = []
    for i in indices:
        doc = make_document(spec, i)
        far = far_positions(doc)
        # c[p] = number of far tokens in [0, p): a cut at p is local when [p, p + span) holds none
        c = np.concatenate([[0], np.cumsum(far)])
        ends = np.arange(span, len(far) + 1)
        starts = np.flatnonzero(c[ends] - c[ends - span] == 0)
        starts = starts[starts >= span]  # a prompt of a few tokens tells nothing
        if len(starts) == 0:
            continue
        picks = np.linspace(0, len(starts) - 1, num=min(cuts_per_doc, len(starts))).round().astype(int)
        for p in sorted({int(starts[j]) for j in picks}):
            prompts.append({"input_ids": doc.tokens[:p].tolist(), "position": p, "doc": i})
    return prompts

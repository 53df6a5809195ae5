"""A seeded synthetic chat language with structure a tiny model (and a drafter) can learn.

It reuses the sentence pools the bundled tokenizer was trained on (`_build._TOPICS`), so every sentence
tokenizes into few BPE tokens. Each topic's sentences form a cycle s_0 -> s_1 -> ... -> s_0, and one
conversation is a walk along one cycle, cut into a user turn and the assistant's answer:

    [system: "You are a concise and careful assistant."]      (one in three conversations)
    user:      s_i [s_(i+1)]                                   (one or two sentences, any start i)
    assistant: s_(i+u), s_(i+u+1), ..., k sentences             (k in MIN_SENTENCES..MAX_SENTENCES)

Everything after the user turn is fixed by its last sentence, except the answer's length k: a learner
that knows the rule predicts every token inside a sentence and the next sentence exactly, and is unsure
only whether an answer ends after a sentence. A target trained on it has long deterministic greedy
continuations, which is what a drafter can learn to guess several tokens ahead.

`conversations(seed, n)` is deterministic: the same seed gives the same list on every machine.
"""

from __future__ import annotations

import random

from ._build import _TOPICS

__all__ = [
    "MAX_SENTENCES", "MIN_SENTENCES", "SYSTEM_PROMPT", "TOPICS", "conversation", "conversations", "walk",
]  # fmt: skip

SYSTEM_PROMPT = "You are a concise and careful assistant."
TOPICS: tuple[str, ...] = tuple(sorted(_TOPICS))
MIN_SENTENCES, MAX_SENTENCES = 2, 4  # the answer's length k, in sentences


def walk(topic: str, start: int, sentences: int) -> str:
    """`sentences` sentences of `topic`'s cycle from index `start` on, joined by spaces."""
    pool = _TOPICS[topic]
    return " ".join(pool[(start + i) % len(pool)] for i in range(sentences))


def conversation(rng: random.Random, *, with_answer: bool = True) -> dict:
    """One {"messages": [...]} sample; `with_answer=False` stops after the user turn (a prompt)."""
    topic = rng.choice(TOPICS)
    start = rng.randrange(len(_TOPICS[topic]))
    asked = rng.randint(1, 2)
    answer = rng.randint(MIN_SENTENCES, MAX_SENTENCES)
    messages = []
    if rng.randrange(3) == 0:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": walk(topic, start, asked)})
    if with_answer:
        messages.append({"role": "assistant", "content": walk(topic, start + asked, answer)})
    return {"messages": messages}


def conversations(seed: int, n: int, *, with_answer: bool = True) -> list[dict]:
    """`n` conversations drawn from the grammar with `random.Random(seed)`."""
    rng = random.Random(seed)
    return [conversation(rng, with_answer=with_answer) for _ in range(n)]

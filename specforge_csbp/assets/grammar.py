"""A seeded synthetic chat language with structure a tiny model (and a drafter) can learn.

It reuses sentence pools the bundled tokenizer was trained on (`_build._TOPICS`, the topics in `TOPICS`),
so every sentence tokenizes into few BPE tokens. Each topic's sentences form a chain s_0 -> s_1 -> ... ->
s_(n-1), and one conversation is a stretch of one chain, cut into a user turn and the assistant's answer:

    [system: "You are a concise and careful assistant."]      (one in three conversations)
    user:      [s_(i-1)] s_i                                   (one or two sentences, i < n-1)
    assistant: s_(i+1) s_(i+2) ... s_(n-1)                     (to the end of the chain, then end of turn)

The answer is fixed by the user turn's last sentence: a learner that knows the rule predicts every token of
it, its end included, from the few tokens before. A target trained on it gives long deterministic greedy
continuations, which is what a drafter can learn to guess several tokens ahead.

`conversations(seed, n)` is deterministic: the same seed gives the same list on every machine.
"""

from __future__ import annotations

import random

from ._build import _TOPICS

__all__ = ["SYSTEM_PROMPT", "TOPICS", "answer_to", "conversation", "conversations"]

SYSTEM_PROMPT = "You are a concise and careful assistant."
# three of the five topics (17 sentences): what a hidden-64 target memorises well within seconds of CPU
TOPICS: tuple[str, ...] = ("cooking", "math", "travel")


def answer_to(topic: str, last: int) -> str:
    """The grammar's answer after sentence `last` of `topic`: the rest of the chain."""
    return " ".join(_TOPICS[topic][last + 1 :])


def conversation(rng: random.Random, *, with_answer: bool = True) -> dict:
    """One {"messages": [...]} sample; `with_answer=False` stops after the user turn (a prompt)."""
    topic = rng.choice(TOPICS)
    pool = _TOPICS[topic]
    last = rng.randrange(len(pool) - 1)
    first = max(0, last - rng.randrange(2))
    messages = []
    if rng.randrange(3) == 0:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": " ".join(pool[first : last + 1])})
    if with_answer:
        messages.append({"role": "assistant", "content": answer_to(topic, last)})
    return {"messages": messages}


def conversations(seed: int, n: int, *, with_answer: bool = True) -> list[dict]:
    """`n` conversations drawn from the grammar with `random.Random(seed)`."""
    rng = random.Random(seed)
    return [conversation(rng, with_answer=with_answer) for _ in range(n)]

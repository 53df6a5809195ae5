"""The quickstart's trained target: deterministic, cached, and it has learnt the grammar (not random)."""

from __future__ import annotations

import hashlib
import json
import os
import random

import pytest
import torch

from specforge_csbp.assets._build import _TOPICS
from specforge_csbp.assets.grammar import TOPICS, answer_to, conversation, conversations
from specforge_csbp.assets.target import TargetRecipe, _batch, build_target, greedy_answers, train_target


def _last_sentence(text: str) -> str:
    """The pool sentence `text` ends with."""
    return next(x for pool in _TOPICS.values() for x in pool if text.endswith(x))


def _weights_sha(path: str) -> str:
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_grammar_is_seeded_and_follows_its_rule():
    assert conversations(7, 20) == conversations(7, 20)
    assert conversations(7, 20) != conversations(8, 20)
    rng = random.Random(0)
    for _ in range(50):
        user, answer = (m["content"] for m in conversation(rng)["messages"][-2:])
        last = _last_sentence(user)
        topic = next(t for t in TOPICS if last in _TOPICS[t])
        assert answer == answer_to(topic, _TOPICS[topic].index(last)) and answer
    assert all(c["messages"][-1]["role"] == "user" for c in conversations(3, 10, with_answer=False))


def test_build_target_is_deterministic_and_cached(tmp_path):
    recipe = TargetRecipe(seed=3, steps=2, batch_size=2)
    a = build_target(str(tmp_path / "a"), recipe, log=None)
    b = build_target(str(tmp_path / "b"), recipe, log=None)
    assert _weights_sha(a) == _weights_sha(b)
    other = build_target(str(tmp_path / "c"), TargetRecipe(seed=4, steps=2, batch_size=2), log=None)
    assert _weights_sha(other) != _weights_sha(a)
    with open(os.path.join(a, "build.json")) as f:
        assert json.load(f)["key"] == recipe.key
    # same recipe: reused without training (the weights file is not rewritten)
    mtime = os.stat(os.path.join(a, "model.safetensors")).st_mtime_ns
    logs: list[str] = []
    build_target(a, recipe, log=logs.append)
    assert os.stat(os.path.join(a, "model.safetensors")).st_mtime_ns == mtime and "reusing" in logs[0]
    # another recipe into the same directory: rebuilt
    build_target(a, TargetRecipe(seed=4, steps=2, batch_size=2), log=None)
    assert _weights_sha(a) == _weights_sha(other)


def test_recipe_rejects_bad_values():
    with pytest.raises(ValueError, match="target recipe"):
        TargetRecipe(steps=-1)


@pytest.fixture(scope="module")
def trained():
    """The quickstart's own target (the default recipe: about 20 s of one CPU core)."""
    model, tokenizer, _ = train_target(TargetRecipe(), log=None)
    return model, tokenizer


def test_trained_target_predicts_the_grammar_far_above_chance(trained):
    """Teacher-forced next-token accuracy on held-out grammar samples: chance is ~1/512; a random target
    stays near it, the trained one is far above."""
    model, tokenizer = trained
    ids, mask, labels = _batch(tokenizer, conversations(999, 32))

    def accuracy(m) -> float:
        with torch.no_grad():
            pred = m(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
        lab = labels[:, 1:]
        return float(((pred == lab) & (lab != -100)).sum() / (lab != -100).sum())

    untrained, _, _ = train_target(TargetRecipe(seed=0, steps=0), log=None)
    assert accuracy(untrained) < 0.05
    assert accuracy(model) > 0.9


def test_greedy_answers_continue_the_grammar(trained):
    """The target's greedy answer starts with the sentence that follows the prompt's last one, and most
    answers are the grammar's whole answer (end of turn included)."""
    model, tokenizer = trained
    prompts = conversations(5, 16, with_answer=False)
    answers = greedy_answers(model, tokenizer, prompts, max_new_tokens=160)
    hits = exact = 0
    for p, a in zip(prompts, answers):
        assert a["messages"][:-1] == p["messages"] and a["messages"][-1]["role"] == "assistant"
        last = _last_sentence(p["messages"][-1]["content"])
        topic = next(t for t in TOPICS if last in _TOPICS[t])
        expected = answer_to(topic, _TOPICS[topic].index(last))
        hits += a["messages"][-1]["content"].split()[:4] == expected.split()[:4]
        exact += a["messages"][-1]["content"] == expected
    assert hits >= 12  # chance: a 1-in-17 guess of the next sentence
    assert exact >= 5  # measured 7 of 16; a random target: 0


def test_build_data_writes_answered_samples_and_held_out_prompts(tmp_path, capsys):
    from specforge_csbp.assets.quickstart import build_data

    target = build_target(str(tmp_path / "target"), TargetRecipe(seed=1, steps=1, batch_size=2), log=None)
    kw = dict(seed=0, train_samples=3, eval_prompts=2, max_new_tokens=8)
    train, prompts = build_data(target, str(tmp_path / "data"), **kw)
    rows = [json.loads(line) for line in open(train)]
    held = [json.loads(line) for line in open(prompts)]
    assert len(rows) == 3 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert len(held) == 2 and all(p["messages"][-1]["role"] == "user" for p in held)
    mtime = os.stat(train).st_mtime_ns
    build_data(target, str(tmp_path / "data"), **kw)  # same recipe: reused
    assert os.stat(train).st_mtime_ns == mtime and "reusing" in capsys.readouterr().out
    build_data(target, str(tmp_path / "data"), **dict(kw, train_samples=4))  # another count: rewritten
    assert sum(1 for _ in open(train)) == 4

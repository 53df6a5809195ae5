"""bench/isolation: fresh_point (a later mode of a launch compiles as if it ran first) and warm_up (timed
steps start from a steady compile state)."""

import pytest
import torch

from specforge_csbp.bench.isolation import compiled_graphs, fresh_point, warm_up


def test_fresh_point_forgets_shape_history():
    compiled_inputs: list[list] = []

    def backend(gm, example_inputs):
        compiled_inputs.append(list(example_inputs))
        return gm.forward

    def body(x):
        return (x * 2).sum()

    fresh_point()
    fn = torch.compile(body, backend=backend, dynamic=None)  # the setting of attention/flex.py
    fn(torch.ones(3))
    fn(torch.ones(5))  # second size: recompiled once, with a symbolic size
    fn(torch.ones(7))  # served by that dynamic graph
    assert len(compiled_inputs) == 2
    assert not any(isinstance(a, torch.SymInt) for a in compiled_inputs[0])
    assert any(isinstance(a, torch.SymInt) for a in compiled_inputs[1])

    fresh_point()
    fn(torch.ones(7))  # what a second mode sees: a static graph again, not the first mode's dynamic one
    assert len(compiled_inputs) == 3
    assert not any(isinstance(a, torch.SymInt) for a in compiled_inputs[2])


def _counting_backend(gm, example_inputs):
    return gm.forward


def test_warm_up_runs_until_a_step_compiles_nothing():
    fresh_point()
    fn = torch.compile(lambda x: (x * 3).sum(), backend=_counting_backend, dynamic=None)
    sizes = iter([3, 5, 7, 9, 11, 13])  # like a drafter step: every step its own lengths
    steps = warm_up(lambda: fn(torch.ones(next(sizes))), min_steps=1, max_steps=6)
    # step 1 compiles a static graph, step 2 the dynamic one, step 3 compiles nothing: timing may start
    assert steps == 3
    before = compiled_graphs()
    fn(torch.ones(next(sizes)))
    assert compiled_graphs() == before


def test_warm_up_runs_min_steps_even_when_nothing_compiles():
    calls = []
    assert warm_up(lambda: calls.append(1), min_steps=2, max_steps=5) == 2
    assert len(calls) == 2


def test_warm_up_stops_at_max_steps_while_graphs_keep_coming():
    fresh_point()
    fn = torch.compile(lambda x: (x + 1).sum(), backend=_counting_backend, dynamic=False)  # a graph per size
    sizes = iter(range(2, 20))
    assert warm_up(lambda: fn(torch.ones(next(sizes))), min_steps=0, max_steps=4) == 4


def test_warm_up_follows_the_agreed_count_of_every_rank():
    # this rank compiles nothing, another rank compiles in its first 3 steps: all run 4 steps (the 4th is the
    # first that every rank ran without compiling)
    other_rank_new = iter([2.0, 1.0, 1.0, 0.0, 0.0])
    calls = []
    steps = warm_up(lambda: calls.append(1), 1, 8, agree=lambda mine: max(mine, next(other_rank_new)))
    assert steps == 4 == len(calls)


def test_warm_up_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_steps <= max_steps"):
        warm_up(lambda: None, 3, 2)

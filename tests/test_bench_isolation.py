"""bench/isolation.fresh_point: a later mode of a launch compiles as if it ran first."""

import torch

from specforge_csbp.bench.isolation import fresh_point


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

"""count_non_finite: the min/max pass that decides must agree with an elementwise isfinite count for every
dtype, every kind of bad value and every position (the vectorised body and the scalar tail of a reduction)."""

from __future__ import annotations

import math

import pytest
import torch

from specforge_csbp.preflight import check_finite_tensors, count_non_finite

_BAD = (math.nan, math.inf, -math.inf)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 7, 64, 1000, 4099])
def test_every_bad_value_at_every_position_is_counted(dtype, numel):
    base = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    assert count_non_finite(base) == 0
    positions = sorted({0, numel // 2, numel - 1, max(0, numel - 3)})
    for bad in _BAD:
        for pos in positions:
            x = base.clone()
            x[pos] = bad
            assert count_non_finite(x) == 1, (dtype, numel, bad, pos)
    x = base.clone()
    x[positions] = torch.tensor([_BAD[i % 3] for i in range(len(positions))], dtype=torch.float64).to(dtype)
    assert count_non_finite(x) == int((~torch.isfinite(x)).sum()) == len(positions)


def test_shapes_views_and_non_float_tensors():
    x = torch.zeros(5, 8)
    x[4, 7] = math.nan
    assert count_non_finite(x) == 1
    assert count_non_finite(x[:4]) == 0  # a view that leaves the NaN out
    assert count_non_finite(x.t()) == 1  # non-contiguous
    assert count_non_finite(torch.empty(0, 3)) == 0
    assert count_non_finite(torch.arange(10)) == 0
    assert count_non_finite(torch.tensor([True, False])) == 0


def test_check_finite_tensors_names_the_tensor_and_the_count():
    good, bad = torch.ones(3), torch.tensor([1.0, math.inf, math.nan])
    check_finite_tensors({"a": good, "ids": torch.arange(3)}, "--drafter", "ckpt")
    with pytest.raises(ValueError) as err:
        check_finite_tensors({"a": good, "w": bad}, "--drafter", "ckpt")
    assert str(err.value) == (
        "--drafter: ckpt: tensor 'w' has 2 non-finite value(s) (NaN or inf) of 3; these weights cannot be used - "
        "take an earlier checkpoint"
    )

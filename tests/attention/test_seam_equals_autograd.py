"""The partial-attention seam and the LSE merge against plain autograd attention, float64."""

import pytest
import torch

from specforge_csbp.attention import merge_partials, partial_attention
from specforge_csbp.layout import bdlm_plan
from specforge_csbp.masks import Visibility


def naive(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(g, 1), torch.logsumexp(s, -1)


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("rule", ["causal", "bidirectional"])
def test_dense_seam_matches_autograd_attention(heads, kv_heads, rule):
    torch.manual_seed(0)
    plan = bdlm_plan("reference", 12, 4, 1)[0]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, 4, rule)
    q, k, v = rand(2, heads, 24, 8), rand(2, kv_heads, 24, 8), rand(2, kv_heads, 24, 8)
    out, lse = partial_attention(q, k, v, vis)
    ref_out, ref_lse = naive(q, k, v, vis.dense(), 8**-0.5)
    g, gl = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * g).sum() + (lse * gl).sum(), (q, k, v))
    want = torch.autograd.grad((ref_out * g).sum() + (ref_lse * gl).sum(), (q, k, v))
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-12) and torch.allclose(lse, ref_lse, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_rows_that_see_nothing_give_zero_out_minus_inf_lse_and_zero_grads():
    plan = bdlm_plan("reference", 8, 4, 1)[0]
    vis = Visibility(plan.q_tokens, plan.kv_tokens.masked(torch.ones(16, dtype=torch.bool)), 4)
    q, k, v = rand(1, 2, 16, 4), rand(1, 2, 16, 4), rand(1, 2, 16, 4)
    out, lse = partial_attention(q, k, v, vis)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    (out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()).backward()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_merge_of_a_key_split_equals_attention_over_all_keys():
    torch.manual_seed(1)
    plan = bdlm_plan("reference", 16, 4, 1)[0]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, 4)
    q, k, v = rand(1, 4, 32, 8), rand(1, 2, 32, 8), rand(1, 2, 32, 8)
    full_out, full_lse = partial_attention(q, k, v, vis)
    # split keys into two disjoint sets (interleaved), many rows see nothing in one of them
    a, b = torch.arange(0, 32, 2), torch.arange(1, 32, 2)
    va = Visibility(plan.q_tokens, plan.kv_tokens.select(a), 4)
    vb = Visibility(plan.q_tokens, plan.kv_tokens.select(b), 4)
    oa, la = partial_attention(q, k[:, :, a], v[:, :, a], va)
    ob, lb = partial_attention(q, k[:, :, b], v[:, :, b], vb)
    out, lse = merge_partials(oa, la, ob, lb)
    g, gl = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * g).sum() + (lse * gl).sum(), (q, k, v))
    want = torch.autograd.grad((full_out * g).sum() + (full_lse * gl).sum(), (q, k, v))
    assert torch.allclose(out, full_out, rtol=0, atol=1e-12) and torch.allclose(lse, full_lse, rtol=0, atol=1e-12)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, rtol=0, atol=1e-12)


def test_fp32_and_bf16_inputs_keep_their_dtype_with_fp32_lse():
    plan = bdlm_plan("reference", 8, 4, 1)[0]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, 4)
    for dt in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 2, 16, 8, dtype=dt)
        out, lse = partial_attention(q, q, q, vis)
        assert out.dtype == dt and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "shapes, dtypes, message",
    [
        (((1, 4, 16, 8), (1, 3, 16, 8), (1, 3, 16, 8)), None, r"heads \(4\) must be a multiple of kv_heads \(3\)"),
        (((1, 4, 16, 8), (1, 2, 16, 8), (1, 2, 16, 4)), None, "k and v must have the same shape"),
        (((4, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8)), None, "q must be"),
        (((1, 4, 16, 8),) * 3, (torch.float64, torch.float32, torch.float64), "q, k, v must share one dtype"),
        (((1, 4, 12, 8),) * 3, None, "visibility covers 16 queries x 16 keys"),
    ],
)
def test_bad_qkv_gives_one_line_errors(shapes, dtypes, message):
    plan = bdlm_plan("reference", 8, 4, 1)[0]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, 4)
    dtypes = dtypes or (torch.float64,) * 3
    q, k, v = (torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes))
    with pytest.raises(ValueError, match=message) as err:
        partial_attention(q, k, v, vis)
    assert "\n" not in str(err.value)


def test_device_mismatch_is_named():
    plan = bdlm_plan("reference", 8, 4, 1)[0]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, 4)
    q = torch.zeros(1, 2, 16, 4)
    k = torch.zeros(1, 2, 16, 4, device="meta")
    with pytest.raises(ValueError, match="q, k, v must be on one device"):
        partial_attention(q, k, k, vis)

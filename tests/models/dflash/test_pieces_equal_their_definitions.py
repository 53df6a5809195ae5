"""Pieces of the drafter against loop transcriptions of their definitions (single process, float64)."""

import math

import pytest
import torch

from specforge_csbp.layout import CLEAN, NOISY, TokenSet
from specforge_csbp.masks import Visibility
from specforge_csbp.models.dflash import (
    CandidateSelector,
    DFlash2DraftModel,
    DFlashGroupedConv,
    drafter_plans,
    make_dflash_config,
    plan_attention,
    reference_attention,
)
from specforge_csbp.objectives.dflash import (
    DFlashObjective,
    block_targets,
    dpace_weights,
    loss_index,
    loss_terms,
    position_weights,
    sample_anchors,
    valid_anchor_positions,
)
from specforge_csbp.objectives.linear_ce_topk import linear_ce_topk

G = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64)


# -- DFlash2 convolution -----------------------------------------------------------------------------
def test_conv_starts_as_identity_and_equals_its_formula():
    S, taps, H, gs = 4, 3, 8, 2
    conv = DFlashGroupedConv(H, S, taps, gs).double()
    x = rand(2, 3 * S, H)
    y, coef = conv.prepare(x)
    assert torch.equal(y, x) and torch.equal(conv.finish(x, coef), x)
    with torch.no_grad():
        conv.base_kernel.copy_(rand(2, taps, H))
        conv.kernel_projection.weight.copy_(rand(2 * taps * (H // gs), H))
    y, coef = conv.prepare(x)
    delta = conv.kernel_projection(x).view(2, 3 * S, 2, taps, H // gs)
    ref = torch.zeros_like(x)
    for b in range(2):
        for i in range(3 * S):
            for t in range(taps):
                if i % S >= t:  # causal, and never reaching into the previous block
                    k = conv.base_kernel[0, t] + delta[b, i, 0, t].repeat_interleave(gs)
                    ref[b, i] += k * x[b, i - t]
    assert torch.allclose(y, ref, rtol=0, atol=1e-12)
    assert torch.allclose(coef, delta[:, :, 1], rtol=0, atol=0)


def test_conv_output_row_depends_only_on_earlier_rows_of_its_block():
    S, H = 4, 8
    conv = DFlashGroupedConv(H, S, 3, 4).double()
    with torch.no_grad():
        conv.base_kernel.copy_(rand(2, 3, H))
        conv.kernel_projection.weight.copy_(rand(2 * 3 * 2, H))
    x = rand(1, 3 * S, H).requires_grad_()
    for row in range(3 * S):
        (grad,) = torch.autograd.grad(conv.prepare(x)[0][0, row].sum(), x)
        used = grad[0].abs().sum(-1) > 0
        block_start = row - row % S
        expected = torch.zeros(3 * S, dtype=torch.bool)
        expected[max(block_start, row - 2) : row + 1] = True
        assert torch.equal(used, expected), row


# -- DFlash2 selector --------------------------------------------------------------------------------
def test_selector_scores_equal_their_formula():
    sel = CandidateSelector(6, 11, 3, 4).double()
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(rand(*p.shape))
    h, cand, unary, pred = (
        rand(5, 6),
        torch.randint(0, 11, (5, 4), generator=G),
        rand(5, 4),
        torch.randint(0, 11, (5,), generator=G),
    )
    scores = sel(h, cand, unary, pred)
    proj = h @ sel.hidden_projection.weight.t()
    for n in range(5):
        for j in range(4):
            ref = (
                unary[n, j]
                + (sel.predecessor_codebook[pred[n]] * proj[n] * sel.successor_codebook[cand[n, j]]).sum()
            )
            assert torch.allclose(scores[n, j], ref, atol=1e-12)


# -- chunked CE with top-k ----------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_linear_ce_topk_equals_dense_autograd(chunk):
    h, w, y = (
        rand(7, 5).requires_grad_(),
        rand(13, 5).requires_grad_(),
        torch.randint(0, 13, (7,), generator=G),
    )
    gn, gt = rand(7), rand(7, 4)
    nll, top_v, top_i = linear_ce_topk(h, w, y, top_k=4, chunk_size=chunk)
    ((nll * gn).sum() + (top_v * gt).sum()).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    z = h2 @ w2.t()
    ref_nll = torch.nn.functional.cross_entropy(z, y, reduction="none")
    ref_v, ref_i = z.topk(4, dim=-1)
    ((ref_nll * gn).sum() + (ref_v * gt).sum()).backward()
    assert torch.equal(top_i, ref_i)
    for a, b in ((nll, ref_nll), (top_v, ref_v), (h.grad, h2.grad), (w.grad, w2.grad)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_linear_ce_topk_kept_logits_give_the_same_result_with_one_gemm_fewer(dtype):
    """keep_logits_bytes: the chunks' logits kept for backward instead of recomputed - bit-identical outputs
    and gradients, and backward runs only the dH GEMM per chunk (counted at the aten level)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMM(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.mm += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(10, 6, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(17, 6, generator=g, dtype=torch.float64).to(dtype)  # frozen head: no dW GEMM
    y = torch.randint(0, 17, (10,), generator=g)
    gn, gt = torch.randn(10, generator=g), torch.randn(10, 3, generator=g)
    results = {}
    for keep in (0, 10 * 17 * h0.element_size(), 10 * 17 * h0.element_size() - 1):  # recompute, keep, 1 B short
        h = h0.clone().requires_grad_()
        nll, top_v, top_i = linear_ce_topk(h, w, y, top_k=3, chunk_size=4, keep_logits_bytes=keep)
        loss = (nll * gn.to(nll.dtype)).sum() + (top_v * gt.to(top_v.dtype)).sum()
        with CountMM() as count:
            loss.backward()
        results[keep] = (nll, top_v, top_i, h.grad, count.mm)
    recompute, kept, short = results.values()
    for a, b in zip(recompute[:4], kept[:4], strict=True):
        assert torch.equal(a, b)
    assert recompute[4] == 2 * 3 and kept[4] == 3  # 3 chunks: logits + dH each, or dH only
    assert short[4] == recompute[4]  # does not fit: recomputed
    with pytest.raises(ValueError, match="keep_logits_bytes must be >= 0"):
        linear_ce_topk(h0, w, y, top_k=3, keep_logits_bytes=-1)
    with pytest.raises(ValueError, match="keep_logits_gib must be >= 0"):
        DFlashObjective(keep_logits_gib=-0.5)


# -- objective -----------------------------------------------------------------------------------------
def test_valid_anchors_targets_and_weights_of_the_docstring_example():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0.0])
    assert valid_anchor_positions(mask).tolist() == [2, 3, 4, 5, 6]
    ids = torch.arange(10, 19)
    bt = block_targets(ids, mask, torch.tensor([3, 6]), 4, mask_token_id=99)
    assert bt.draft_ids.tolist() == [[13, 99, 99, 99], [16, 99, 99, 99]]
    assert bt.targets[0].tolist() == [13, 14, 15, 16] and bt.predecessors[0, 1:].tolist() == [13, 14, 15]
    assert bt.supervised.tolist() == [[False, True, True, True], [False, True, False, False]]
    assert torch.allclose(
        position_weights(4, 2.0, dtype=torch.float64),
        torch.tensor([0, 1, math.exp(-0.5), math.exp(-1.0)], dtype=torch.float64),
    )
    assert position_weights(3, None).tolist() == [0.0, 1.0, 1.0]


def test_anchor_sampling_is_a_function_of_seed_step_and_sample_only():
    mask = (torch.rand(300, generator=G) > 0.3).double()
    valid = set(valid_anchor_positions(mask).tolist())
    obj = DFlashObjective(num_anchors=20, seed=5)
    a = sample_anchors(mask, obj, block_size=4, step=3, sample_index=1)
    assert torch.equal(a, sample_anchors(mask, obj, block_size=4, step=3, sample_index=1))
    assert not torch.equal(a, sample_anchors(mask, obj, block_size=4, step=4, sample_index=1))
    assert a.numel() == 20 and len(set(a.tolist())) == 20 and set(a.tolist()) <= valid
    assert torch.equal(a, a.sort().values)
    loc = sample_anchors(
        mask, DFlashObjective(num_anchors=20, sampling="locality", locality_stride=4), block_size=4
    )
    ranks = torch.searchsorted(valid_anchor_positions(mask), loc)
    steps = sorted(((ranks[1:] - ranks[:-1]) % len(valid)).tolist())
    assert set(steps[:-1]) <= {4, 5, 6, 7}  # one rotated strided run (stride made coprime with the count)
    few = sample_anchors(mask, DFlashObjective(num_anchors=10_000), block_size=4)
    assert few.tolist() == sorted(valid)  # shortfall="use_all": every valid anchor


def test_dpace_weights_equal_their_formula():
    prob, sup = torch.rand(3, 5, generator=G, dtype=torch.float64), torch.rand(3, 5, generator=G) > 0.3
    alpha = 0.4
    for kind in ("dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only"):
        w = dpace_weights(prob, sup, alpha, kind)
        for b in range(3):
            prefix, acc = [], 1.0
            for k in range(5):
                acc = acc * (float((1 - alpha) * prob[b, k] + alpha) if sup[b, k] else 1.0)
                prefix.append(acc)
            suffix = [sum(prefix[j] * float(sup[b, j]) for j in range(k, 5)) for k in range(5)]
            ref = {"dpace": suffix, "dpace-cumulative-confidence-only": prefix,
                   "dpace-continuation-value-only": [s / p for s, p in zip(suffix, prefix)]}[kind]  # fmt: skip
            assert torch.allclose(w[b], torch.tensor(ref, dtype=torch.float64), atol=1e-12), kind


# -- the rule's sliding window and in-block causality ---------------------------------------------------
def test_window_and_noisy_causal_follow_the_rule():
    ctx = TokenSet(
        torch.arange(10), torch.full((10,), CLEAN), torch.full((10,), -1), torch.zeros(10, dtype=torch.long)
    )
    a, S, W = 6, 3, 4
    draft = TokenSet(
        torch.arange(a, a + S), torch.full((S,), NOISY), torch.zeros(S, dtype=torch.long), torch.full((S,), a)
    )
    m = Visibility(draft, TokenSet.cat([ctx, draft]), S, window=W, noisy_causal=True).dense()
    for j in range(S):
        p = a + j
        assert m[j, :10].tolist() == [p - W < c < a for c in range(10)]
        assert m[j, 10:].tolist() == [i <= j for i in range(S)]
    m = Visibility(draft, TokenSet.cat([ctx, draft]), S).dense()  # defaults: no window, bidirectional block
    assert m[:, :10].tolist() == [[c < a for c in range(10)]] * S and bool(m[:, 10:].all())


# -- plans ---------------------------------------------------------------------------------------------
def _config(**kw):
    base = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                "head_dim": 8, "vocab_size": 17, "num_target_layers": 4, "target_layer_ids": [1, 2], "mask_token_id": 16, "block_size": 4,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}  # fmt: skip
    base.update(kw)
    return make_dflash_config(**base)


def _need(anchors, L, W):
    need = torch.zeros(L, dtype=torch.bool)
    for a in anchors.tolist():
        need[max(0, a - W + 1) : a] = True
    return need


@pytest.mark.parametrize("bucket", [1, 7])
def test_csbp_plans_partition_anchors_and_share_only_needed_windows(bucket):
    cfg, L, P = _config(), 200, 2
    anchors = torch.tensor([3, 20, 41, 77, 90, 130, 160, 190])
    plans = drafter_plans("csbp", L, anchors, cfg, P, bucket=bucket)
    owned = torch.cat([p.owned for p in plans])
    assert sorted(owned.tolist()) == list(range(anchors.numel())) and all(p.owned.numel() >= 1 for p in plans)
    assert sorted(torch.cat([p.ctx_positions for p in plans]).tolist()) == list(range(L))
    for r, plan in enumerate(plans):
        lp = plan.layers["sliding_attention"]
        kv_ctx = lp.shard.kv_rows[: lp.shard.kv_rows.numel() - plan.owned.numel() * 4]
        shared_pos = kv_ctx[lp.shard.shared]
        other = plans[1 - r].owned_anchors
        in_shard = torch.zeros(L, dtype=torch.bool)
        in_shard[plan.ctx_positions] = True
        needed = torch.nonzero(in_shard & _need(other, L, 8)).flatten()
        assert set(needed.tolist()) <= set(shared_pos.tolist())
        extra = set(shared_pos.tolist()) - set(needed.tolist())
        if bucket == 1:
            assert not extra  # exactly the other rank's windows travel
        else:
            assert shared_pos.numel() % bucket == 0 or shared_pos.numel() == kv_ctx.numel()
            assert not (extra & set(torch.nonzero(_need(other, L, 8)).flatten().tolist()))
        full = plan.layers["full_attention"]
        assert full.shard.shared.numel() == plan.ctx_positions.numel() and full.ctx_index is None


def test_cp_plans_hold_every_anchor_and_scale_the_loss():
    plans = drafter_plans("cp", 64, torch.tensor([5, 30, 50]), _config(), 3)
    assert all(p.owned.tolist() == [0, 1, 2] and p.loss_scale == pytest.approx(1 / 3) for p in plans)


def test_reference_attention_equals_the_reference_plan():
    cfg = _config(dflash2=True, conv_group_size=8, selector_rank=2, selector_top_k=3)
    model = DFlash2DraftModel(cfg).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(rand(*p.shape) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    L, anchors = 30, torch.tensor([4, 11, 25])
    plan = drafter_plans("reference", L, anchors, cfg, 1)[0]
    pos = (anchors[:, None] + torch.arange(4)).reshape(-1)
    x, feats = rand(1, 12, 16), rand(1, L, 32)
    a = model(x, pos, feats, torch.arange(L), attention=reference_attention(cfg, anchors, torch.arange(L)))
    b = model(x, pos, feats, torch.arange(L), attention=plan_attention(plan))
    assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_token_ids_are_range_checked_on_the_host_and_the_loss_then_skips_its_device_check(monkeypatch):
    """block_targets(vocab_size=V) checks the host tokens (one-line error naming input_ids); the loss of such
    blocks does not check its targets again on the device (a host sync mid-step), unless V is not its head's."""
    import specforge_csbp.objectives.dflash as dflash_objective

    ids, mask = torch.arange(10, 19), torch.ones(9)
    with pytest.raises(ValueError, match=r"input_ids: token ids must be in \[0, vocab_size\) = \[0, 18\); got 10..18"):
        block_targets(ids, mask, torch.tensor([3]), 4, mask_token_id=1, vocab_size=18)
    calls = []
    real = dflash_objective.linear_ce_topk
    monkeypatch.setattr(
        dflash_objective, "linear_ce_topk", lambda *a, **k: calls.append(k["check_targets"]) or real(*a, **k)
    )
    head = torch.randn(32, 8, dtype=torch.float64)
    hidden = torch.randn(2 * 4, 8, dtype=torch.float64)
    objective = DFlashObjective(num_anchors=2)
    for vocab, expect in ((32, False), (64, True), (None, True)):
        bt = block_targets(ids, mask, torch.tensor([2, 5]), 4, mask_token_id=1, vocab_size=vocab)
        assert bt.vocab_checked == vocab
        loss_terms(hidden, head, bt, objective, index=loss_index(bt))
        assert calls[-1] is expect

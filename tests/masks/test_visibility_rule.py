"""The one rule against a loop-based transcription of design.md section 1."""

import itertools

import pytest
import torch

from specforge_csbp.layout import CLEAN, NOISY, TokenSet, bdlm_plan
from specforge_csbp.masks import Visibility
from specforge_csbp.masks.visibility import CLEAN_RULES
from tests.support.mask_cases import drafter_shards


def rule_by_loops(L, S, bidirectional):
    """Spelled out per (query, key) pair over the 2L sequence, as design.md states it."""
    n = 2 * L
    mask = torch.zeros(n, n, dtype=torch.bool)
    for qi, ki in itertools.product(range(n), range(n)):
        q_clean, k_clean = qi < L, ki < L
        qp, kp = qi % L, ki % L
        qb, kb = qp // S, kp // S
        if q_clean and k_clean:
            ok = kb < qb or (kb == qb and (bidirectional or kp <= qp))
        elif not q_clean and not k_clean:
            ok = kb == qb
        elif not q_clean and k_clean:
            ok = kb < qb
        else:  # clean query, corrupted key: never
            ok = False
        mask[qi, ki] = ok
    return mask


@pytest.mark.parametrize("L,S", [(8, 4), (12, 3), (10, 1), (16, 16)])
@pytest.mark.parametrize("rule", ["causal", "bidirectional"])
def test_dense_mask_equals_the_rule(L, S, rule):
    plan = bdlm_plan("reference", L, S, 1)[0]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, S, rule)
    assert torch.equal(vis.dense(), rule_by_loops(L, S, rule == "bidirectional"))


def test_mask_mod_equals_dense_mask():
    plan = bdlm_plan("reference", 12, 4, 1)[0]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, 4, "causal")
    mod = vis.mask_mod("cpu")
    q_idx, k_idx = torch.meshgrid(torch.arange(24), torch.arange(24), indexing="ij")
    assert torch.equal(mod(0, 0, q_idx, k_idx), vis.dense())


def test_dflash_blocks_see_context_before_their_anchor_and_their_own_block():
    # context: clean tokens at positions 0..9; two draft blocks of 3 anchored at positions 4 and 7
    ctx = TokenSet(torch.arange(10), torch.full((10,), CLEAN), torch.zeros(10, dtype=torch.long), torch.zeros(10, dtype=torch.long))
    anchors = [4, 7]
    pos = torch.tensor([a + k for a in anchors for k in range(3)])
    block = torch.tensor([i for i in range(2) for _ in range(3)])
    start = torch.tensor([a for a in anchors for _ in range(3)])
    draft = TokenSet(pos, torch.full((6,), NOISY), block, start)
    vis = Visibility(draft, TokenSet.cat([ctx, draft]), 3)
    m = vis.dense()
    for row in range(6):
        a = anchors[row // 3]
        assert m[row, :10].tolist() == [p < a for p in range(10)]
        assert m[row, 10:].tolist() == [(c // 3) == (row // 3) for c in range(6)]


def test_pad_keys_are_never_visible_and_bad_rule_is_named():
    plan = bdlm_plan("reference", 8, 4, 1)[0]
    hidden = torch.ones(16, dtype=torch.bool)
    vis = Visibility(plan.q_tokens, plan.kv_tokens.masked(hidden), 4)
    assert not vis.dense().any()
    with pytest.raises(ValueError, match="clean_within_block must be one of causal, bidirectional"):
        Visibility(plan.q_tokens, plan.kv_tokens, 4, "full")


@pytest.mark.parametrize("L,S", [(8, 4), (12, 3), (10, 1), (32, 8)])
@pytest.mark.parametrize("rule", ["causal", "bidirectional"])
def test_visible_pair_count_formula_equals_the_mask(L, S, rule):
    from specforge_csbp.layout.cost import bdlm_visible_pairs

    assert bdlm_visible_pairs(L, S, rule) == int(rule_by_loops(L, S, rule == "bidirectional").sum())


def _token_rule(q, k, S, bidirectional, window=None, noisy_causal=False):
    """The rule as stated per token field (design.md section 1), elementwise - the oracle of the ranges."""
    qp, qk, qb, qs = (t[:, None] for t in (q.pos, q.kind, q.block, q.start))
    kp, kk, kb = (t[None, :] for t in (k.pos, k.kind, k.block))
    q_clean, q_noisy = qk == CLEAN, qk == NOISY
    clean_limit = (kp < qs + S) if bidirectional else (kp <= qp)
    sees_clean = (kk == CLEAN) & ((q_clean & clean_limit) | (q_noisy & (kp < qs)))
    if window is not None:
        sees_clean &= kp > qp - window
    same_block = kb == qb
    if noisy_causal:
        same_block &= kp <= qp
    return sees_clean | ((kk == NOISY) & q_noisy & same_block)


def _pairs_of_token_sets():
    for mode, L, S, P in [("reference", 40, 4, 1), ("csbp", 48, 4, 3), ("cp", 36, 3, 2), ("bp", 64, 8, 2)]:
        for plan in bdlm_plan(mode, L, S, P):
            for keys in (plan.kv_tokens, plan.remote_kv_tokens):
                for rule in CLEAN_RULES:
                    yield plan.q_tokens, keys.padded(len(keys) + 3), S, rule, None, False
    for q, keys, window, causal in drafter_shards(90, 11, 4, 9, (("reference", 1), ("csbp", 3), ("cp", 2)), 8):
        yield q.padded(len(q) + 2), keys, 4, "causal", window, causal


def test_ranges_equal_the_rule_stated_per_token_field():
    n = 0
    for q, k, S, rule, window, causal in _pairs_of_token_sets():
        vis = Visibility(q, k, S, rule, window=window, noisy_causal=causal)
        expected = _token_rule(q, k, S, rule == "bidirectional", window, causal)
        assert torch.equal(vis.dense(), expected)
        q_idx, k_idx = torch.meshgrid(torch.arange(len(q)), torch.arange(len(k)), indexing="ij")
        assert torch.equal(vis.mask_mod("cpu")(0, 0, q_idx, k_idx), expected)  # the int32 tables too
        n += int(expected.any())
    assert n > 20  # the cases see something


def test_tokens_outside_the_ranges_encoding_are_one_line_errors():
    ctx = TokenSet.bdlm(torch.arange(8), CLEAN, 4)
    stray = TokenSet(torch.tensor([9]), torch.tensor([NOISY]), torch.tensor([0]), torch.tensor([4]))  # 5 past start
    with pytest.raises(ValueError, match=r"^keys: a noisy token must lie inside its block \(0 <= pos - start < 4\)$"):
        Visibility(ctx, TokenSet.cat([ctx, stray]), 4).dense()
    far = TokenSet.bdlm(torch.tensor([1 << 29]), CLEAN, 4)
    with pytest.raises(ValueError, match=r"^queries: positions must lie in \[0, 536870912\)"):
        Visibility(far, ctx, 4).dense()

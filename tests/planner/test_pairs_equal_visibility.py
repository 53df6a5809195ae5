"""The planner's pair counts equal the visibility rule's dense mask for every layout it costs."""

from __future__ import annotations

import pytest
import torch

from specforge_csbp.layout import bdlm_plan
from specforge_csbp.layout.tokens import CLEAN, TokenSet
from specforge_csbp.masks.visibility import Visibility
from specforge_csbp.planner.pairs import (
    bdlm_rank_stats,
    count_visible,
    drafter_anchors,
    drafter_rank_stats,
    drafter_tokens,
)

CASES = [  # (L, S, P): B % P != 0, P <= B < 2P, B % 2P != 0, P = 1..4
    (24, 4, 1), (40, 4, 2), (40, 4, 3), (36, 4, 4), (20, 4, 3), (48, 8, 4), (12, 4, 3), (64, 16, 2),
]  # fmt: skip


def _dense(q: TokenSet, k: TokenSet, s: int, rule: str) -> int:
    return int(Visibility(q, k, s, rule).dense().sum())


@pytest.mark.parametrize("rule", ["causal", "bidirectional"])
def test_bdlm_stats_match_full_resolution_plans(rule):
    for L, S, P in CASES:
        for mode in ("reference",) if P == 1 else ("cp", "bp", "csbp"):
            stats = bdlm_rank_stats(mode, L, S, P, rule)
            for plan, st in zip(bdlm_plan(mode, L, S, P), stats, strict=True):
                assert st.pairs_local == _dense(plan.q_tokens, plan.kv_tokens, S, rule)
                remote = _dense(plan.q_tokens, plan.remote_kv_tokens, S, rule) if plan.communicates else 0
                assert st.pairs_remote == remote, (mode, L, S, P)
                assert (st.q_rows, st.kv_rows, st.gather_width) == (len(plan.q_tokens), len(plan.kv_tokens),
                                                                     plan.gather_len)  # fmt: skip
                assert st.primary_rows == int(plan.q_primary.sum()) and st.shared_rows == plan.shared.numel()
            # no mode loses or duplicates a pair except BP's replicated clean prefix
            ref = bdlm_rank_stats("reference", L, S, 1, rule)[0].pairs
            total = sum(s.pairs for s in stats)
            assert total == ref if mode != "bp" else total >= ref


def test_count_visible_random_token_sets_and_windows():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        nq, nk, s = 30 + trial, 50, 4

        def tokens(n, kinds, s=s):
            pos = torch.randint(0, 64, (n,), generator=g)
            kind = torch.randint(0, kinds, (n,), generator=g)  # PAD, CLEAN, (NOISY)
            block = torch.div(pos, s, rounding_mode="floor")
            return TokenSet(pos, kind, block, block * s)

        q, k = tokens(nq, 3), tokens(nk, 3)
        for rule in ("causal", "bidirectional"):
            assert count_visible(q, k, s, rule) == _dense(q, k, s, rule)
            for w in (1, 3, 16):  # sliding windows and causal draft blocks: the rule's own options
                for nc in (False, True):
                    dense = int(Visibility(q, k, s, rule, window=w, noisy_causal=nc).dense().sum())
                    assert count_visible(q, k, s, rule, window=w, noisy_causal=nc) == dense
    with pytest.raises(ValueError, match="clean_within_block"):
        count_visible(q, k, s, "sideways")
    with pytest.raises(ValueError, match="window"):
        count_visible(q, k, s, window=0)


def test_drafter_stats_against_the_rule():
    C, N, S = 256, 7, 4
    pos = drafter_anchors(C, N, S)
    assert pos == sorted(pos) and pos[0] >= 1 and pos[-1] + S <= C + 1
    blocks = drafter_tokens(pos, S)
    ctx = TokenSet(torch.arange(C), torch.full((C,), CLEAN), torch.zeros(C, dtype=torch.long),
                   torch.zeros(C, dtype=torch.long))  # fmt: skip
    for window in (None, 16):
        ref = drafter_rank_stats("dp", C, N, S, 1, window)[0]
        k = TokenSet.cat([ctx, blocks])
        assert ref.pairs == int(Visibility(blocks, k, S, window=window).dense().sum())
        for P in (2, 3, 4):
            csbp = drafter_rank_stats("csbp", C, N, S, P, window)
            cp = drafter_rank_stats("cp", C, N, S, P, window)
            bp = drafter_rank_stats("bp", C, N, S, P, window)
            # CSBP: every (block query, key) pair computed exactly once; anchors owned once
            assert sum(r.pairs for r in csbp) == ref.pairs and sum(r.anchors for r in csbp) == N
            assert sum(r.context_rows for r in csbp) == C
            # CP: context split, block work duplicated on every rank (own-block pairs P times)
            assert sum(r.pairs for r in cp) == ref.pairs + (P - 1) * N * S * S
            assert all(r.block_rows == N * S for r in cp)
            # BP: pairs once, context recomputed (at least C in total over ranks... never less than needed)
            assert sum(r.pairs for r in bp) == ref.pairs and all(r.received_rows == 0 for r in bp)
            if window is None:
                assert all(r.received_rows == (P - 1) * r.gather_width for r in csbp)
            else:  # only the windows the rank's anchors need, never more than their union
                assert all(r.received_rows <= N * window for r in csbp)
    with pytest.raises(ValueError, match="anchors"):
        drafter_rank_stats("csbp", C, 2, S, 3)
    with pytest.raises(ValueError, match="anchors"):
        drafter_anchors(16, 20, 4)
    with pytest.raises(ValueError, match="blocks"):
        bdlm_rank_stats("csbp", 16, 8, 4)

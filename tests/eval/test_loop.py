"""The eval loop (specforge_csbp/eval): exact drafter inference, lossless speculative decoding, tau bounds.

float64 tiny Qwen3 target (the quickstart's config, random weights) and random DFlash / DFlash2 drafters
with a sliding and a full layer (S = 4, window 6, GQA 4:2).
"""

from __future__ import annotations

import pytest
import torch

from specforge_csbp.eval import DraftContext, TargetRunner, run_prompts, speculative_generate, summarize
from specforge_csbp.models.dflash import reference_attention
from tests.support.eval_fixtures import S, greedy_reference, random_drafter, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _prompts(n: int, lengths=(23, 9, 40)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 512, (lengths[i % len(lengths)],), generator=g) for i in range(n)]


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_incremental_draft_equals_the_training_forward(dflash2):
    """DraftContext (context K/V appended piecewise, window rows skipped, SDPA + the rule's dense mask) gives
    the drafter's own single-process forward - the one it was trained with - for a block at anchor a."""
    model = random_drafter(dflash2)
    torch.manual_seed(0)
    embed = torch.nn.Embedding(512, 64).double()
    head = torch.nn.Linear(64, 512, bias=False).double()
    features = torch.randn(30, 2 * 64, dtype=torch.float64)
    ctx = DraftContext(model, embed, head, capacity=40)
    for lo, hi in ((0, 11), (11, 12), (12, 23)):  # a prefill chunk, one verified token, another chunk
        ctx.append(features[lo:hi])
        a = hi
        ids = torch.tensor([[7] + [model.mask_token_id] * (S - 1)])
        attention = reference_attention(model.config, torch.tensor([a]), torch.arange(a))
        ref = model(embed(ids), torch.arange(a, a + S), features[None, :a], torch.arange(a), attention)[0]
        torch.testing.assert_close(ctx.hidden(7), ref, rtol=1e-12, atol=1e-12)


def test_sliding_layers_see_only_their_window():
    """With sliding layers only (window 6), a block at anchor 12 reads context positions 7..11: a change at
    position 6 changes nothing, a change at position 7 changes the proposal's states."""
    model = random_drafter(False, layer_types=["sliding_attention"] * 2)
    embed = torch.nn.Embedding(512, 64).double()
    head = torch.nn.Linear(64, 512, bias=False).double()
    features = torch.randn(12, 128, dtype=torch.float64)

    def states(changed: int | None) -> torch.Tensor:
        f = features.clone()
        if changed is not None:
            f[changed] += 1.0
        ctx = DraftContext(model, embed, head, 20)
        ctx.append(f)
        return ctx.hidden(9)

    base = states(None)
    assert torch.equal(states(6), base)
    assert not torch.allclose(states(7), base)


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_speculative_decoding_is_lossless(target, dflash2):
    drafter = random_drafter(dflash2)
    prompts = _prompts(3)
    results = run_prompts(drafter, target, prompts, 17, prefill_chunk=0)
    for prompt, result in zip(prompts, results):
        assert result.tokens == greedy_reference(target, prompt, 17)
        assert sum(s.accepted + 1 for s in result.steps) >= 16  # every token after the first was verified


class Oracle:
    """Proposes the target's own greedy continuation (computed from scratch); `spoil(step)` names a slot to
    corrupt in that step's block (None: none), so accepted lengths 0..S-1 all occur."""

    block_size = S

    def __init__(self, target, prompt, spoil=lambda step: None):
        self.target, self.ids, self.spoil, self.step = target, prompt.tolist(), spoil, 0
        self.length = 0

    def append(self, features):
        self.length += int(features.shape[0])

    def propose(self, last_token):
        seq = self.ids[: self.length] + [last_token]
        draft = greedy_reference(self.target, torch.tensor(seq), S - 1)
        bad = self.spoil(self.step)
        self.step += 1
        if bad is not None:
            draft[bad] = (draft[bad] + 1) % 512
        self.ids = seq + draft  # the accepted prefix of the draft is what the next call continues from
        return torch.tensor(draft)


def test_oracle_reaches_tau_equal_to_the_block_size(target):
    prompt = _prompts(1)[0]
    result = speculative_generate(TargetRunner(target, [1, 3]), Oracle(target, prompt), prompt, 1 + 4 * S)
    summary = summarize([result], S)
    assert summary["tau"] == S
    assert summary["accept_hist"] == [0, 0, 0, 4]
    assert summary["per_slot_accept"] == [1.0, 1.0, 1.0]
    assert result.tokens == greedy_reference(target, prompt, 1 + 4 * S)


def test_partial_acceptance_commits_exactly_the_verified_prefix(target):
    """Blocks spoiled at slot 2, 1, 0, none, ...: accepted 2, 1, 0, 3 - the cache crop and the context
    appends of every accepted length keep the output equal to greedy decoding."""
    prompt = _prompts(1)[0]
    oracle = Oracle(target, prompt, spoil=lambda step: (2, 1, 0, None)[step % 4])
    result = speculative_generate(TargetRunner(target, [1, 3]), oracle, prompt, 20, prefill_chunk=5)
    assert [s.accepted for s in result.steps][:4] == [2, 1, 0, 3]
    assert result.tokens == greedy_reference(target, prompt, 20)
    summary = summarize([result], S)
    assert summary["tau"] == pytest.approx(1 + sum(s.accepted for s in result.steps) / len(result.steps))


def test_untrained_drafter_stays_near_one(target, tmp_path):
    """`--untrained`: the checkpoint's config, fresh seeded weights (identity conv, zero successor codebook)."""
    from specforge_csbp.eval import load_drafter

    random_drafter(True).save_pretrained(str(tmp_path / "d"))
    drafter, _ = load_drafter(str(tmp_path / "d"), untrained=True, seed=0, dtype="float64",
                              device=torch.device("cpu"))  # fmt: skip
    again, _ = load_drafter(str(tmp_path / "d"), untrained=True, seed=0, dtype="float64", device=torch.device("cpu"))
    trained, _ = load_drafter(str(tmp_path / "d"), dtype="float64", device=torch.device("cpu"))
    fresh, kept = drafter.state_dict(), trained.state_dict()
    assert all(torch.equal(fresh[k], v) for k, v in again.state_dict().items())  # seeded
    assert not torch.equal(fresh["fc.weight"], kept["fc.weight"])
    results = run_prompts(drafter, target, _prompts(2), 24)
    summary = summarize(results, S)
    assert 1.0 <= summary["tau"] < 1.3, summary["tau"]


@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_gives_the_one_pass_result(target, chunk):
    drafter = random_drafter(True)
    prompt = _prompts(1, lengths=(40,))
    whole = run_prompts(drafter, target, prompt, 12, prefill_chunk=0)[0]
    parts = run_prompts(drafter, target, prompt, 12, prefill_chunk=chunk)[0]
    assert parts.tokens == whole.tokens
    assert parts.steps == whole.steps


def test_context_features_match_one_pass_features(target):
    """The chunked prefill's features (the drafter's context) equal one pass's to float64 rounding."""
    prompt = _prompts(1, lengths=(40,))[0]
    got: dict[int, list] = {0: [], 9: []}
    for chunk in got:
        TargetRunner(target, [1, 3]).prefill(prompt, chunk, got[chunk].append)
    torch.testing.assert_close(torch.cat(got[9]), torch.cat(got[0]), rtol=1e-10, atol=1e-10)


def test_buckets_split_steps_by_context_position():
    from specforge_csbp.eval import SequenceResult, VerifyStep

    steps = [VerifyStep(10, 3), VerifyStep(5000, 1), VerifyStep(5003, 0), VerifyStep(20000, 2)]
    summary = summarize([SequenceResult(10, [1] * 9, steps)], 4)
    assert [(b["start"], b["end"], b["verify_steps"]) for b in summary["buckets"]] == [
        (0, 4096, 1), (4096, 16384, 2), (16384, 65536, 1)]  # fmt: skip
    assert [b["tau"] for b in summary["buckets"]] == [4.0, 1.5, 3.0]
    assert summary["tau"] == 1 + 6 / 4
    assert summary["accept_hist"] == [1, 1, 1, 1]
    assert summary["per_slot_accept"] == [0.75, 0.5, 0.25]
    assert summary["spec_accept_length"] == 9 / 4


def test_eval_runs_attention_on_shape_stable_kernels(target):
    """Inside run_prompts SDPA may not pick cuDNN (a graph build per new key length); outside, the global
    setting is as it was."""
    seen: list[bool] = []

    class Watching(Oracle):
        def propose(self, last_token):
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return super().propose(last_token)

    prompt = _prompts(1)[0]
    before = torch.backends.cuda.cudnn_sdp_enabled()
    drafter = random_drafter(False)  # its target layers feed the runner; the oracle proposes
    (result,) = run_prompts(drafter, target, [prompt], 9, proposer_factory=lambda capacity: Watching(target, prompt))
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert result.tokens == greedy_reference(target, prompt, 9)

"""The rejection-sampling rule keeps the target's distribution (tested
statistically on a 5-token vocabulary), for drafter and point-mass proposals;
n-gram lookup proposes what followed the tail's last occurrence."""

import pytest
import torch

from completer.engine.spec_policy import PROBE_EVERY, Acceptance, SpecPolicy, expected_tokens
from completer.engine.proposers import NgramIndex
from completer.engine.rejection_sampler import accept_sampled

N = 20_000


def first_token_histogram(p_logits, q, point_mass: int | None, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(5)
    logits = torch.stack([p_logits, p_logits])  # positions: [last, d1]
    for _ in range(N):
        if point_mass is None:
            d = int(torch.multinomial(q, 1, generator=g))
            out = accept_sampled([d], q[None], logits, 1.0, g)
        else:
            out = accept_sampled([point_mass], None, logits, 1.0, g)
        counts[out[0]] += 1
    return counts / N


def test_drafter_proposals_keep_the_target_distribution():
    p_logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 1.0, -1.0]), -1)  # a poor drafter
    empirical = first_token_histogram(p_logits, q, None)
    assert (empirical - torch.softmax(p_logits, -1)).abs().max() < 0.015


def test_point_mass_proposals_keep_the_target_distribution():
    p_logits = torch.tensor([0.5, 1.5, 0.0, 0.2, -0.5])
    empirical = first_token_histogram(p_logits, None, point_mass=3)
    assert (empirical - torch.softmax(p_logits, -1)).abs().max() < 0.015


def test_ngram_lookup():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert index.propose(tokens, 2) == [4, 5]
    assert index.propose([7, 8], 3) == []


def test_acceptance_counts_one_miss_per_rejecting_round():
    a = Acceptance(rate=0.5, weight=2.0, decay=1.0)
    a.observe(4, 4)  # all accepted: 4 hits, no miss
    a.observe(4, 1)  # 1 hit, then a miss (the 2 after it are never judged)
    assert a.hits == 1 + 5 and a.misses == 1 + 1
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(0.0, 5) == 1.0


def measured(policy: SpecPolicy, plain: float, per_token: float, draft: float, batch: int = 1):
    for width in range(1, policy.k_max + 2):
        policy.costs.observe_target(batch, width, plain * (1 + per_token * (width - 1)))
    policy.costs.observe_draft(batch, draft)


def test_policy_speculates_only_when_it_pays():
    policy = SpecPolicy(k_init=4, k_max=8)
    measured(policy, plain=8.0, per_token=0.05, draft=0.8)  # a CPU-like cost profile
    good, poor = policy.new_state(), policy.new_state()
    for _ in range(30):
        policy.observe(good, "draft", 4, 4)
        policy.observe(poor, "draft", 4, 0)
    source, k = policy.choose(good, 1, {"draft": 64}, 64)
    assert source == "draft" and k >= 4
    # A drafter that is always wrong costs time: plain decoding, then a 1-token probe.
    picks = [policy.choose(poor, 1, {"draft": 64}, 64) for _ in range(PROBE_EVERY)]
    assert picks[:-1] == [(None, 0)] * (PROBE_EVERY - 1) and picks[-1] == ("draft", 1)
    # N-gram proposals cost no drafter steps: worth a try at a lower acceptance.
    for _ in range(30):
        policy.observe(poor, "ngram", 4, 1)
    assert policy.choose(poor, 1, {"ngram": 6, "draft": 64}, 64)[0] == "ngram"
    # Never past the token budget; the fixed rule when not adaptive.
    assert policy.choose(good, 1, {"draft": 2}, 2)[1] <= 2
    fixed = SpecPolicy(k_init=3, k_max=8, adaptive=False)
    assert fixed.choose(fixed.new_state(), 1, {"draft": 64}, 64) == ("draft", 3)
    assert fixed.choose(fixed.new_state(), 1, {"ngram": 5, "draft": 64}, 64) == ("ngram", 3)


def test_new_sequences_start_from_the_engine_wide_acceptance():
    policy = SpecPolicy(k_init=4, k_max=8)
    first = policy.new_state()
    for _ in range(200):
        policy.observe(first, "draft", 4, 0)
    assert policy.new_state().acceptance["draft"].rate < 0.1


def test_a_batch_speculates_only_when_the_padded_pass_pays():
    policy = SpecPolicy(k_init=4, k_max=8)
    measured(policy, plain=8.0, per_token=0.05, draft=0.8)  # batch 1: cheap to widen
    measured(policy, plain=12.0, per_token=0.1, draft=1.0, batch=4)  # batch 4: each extra token costs
    sure, unsure = policy.new_state(), policy.new_state()
    for _ in range(30):
        policy.observe(sure, "ngram", 4, 4)
        policy.observe(unsure, "ngram", 4, 1)
    # One row with a long confident proposal pays for widening all four rows...
    assert policy.batch_pays([(sure, "ngram", 6)], batch=4)
    # ...a short unsure one does not: every row pays for the widest.
    assert not policy.batch_pays([(unsure, "ngram", 4)], batch=4)
    # Batch sizes never measured borrow the nearest measured one's ratios.
    assert policy.costs.verify_ratio(16, 3) == policy.costs.verify_ratio(4, 3) == pytest.approx(1.2)

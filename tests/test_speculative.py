"""The rejection-sampling rule keeps the target's distribution (tested
statistically on a 5-token vocabulary), for drafter and point-mass proposals;
n-gram lookup proposes what followed the tail's last occurrence."""

import torch

from completer.engine.speculative import NgramIndex, accept_sampled, next_k

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


def test_ngram_lookup_and_adaptive_k():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert index.propose(tokens, 2) == [4, 5]
    assert index.propose([7, 8], 3) == []
    assert next_k(4, 4, 4, 1, 8) == 5 and next_k(4, 4, 1, 1, 8) == 3 and next_k(4, 4, 2, 1, 8) == 4

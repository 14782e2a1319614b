"""Speculative decoding: proposals (n-gram lookup, drafter) and their verification.

The target scores `[last token] + proposal` in one forward pass. Greedy
requests keep the longest prefix of the proposal that equals the target's own
argmax, plus the target's next token: exactly the tokens plain greedy decoding
gives. Sampling requests use the accept/reject rule of Leviathan et al. and
Chen et al. (accept d with prob min(1, p(d)/q(d)), else resample from
max(0, p - q)), which leaves the target's distribution unchanged; an n-gram
proposal is a point mass (q(d) = 1).
"""

from __future__ import annotations

import torch


class NgramIndex:
    """Where each n-gram of a token list last ended, for prompt lookup. Code
    copies itself (names, call patterns), and a match costs no forward pass."""

    def __init__(self, n_min: int = 2, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are indexed

    def update(self, tokens: list[int]) -> None:
        """Index n-grams ending at positions < len(tokens) - 1 (the current tail
        itself must not match itself)."""
        for end in range(max(self.indexed, self.n_min - 1), len(tokens) - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self.last_end[tuple(tokens[end - n + 1: end + 1])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the tail."""
        self.update(tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) < n:
                continue
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1: end + 1 + k]
        return []


def accept_greedy(proposal: list[int], logits: torch.Tensor) -> list[int]:
    """logits: [len(proposal) + 1, V] at [last, d1..dk]. Returns the accepted
    drafts plus the target's token after them."""
    best = logits[: len(proposal) + 1].argmax(-1).tolist()
    out = []
    for drafted, wanted in zip(proposal, best):
        if drafted != wanted:
            break
        out.append(drafted)
    out.append(best[len(out)])
    return out


def accept_sampled(proposal: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor,
                   temperature: float, generator: torch.Generator | None) -> list[int]:
    """Rejection sampling. draft_probs: [k, V] (the drafter's q for each draft),
    or None for a point-mass (n-gram) proposal."""
    p = torch.softmax(logits[: len(proposal) + 1].float() / temperature, dim=-1)
    out = []
    for i, drafted in enumerate(proposal):
        q = draft_probs[i] if draft_probs is not None else None
        q_d = 1.0 if q is None else float(q[drafted])
        if float(torch.rand((), generator=generator)) * q_d < float(p[i, drafted]):
            out.append(drafted)
            continue
        if q is None:
            residual = p[i].clone()
            residual[drafted] = 0.0
        else:
            residual = (p[i] - q).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q: any rejection was measure-zero
            residual = p[i]
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(proposal)], 1, generator=generator)))
    return out


"""Verification of a proposal against the target's logits for `[last token] + proposal`.

Greedy requests keep the longest prefix of the proposal that equals the
target's own argmax, plus the target's next token: exactly the tokens plain
greedy decoding gives. Sampling requests use the accept/reject rule of
Leviathan et al. and Chen et al. (accept d with prob min(1, p(d)/q(d)), else
resample from max(0, p - q)), which leaves the target's distribution
unchanged; an n-gram proposal is a point mass (q(d) = 1).
"""

from __future__ import annotations

import torch

from completer.engine.sampler import softmax_at


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
    p = softmax_at(logits[: len(proposal) + 1], temperature)
    if generator is not None:  # a seeded generator lives on the CPU
        p = p.cpu()
        draft_probs = draft_probs.cpu() if draft_probs is not None else None
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

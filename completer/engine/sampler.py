"""Choosing a token from logits, for the target and the drafter alike:
greedy at temperature 0, else a draw from the softmax at the request's
temperature (with its seeded generator). While token healing is pending,
only tokens that re-spell the backed-off bytes may be chosen."""

from __future__ import annotations

import torch

from completer.engine.sequence import Sequence
from completer.healing import TokenHealer


def softmax_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / t) over the last dim, shifted by the max first: at a
    small t the max logit / t alone is inf, and inf - inf is NaN."""
    logits = logits.float()
    return torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)


class Sampler:
    def __init__(self, healer: TokenHealer):
        self.healer = healer

    def constrain(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        if not seq.output.heal:
            return logits
        return self.healer.constrain(logits, self.healer.allowed(seq.output.heal, logits.shape[-1]))

    @staticmethod
    def probs(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        return softmax_at(logits, seq.params.temperature)

    def sample(self, seq: Sequence, logits: torch.Tensor, heal: bool = True) -> tuple[int, torch.Tensor | None]:
        """(token, the distribution it was drawn from; None when greedy)."""
        if heal:
            logits = self.constrain(seq, logits)
        if seq.params.greedy:
            return int(logits.argmax()), None
        p = self.probs(seq, logits)
        if seq.generator is not None:  # a seeded generator lives on the CPU
            p = p.cpu()
        return int(torch.multinomial(p, 1, generator=seq.generator)), p


def token_probs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """The probability of each chosen token at temperature 1: row i of
    `logits` ([>= len(tokens), V], or [V] for one token) is where tokens[i] was chosen (a constrained
    row gives its probability among the allowed tokens)."""
    rows = softmax_at(logits.reshape(-1, logits.shape[-1])[: len(tokens)], 1.0)
    return rows[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()

"""Token healing: the cursor rarely sits on a token boundary the model knows.

A prefix ending in `\\n        ` (a newline and 8 spaces) is tokenized with an
8-space token, while in the training text the same spaces were mostly split
`\\n       ` + ` return`: the model, seeing the 8-space token, continues with
` return` and the line gets 9 spaces. So the last prefix token is taken back
out of the prompt and its bytes become a constraint: the first generated
tokens must spell them (or begin with them) before anything new is written.
Those bytes are not part of the completion. Only for templates whose prompt
ends with the prefix (SPM, and the prefix template).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

import torch

from completer.tokenizer import TextTokenizer


class TokenHealer:
    MASKS_KEPT = 512  # distinct pending byte strings whose masks stay cached

    def __init__(self, tokenizer: TextTokenizer):
        self.vocab = [b"" if i in tokenizer.special_ids else tokenizer.token_bytes(i)
                      for i in range(tokenizer.vocab_size)]
        self.ids_of: dict[bytes, list[int]] = {}  # a token's bytes -> the ids that spell them
        for i, b in enumerate(self.vocab):
            if b:
                self.ids_of.setdefault(b, []).append(i)
        self.sorted_bytes = sorted(self.ids_of)  # tokens starting with `pending` are a run of these
        self.masks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def agreeing(self, pending: bytes) -> list[int]:
        """Tokens that spell a prefix of `pending` (a dictionary lookup per
        length) or start with all of it (one sorted run): no scan of the vocabulary."""
        ids = [i for n in range(1, len(pending)) for i in self.ids_of.get(pending[:n], ())]
        at = bisect.bisect_left(self.sorted_bytes, pending)
        while at < len(self.sorted_bytes) and self.sorted_bytes[at].startswith(pending):
            ids += self.ids_of[self.sorted_bytes[at]]
            at += 1
        return ids

    def allowed(self, pending: bytes, vocab_size: int) -> torch.Tensor:
        """Tokens that agree with `pending`: they spell a prefix of it, or start
        with all of it. A bool mask over the model's vocabulary (cached)."""
        mask = self.masks.get(pending)
        if mask is None:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            ids = [i for i in self.agreeing(pending) if i < vocab_size]
            mask[torch.tensor(ids, dtype=torch.long)] = True
            self.masks[pending] = mask
            if len(self.masks) > self.MASKS_KEPT:
                self.masks.popitem(last=False)
        else:
            self.masks.move_to_end(pending)
        return mask

    @staticmethod
    def constrain(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(~mask.to(logits.device), float("-inf"))


def back_off(tokenizer: TextTokenizer, tokens: list[int], prefix_tokens: int) -> tuple[list[int], bytes]:
    """The prompt without its last prefix token, and that token's bytes."""
    if prefix_tokens <= 0 or tokens[-1] in tokenizer.special_ids:
        return tokens, b""
    return tokens[:-1], tokenizer.token_bytes(tokens[-1])


def consume(pending: bytes, token: bytes) -> tuple[bytes, bytes]:
    """(what is still pending, the new bytes of the completion) after `token`."""
    if len(token) >= len(pending):
        return b"", token[len(pending):]
    return pending[len(token):], b""

"""Training examples: FIM-formatted chunks of source files, packed into rows.

Every example is rendered by `PromptBuilder.assemble`, the same function that
builds prompts at inference, so the trained layout and the served layout cannot
drift apart. Prefix, suffix and middle are tokenized separately, as at
inference, so the model learns to continue a prefix that ends mid-token.
"""

from __future__ import annotations

import random

import torch

from completer.prompt import PromptBuilder, Snippet
from completer.training.corpus import SourceFile


class ExampleMaker:
    def __init__(self, files: list[SourceFile], builder: PromptBuilder, eot_id: int,
                 fim_rate: float = 0.8, snippet_rate: float = 0.2, max_chars: int = 3200):
        self.files = files
        self.builder = builder
        self.tok = builder.tok
        self.eot_id = eot_id
        self.fim_rate = fim_rate
        self.snippet_rate = snippet_rate
        self.max_chars = max_chars
        # Files weighted by size, so every byte of the corpus is equally likely.
        self.weights = [len(f.text) for f in files]
        self.by_dir: dict[str, list[int]] = {}
        for i, f in enumerate(files):
            self.by_dir.setdefault(f.path.rpartition("/")[0], []).append(i)

    def chunk(self, rng: random.Random, f: SourceFile, size: int) -> str:
        """A run of whole lines of about `size` chars."""
        text = f.text
        if len(text) <= size:
            return text
        start = rng.randrange(len(text) - size)
        start = text.rfind("\n", 0, start) + 1
        end = text.find("\n", start + size)
        return text[start: end + 1 if end >= 0 else len(text)]

    def split(self, rng: random.Random, text: str) -> tuple[str, str, str]:
        """prefix, middle, suffix: the middle starts at a random char and ends at a
        line end (the usual completion), after a few lines, or after a few chars."""
        cursor = rng.randrange(len(text) + 1)
        line_end = text.find("\n", cursor)
        if line_end < 0:
            line_end = len(text)
        kind = rng.random()
        if kind < 0.5:
            end = line_end
        elif kind < 0.8:
            end = line_end
            for _ in range(rng.randint(1, 8)):
                nxt = text.find("\n", end + 1)
                end = nxt if nxt >= 0 else len(text)
        else:
            end = min(len(text), cursor + rng.randint(0, 64))
        return text[:cursor], text[cursor:end], text[end:]

    def example(self, rng: random.Random) -> list[int]:
        f = self.files[rng.choices(range(len(self.files)), weights=self.weights)[0]]
        text = self.chunk(rng, f, rng.randint(self.max_chars // 4, self.max_chars))
        context: list[int] = []
        if rng.random() < self.snippet_rate:
            other = self.files[rng.choice(self.by_dir[f.path.rpartition("/")[0]])]
            if other is not f:
                snippet = Snippet(other.path, self.chunk(rng, other, rng.randint(200, 800)))
                context = self.builder.context_tokens([snippet])
        context += self.builder.header(f.path)
        if rng.random() >= self.fim_rate:
            return context + self.tok.encode(text) + [self.eot_id]
        prefix, middle, suffix = self.split(rng, text)
        prompt = self.builder.assemble(context, self.tok.encode(prefix), self.tok.encode(suffix))
        return prompt + self.tok.encode(middle) + [self.eot_id]

    def batch(self, seed: int, step: int, rows: int, length: int) -> torch.Tensor:
        """[rows, length + 1] token ids, a pure function of (seed, step) so a
        resumed run sees exactly the data it would have seen."""
        rng = random.Random(seed * 1_000_003 + step)
        out = torch.empty(rows, length + 1, dtype=torch.long)
        for r in range(rows):
            row: list[int] = []
            while len(row) < length + 1:
                row += self.example(rng)
            out[r] = torch.tensor(row[: length + 1])
        return out

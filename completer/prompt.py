"""Fill-in-the-middle prompts: templates per model family and window fitting.

A prompt is built from token segments: special tokens by name, and texts that
are tokenized on their own. Tokenizing the prefix alone (not joined with what
the model will write) is also how the default models were trained, so the
cursor may sit anywhere, even mid-word.

Layout and the KV cache: consecutive keystrokes only change the text right
before the cursor. Whatever precedes the prefix in the prompt is reused from
cache; whatever follows it must be prefilled again on every keystroke.
"""

from __future__ import annotations

import bisect
import re
import zlib
from typing import Callable, Literal

import msgspec

from completer.tokenizer import TextTokenizer

NEWLINE = re.compile("\n")


def anchored(text: str, at: int, step: int) -> bool:
    """Whether the line starting at char `at` of `text` is on the window grid
    of `step` lines. The grid is drawn by content, not by line number: a line
    is on it when a hash of that line and the one before it is a multiple of
    `step` (so ~1 line in `step`, and every line on a grid is on the grids of
    its halves). The same text thus offers the same starts however much of the
    file a client sends above it (llama.vim sends the 256 lines before the
    cursor) and after lines are inserted or deleted above it, so the window a
    jump refits to is one an earlier prompt or warming already computed. The
    first line of the text is on every grid."""
    if at == 0:
        return True
    end = text.find("\n", at)
    return zlib.crc32(text[text.rfind("\n", 0, at - 1) + 1: len(text) if end < 0 else end].encode()) % step == 0


class Snippet(msgspec.Struct, frozen=True):
    """Extra context from another file (protocol: `context` items)."""

    uri: str
    text: str
    kind: str = ""  # the protocol's ContextItem.kind: a prior for retrieval, not part of the prompt


class FimTemplate(msgspec.Struct, frozen=True):
    """Special-token strings of one model family and the order it was trained on.

    `psm`: [pre] prefix [suf] suffix [mid]  -- the suffix comes after the prefix,
           so every keystroke re-prefills the whole suffix.
    `spm`: [pre][suf] suffix [mid] prefix  -- stable content first: a keystroke
           re-prefills only the changed tail of the prefix (the variant of SPM
           in which prefix and middle are contiguous, as StarCoder uses).
    `prefix`: context, then the prefix; no markers (a model trained without
           FIM). The suffix stays out of the prompt; it still trims the
           completion and ends line and block modes.
    """

    name: str
    prefix: str
    suffix: str
    middle: str
    stop_tokens: tuple[str, ...]
    file_sep: str | None = None
    order: Literal["psm", "spm", "prefix"] = "psm"
    # CodeLlama's spacing: "<PRE> {prefix} <SUF>{suffix} <MID>" (PSM) and
    # "<PRE> <SUF>{suffix} <MID> {prefix}" (SPM). Its own (SentencePiece)
    # vocabulary spells the markers "\u2581<PRE>" etc., the space before each
    # included; then only the space before the prefix is a token of its own.
    marker_space: bool = False


# The end-of-text tokens of common vocabularies (where present): StarCoder's
# and Qwen's, Llama 2 / 3's, Gemma's.
PREFIX_STOPS = ("<|endoftext|>", "<|im_end|>", "<file_sep>", "</s>", "<|end_of_text|>", "<|eot_id|>", "<eos>",
                "<end_of_turn>")

TEMPLATES: dict[str, FimTemplate] = {
    # Our default models: trained in SPM order (see the class docstring), with
    # file separators for context snippets.
    "default": FimTemplate(
        name="default", prefix="<|fim_prefix|>", suffix="<|fim_suffix|>", middle="<|fim_middle|>",
        stop_tokens=("<|endoftext|>", "<|file_sep|>"), file_sep="<|file_sep|>", order="spm"),
    # Qwen2.5-Coder was trained on PSM; its repo-level format separates files
    # with <|file_sep|>path\n. PSM costs a suffix re-prefill per keystroke.
    "qwen2.5-coder": FimTemplate(
        name="qwen2.5-coder", prefix="<|fim_prefix|>", suffix="<|fim_suffix|>",
        middle="<|fim_middle|>", file_sep="<|file_sep|>", order="psm",
        stop_tokens=("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>")),
    # StarCoder/StarCoder2 saw both orders in training; SPM keeps the cache warm.
    "starcoder": FimTemplate(
        name="starcoder", prefix="<fim_prefix>", suffix="<fim_suffix>", middle="<fim_middle>",
        stop_tokens=("<|endoftext|>", "<file_sep>"), file_sep="<file_sep>", order="spm"),
    # CodeLlama's infilling was trained with both; PSM is its documented format.
    "codellama": FimTemplate(
        name="codellama", prefix="<PRE>", suffix="<SUF>", middle="<MID>",
        stop_tokens=("<EOT>", "</s>"), order="psm", marker_space=True),
    # CodeGemma: PSM, files separated by <|file_separator|> (its documented stop).
    "codegemma": FimTemplate(
        name="codegemma", prefix="<|fim_prefix|>", suffix="<|fim_suffix|>", middle="<|fim_middle|>",
        file_sep="<|file_separator|>", order="psm",
        stop_tokens=("<|file_separator|>", "<eos>", "<end_of_turn>", "<|fim_prefix|>", "<|fim_suffix|>",
                     "<|fim_middle|>")),
    # DeepSeek-Coder: "<｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>" (PSM).
    "deepseek-coder": FimTemplate(
        name="deepseek-coder", prefix="<｜fim▁begin｜>", suffix="<｜fim▁hole｜>", middle="<｜fim▁end｜>",
        order="psm", stop_tokens=("<｜end▁of▁sentence｜>", "<|EOT|>")),
    # Models without FIM tokens (SmolLM2, most base models): the prefix alone.
    # Stops: the end-of-text tokens of common vocabularies, where present.
    "prefix": FimTemplate(
        name="prefix", prefix="", suffix="", middle="", order="prefix",
        stop_tokens=PREFIX_STOPS),
    # The same, for vocabularies with StarCoder's <file_sep> (SmolLM2's): each
    # context snippet and the document itself introduced as a file of the
    # repository, as The Stack's repository-level training documents are.
    "prefix-files": FimTemplate(
        name="prefix-files", prefix="", suffix="", middle="", order="prefix", file_sep="<file_sep>",
        stop_tokens=PREFIX_STOPS),
}


def marker_id(tokenizer: TextTokenizer, marker: str) -> int | None:
    """A special token's id, as spelled or with SentencePiece's word-start
    mark ("\u2581<PRE>", as CodeLlama's vocabulary has it)."""
    token_id = tokenizer.token_id(marker)
    return token_id if token_id is not None else tokenizer.token_id("\u2581" + marker)


def get_template(name: str, order: str | None = None) -> FimTemplate:
    """A template by family name, optionally forcing `psm` or `spm` order."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown FIM template {name!r}; known: {', '.join(TEMPLATES)}")
    template = TEMPLATES[name]
    if order is not None and template.order != "prefix":
        if order not in ("psm", "spm"):
            raise ValueError(f"FIM order must be 'psm' or 'spm', not {order!r}")
        template = msgspec.structs.replace(template, order=order)
    return template


class Window(msgspec.Struct, frozen=True):
    """The part of the document that goes into the prompt, as char offsets:
    prefix[prefix_start:] and suffix[:suffix_end]."""

    prefix_start: int
    suffix_end: int


class Prompt(msgspec.Struct, frozen=True):
    tokens: list[int]
    window: Window
    prefix_tokens: int  # how many of `tokens` are the (windowed) prefix text


class PromptBuilder:
    """Renders FIM prompts for one tokenizer and template within a token budget."""

    def __init__(self, tokenizer: TextTokenizer, template: FimTemplate, budget: int,
                 suffix_share: float = 0.25, context_share: float = 0.25, step_lines: int = 32,
                 grid: Literal["content", "lines"] = "content"):
        if budget < 1:
            raise ValueError(f"the prompt budget is {budget} tokens: model.context_tokens must exceed "
                             f"request.max_tokens")
        self.tok = tokenizer
        self.template = template
        self.budget = budget
        self.header_budget = max(4, budget // 16)  # a file's name must not crowd out its code
        self.suffix_budget = 0 if template.order == "prefix" else int(budget * suffix_share)
        self.context_budget = int(budget * context_share)
        self.step_lines = step_lines
        self.grid = grid  # window starts: lines chosen by content (`anchored`), or by line number
        self.stop_ids = [i for s in template.stop_tokens if (i := marker_id(tokenizer, s)) is not None]
        self._special: dict[str, int] = {}
        self._space = tokenizer.encode(" ") if template.marker_space else []
        self._bos = tokenizer.bos_ids()  # stable, first: cached like the rest
        if template.order == "prefix" and not self._bos:
            # A model trained on documents joined by its end-of-text token saw
            # every file start after one: the prompt starts as a document does
            # (and is never empty, even at an empty prefix after token healing).
            self._bos = self.stop_ids[:1]
        for marker in (template.prefix, template.suffix, template.middle, template.file_sep):
            if not marker:
                continue
            token_id = marker_id(tokenizer, marker)
            if token_id is None:
                raise ValueError(f"template {template.name!r} needs token {marker!r}, "
                                 f"which the tokenizer does not have")
            self._special[marker] = token_id
        # Markers spelled with their leading space ("\u2581<SUF>") need no space token before them.
        self._marker_space = [] if tokenizer.token_id(template.suffix) is None else self._space

    def header(self, path: str | None) -> list[int]:
        """`<file_sep>path\\n`, the line that introduces a file (if the family has one)."""
        if self.template.file_sep is None or path is None:
            return []
        # The path's tail, where its file name is, within the header budget.
        return [self._special[self.template.file_sep]] + self.tok.encode(path[-8 * self.header_budget:] + "\n")[-self.header_budget:]

    def snippet_tokens(self, snip: Snippet) -> list[int]:
        """One snippet as the prompt holds it: its file header and text (a path comment without one)."""
        if self.template.file_sep is None:
            return self.tok.encode(f"# {snip.uri}\n{snip.text}\n")
        return self.header(snip.uri) + self.tok.encode(snip.text)

    def context_tokens(self, snippets: list[Snippet]) -> list[int]:
        """Snippets in the given order, whole, while they fit."""
        out: list[int] = []
        for snip in snippets:
            ids = self.snippet_tokens(snip)
            if len(out) + len(ids) > self.context_budget:
                break
            out += ids
        return out

    def assemble(self, context: list[int], prefix: list[int], suffix: list[int]) -> list[int]:
        """The template's order, with `context` (snippets and file header) first."""
        t, sp, ms = self.template, self._space, self._marker_space
        if t.order == "spm":
            pre, suf, mid = self._special[t.prefix], self._special[t.suffix], self._special[t.middle]
            return self._bos + context + [pre] + ms + [suf] + suffix + ms + [mid] + sp + prefix
        head = self.head(context, prefix)
        if t.order == "prefix":
            return head
        return head + ms + [self._special[t.suffix]] + suffix + ms + [self._special[t.middle]]

    def head(self, context: list[int], prefix: list[int]) -> list[int] | None:
        """The prompt up to its prefix's end, where nothing that depends on the
        cursor comes before that (prefix and PSM orders; None for SPM, whose
        suffix comes first): what any prompt of this window starts with."""
        t = self.template
        if t.order == "prefix":
            return self._bos + context + prefix
        if t.order == "psm":
            return self._bos + context + [self._special[t.prefix]] + self._space + prefix
        return None

    def fit_suffix(self, suffix: str) -> tuple[int, list[int]]:
        """Whole lines of the suffix's head while they fit (at least the rest of the current line)."""
        head = suffix[: self.suffix_budget * 8]  # bound the work on huge files
        ids = self.tok.encode(head)
        if len(ids) <= self.suffix_budget and len(head) == len(suffix):
            return len(suffix), ids
        end = len(head)
        while end > 0:
            end = head.rfind("\n", 0, end)
            if end < 0:
                break
            ids = self.tok.encode(head[: end + 1])
            if len(ids) <= self.suffix_budget:
                return end + 1, ids
        line_end = suffix.find("\n")
        cut = line_end if 0 <= line_end < len(head) else len(head)  # bounded, as `head`
        # Decoding cut tokens may end in a partial char: re-encode whole chars.
        end = len(self.tok.decode(self.tok.encode(suffix[:cut])[: self.suffix_budget]))
        while len(ids := self.tok.encode(suffix[:end])) > self.suffix_budget and end > 0:
            end -= 1
        return end, ids

    def fit_prefix(self, prefix: str, budget: int, count=None) -> tuple[int, list[int]]:
        """The prefix tail that fits, starting at a line on the grid of
        `step_lines` (`anchored`: ~1 line in step_lines, chosen by content):
        typing at the cursor never moves that start until the window
        overflows, and then it jumps ~a whole step, so the tokens before the
        cursor (and their KV) stay the same keystroke after keystroke. Where
        that would keep less than half the budget or lose more than two steps
        (the next start on the grid is too far), the step is halved, down to
        single lines; a line too long on its own is cut at a char offset on a
        grid of offsets (`grid = "lines"`: line numbers that are multiples of
        the step, the grid before this one, kept to measure it against).
        `count(start, end)`: the tokens of prefix[start:end] (default: encode
        it; warming passes one read off a single encoding); with it, the ids
        returned are [] (the start is what is asked)."""
        if budget <= 0:
            return len(prefix), []
        counted, tails = count is not None, {}

        def encoded(start: int, end: int) -> int:
            ids = self.tok.encode(prefix[start:end])
            if end == len(prefix):
                tails[start] = ids  # (the window's ids, if it is this start)
            return len(ids)

        count = count or encoded
        # Code averages ~3 chars/token: a start further than budget*8 chars back
        # cannot fit, so only the lines after `reach` are listed (the work
        # follows the window, not the file).
        reach = max(0, len(prefix) - budget * 8)
        line_starts = [0] if reach == 0 else []
        line_starts += [m.end() for m in NEWLINE.finditer(prefix, max(0, reach - 1))]
        if self.grid == "content":
            on_grid = lambda k, step: anchored(prefix, line_starts[k], step)  # noqa: E731
        else:  # "lines": line numbers that are multiples of the step
            first_line = prefix.count("\n", 0, line_starts[0])
            on_grid = lambda k, step: (first_line + k) % step == 0  # noqa: E731
        start = self._fit_on_grid(prefix, line_starts, budget, self.step_lines, count, on_grid)
        if start is None:
            chars = range(prefix.rfind("\n") + 1, len(prefix) + 1)
            start = self._fit_on_grid(prefix, chars, budget, 1 << max(0, budget.bit_length() - 2), count,
                                      lambda k, step: k % step == 0)
        assert start is not None  # the empty tail always fits
        return start, [] if counted else tails.get(start) or self.tok.encode(prefix[start:])

    def _fit_on_grid(self, prefix: str, starts, budget: int, step: int, count,
                     on_grid: Callable[[int, int], bool]) -> int | None:
        """The earliest of `starts` (sorted char offsets) that is on the grid
        of `step` (`on_grid(index in starts, step)`) and from which the prefix
        fits, halving `step` while that keeps less than half the budget or is
        two steps away; None if none of `starts` fits."""
        # The word at the cursor (from the last whitespace, within 32 chars) is
        # counted as at least `margin` tokens: merges make its count dip while it
        # is typed, and a dip must not flip the window back and forth.
        tail = prefix[-32:]
        word = len(prefix) - len(tail) + max(0, *(tail.rfind(c) for c in " \t\n"))
        margin = min(8, budget // 4)

        def cost(start: int) -> int:
            exact = count(start, word) if start < word else 0
            return exact + max(margin, count(max(start, word), len(prefix)))

        # Fewer tokens the later the start: binary-search the earliest start that
        # fits. Code averages ~3 chars/token, so starts further than budget*8
        # chars back cannot fit and are not tried.
        lo, hi = bisect.bisect_left(starts, len(prefix) - budget * 8), len(starts)
        while lo < hi:
            mid = (lo + hi) // 2
            if cost(starts[mid]) <= budget:
                hi = mid
            else:
                lo = mid + 1
        first, step = lo, max(1, step)
        while first < len(starts):
            # The first start on the grid that fits, if within two steps of the first start that
            # fits (a content-drawn grid has gaps of any length: a window loses at most two steps).
            i = next((k for k in range(first, min(first + 2 * step, len(starts))) if on_grid(k, step)),
                     None)
            if i is not None and (i == first or 2 * cost(starts[i]) >= budget):
                if count(starts[i], len(prefix)) <= budget:
                    return starts[i]
                if i == first:  # `cost` was short (odd tokenizations): try the next start
                    first += 1
                    continue
            if step == 1:
                break
            step //= 2
        return None

    def build(self, prefix: str, suffix: str, path: str | None = None,
              snippets: list[Snippet] | None = None) -> Prompt:
        context = self.context_tokens(snippets or []) + self.header(path)
        suffix_end, suffix_ids = self.fit_suffix(suffix)
        overhead = len(self.assemble([], [], []))
        prefix_budget = self.budget - len(context) - len(suffix_ids) - overhead
        prefix_start, prefix_ids = self.fit_prefix(prefix, prefix_budget)
        tokens = self.assemble(context, prefix_ids, suffix_ids)
        return Prompt(tokens=tokens, window=Window(prefix_start, suffix_end), prefix_tokens=len(prefix_ids))

"""A prompt that a client rendered itself, read back into the document.

Continue (`provider: openai` or `llama.cpp`), llama.vscode's OpenAI mode
and Tabby's `llama.cpp/completion` send a FIM template filled in as plain
text: `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`, with
whatever model family's markers their user picked. llama.cpp tokenizes
that with special tokens parsed, which works only when the markers are the
served model's. Here the markers of the known families are found and the
text between them becomes the document's prefix and suffix again, so the
request goes through the pipeline like any other (the served model's own
template and window, token healing, the stop logic that reads the suffix):
a client's template for the wrong family still completes.

Anything before the first marker (repository context a template puts
there) becomes a context snippet; a prompt without markers is all prefix.
"""

from __future__ import annotations

from completer.prompt import TEMPLATES

# (prefix, suffix, middle) markers as templates spell them in text; middle ""
# for a family without one. The first three are the served templates' own.
MARKERS: list[tuple[str, str, str]] = [
    *sorted({(t.prefix, t.suffix, t.middle) for t in TEMPLATES.values() if t.prefix}),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("[PREFIX]", "[SUFFIX]", ""),  # Codestral: [SUFFIX]{suffix}[PREFIX]{prefix}
]
# Families whose template puts a space after <PRE> and before each later marker
# ("<PRE> {prefix} <SUF>{suffix} <MID>"): the spaces are the template's, not the document's.
SPACED = {(t.prefix, t.suffix, t.middle) for t in TEMPLATES.values() if t.marker_space}


def split_prompt(text: str) -> tuple[str, str, str]:
    """(context before the template, prefix, suffix). The text after the
    middle marker (what a PSM prompt has of the middle so far, or an SPM
    prompt's prefix) continues the prefix."""
    for markers in MARKERS:
        at = [text.find(m) if m else len(text) for m in markers]
        if min(at) < 0 or len(set(at)) < len(at):
            continue
        bounds = sorted(zip(at, (len(m) for m in markers)))

        def segment(i: int) -> str:
            """The text from marker i's end to the next marker (or the end)."""
            start = at[i] + len(markers[i])
            later = [pos for pos, _ in bounds if pos > at[i]]
            return text[start: min(later, default=len(text))]

        before, prefix, suffix, middle = text[: bounds[0][0]], segment(0), segment(1), segment(2)
        if markers in SPACED:
            prefix = _unspace(prefix, lead=True, trail=at[0] < max(at[1], at[2]))
            suffix = _unspace(suffix, lead=False, trail=at[1] < max(at[0], at[2]))
            middle = _unspace(middle, lead=True, trail=False)
        return before, prefix + middle, suffix
    return "", text, ""


def _unspace(segment: str, lead: bool, trail: bool) -> str:
    if lead and segment.startswith(" "):
        segment = segment[1:]
    if trail and segment.endswith(" "):
        segment = segment[:-1]
    return segment

"""A GGUF file's tokenizer, built with the `tokenizers` library from the
vocabulary stored in the file, as transformers' GGUF converter builds it
(`transformers.integrations.gguf`), without its cost: transformers takes ~30 s
on Gemma 3's 262,144 tokens; this, about 2 s.

Two kinds of vocabulary (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE, with the file's merges and the split of its
  `tokenizer.ggml.pre` (SmolLM2, Qwen2.5, Llama 3).
- "llama": SentencePiece BPE with byte fallback (`<0x0A>`), spaces as "\u2581".
  Built for the Gemma family's files (Gemma 3 270M), whose merges are not
  stored: they are the splits of each token into two tokens, ranked by the
  token's place in the vocabulary (Gemma's order of merges; its scores follow
  it), longer left halves first. Gemma has no dummy prefix; runs of spaces
  are stored as spaces and looked up as "\u2581"s.

Control tokens become special added tokens and user-defined ones plain added
tokens (both matched whole), as transformers does. A file whose tokenizer
cannot be built raises `UnsupportedTokenizer`, one line.
"""

from __future__ import annotations

from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from completer.tokenizer import BYTE_ENCODER

# How each `tokenizer.ggml.pre` splits text before BPE (byte-level vocabularies).
# StarCoder-family vocabularies (SmolLM's among them) were trained on single digits.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
                "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}
SINGLE_DIGIT_PRES = {"smollm", "starcoder", "refact", "codeshell"}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
# Architectures whose SentencePiece ("llama") vocabulary is built here.
SENTENCEPIECE_ARCHITECTURES = {"gemma", "gemma2", "gemma3"}
SPACE = "\u2581"


class UnsupportedTokenizer(ValueError):
    """The file's tokenizer cannot be built; the message (one line) says why."""


def from_metadata(get: Callable[..., Any]) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes; `get(key, default=None)` reads a key."""
    kind = get("tokenizer.ggml.model")
    arch = get("general.architecture")
    if kind == "gpt2":
        tokens = _require(get, "tokenizer.ggml.tokens")
        return byte_level_bpe(tokens, get("tokenizer.ggml.token_type") or [1] * len(tokens),
                              get("tokenizer.ggml.merges") or [], get("tokenizer.ggml.pre", "default"),
                              get("tokenizer.ggml.bos_token_id") if get("tokenizer.ggml.add_bos_token", False)
                              else None)
    if kind == "llama" and arch in SENTENCEPIECE_ARCHITECTURES:
        tokens = _require(get, "tokenizer.ggml.tokens")
        # llama.cpp puts BOS before a SentencePiece text unless the file says otherwise.
        return sentencepiece_bpe(tokens, get("tokenizer.ggml.token_type") or [1] * len(tokens),
                                 get("tokenizer.ggml.bos_token_id") if get("tokenizer.ggml.add_bos_token", True)
                                 else None, get("tokenizer.ggml.unknown_token_id"))
    raise UnsupportedTokenizer(f"tokenizer model {kind!r} is not supported for architecture {arch!r} "
                               f"(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece BPE, in "
                               f"{', '.join(sorted(SENTENCEPIECE_ARCHITECTURES))} files)")


def _require(get: Callable[..., Any], key: str):
    value = get(key)
    if value is None:
        raise UnsupportedTokenizer(f"metadata key {key!r} missing")
    return value


def byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str,
                   bos_id: int | None) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from a GGUF's vocabulary."""
    alphabet = set(BYTE_ENCODER.values())
    vocab = {}
    for i, token in enumerate(tokens):  # tokens outside the byte alphabet are spelled byte by byte
        spelled = token if set(token) <= alphabet else "".join(BYTE_ENCODER[b] for b in token.encode())
        vocab.setdefault(spelled, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in REGEX_SPLITS)
    if pre in REGEX_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(REGEX_SPLITS[pre]), behavior="isolated"), byte_level])
    elif pre in SINGLE_DIGIT_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok, tokens, types, lambda t: set(t) <= alphabet, vocab)
    _bos_template(tok, tokens, bos_id)
    return tok


def sentencepiece_bpe(tokens: list[str], types: list[int], bos_id: int | None, unk_id: int | None) -> Tokenizer:
    """A SentencePiece-BPE `tokenizers.Tokenizer` (byte fallback, no dummy
    prefix) from a Gemma GGUF's vocabulary, its merges rebuilt from it."""
    spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    unk = spelled[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_in_vocabulary_order(spelled, vocab), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    # Gemma's own tokenizer.json has this split; after the normalizer no space is left to split at.
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_tokens(tok, tokens, types, lambda t: True, vocab)  # runs of spaces: spelled with "\u2581", not added
    _bos_template(tok, tokens, bos_id)
    return tok


def merges_in_vocabulary_order(spelled: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, by the token's id, longer left
    halves first: transformers' `generate_merges` for Gemma, in one pass (its
    ranks are the ids, so sorting by id is iterating in order)."""
    return [(token[:k], token[k:]) for token in spelled for k in range(len(token) - 1, 0, -1)
            if token[:k] in vocab and token[k:] in vocab]


def _add_tokens(tok: Tokenizer, tokens: list[str], types: list[int], spellable: Callable[[str], bool],
                vocab: dict[str, int]) -> None:
    """Control tokens as special added tokens, user-defined ones as plain
    added tokens (a control token the vocabulary cannot spell is a converter's
    mislabel, left out)."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL and spellable(t)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab])


def _bos_template(tok: Tokenizer, tokens: list[str], bos_id: int | None) -> None:
    if bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])

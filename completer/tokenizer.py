"""Tokenizer wrapper over HF `tokenizers`, plus training of our byte-level BPE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Special tokens of the embedded default models (names follow Qwen2.5-Coder's,
# so one template family serves both).
END_OF_TEXT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_SUFFIX = "<|fim_suffix|>"
FILE_SEP = "<|file_sep|>"
DEFAULT_SPECIAL_TOKENS = [END_OF_TEXT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FILE_SEP]


class TextTokenizer:
    """Text <-> ids, and lookups of special tokens by their text."""

    def __init__(self, tokenizer: Tokenizer, path: Path | None = None):
        # The text-handling components alone: the whole tokenizer's JSON (Gemma's
        # 262,144 tokens and 514,906 merges) would take seconds to write and read.
        spec = {key: _component(getattr(tokenizer, key)) for key in ("normalizer", "pre_tokenizer", "decoder")}
        self.sentencepiece_style = _is_sentencepiece_style(spec)
        if self.sentencepiece_style:
            tokenizer = _without_dummy_prefix(tokenizer, spec)
        self.tokenizer = tokenizer
        # Document text that spells a special token ("<|endoftext|>" in a source
        # file) must stay text; prompts insert special tokens by id.
        self.tokenizer.encode_special_tokens = True
        self.path = path
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    @classmethod
    def from_file(cls, path: str | Path) -> "TextTokenizer":
        return cls(Tokenizer.from_file(str(path)), Path(path))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token strings inside `text` stay plain text."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes of `ids` (byte-level BPE), so callers can hold back a split UTF-8 char."""
        return b"".join(self.token_bytes(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        if self.sentencepiece_style:  # "\u2581" is a space; "<0xNN>" a byte-fallback byte
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        if not all(ch in BYTE_DECODER for ch in piece):
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return bytes(BYTE_DECODER[ch] for ch in piece)

    def bos_ids(self) -> list[int]:
        """What the tokenizer's own post-processor puts before a text (Llama's
        `<s>`, Llama 3's `<|begin_of_text|>`; nothing for Qwen or StarCoder)."""
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        full = self.tokenizer.encode("a", add_special_tokens=True).ids
        lead = full[: len(full) - len(plain)] if full[len(full) - len(plain):] == plain else []
        return [i for i in lead if i in self.special_ids]

    def token_id(self, text: str) -> int | None:
        return self.tokenizer.token_to_id(text)


def _component(component) -> dict | None:
    """A tokenizer component (normalizer, pre-tokenizer, decoder) as its JSON."""
    return None if component is None else json.loads(component.__getstate__())


def _is_sentencepiece_style(spec: dict) -> bool:
    """Words as "\u2581" pieces (Llama 2, CodeLlama, Mistral, Gemma), not
    byte-level. `spec`: the normalizer, pre-tokenizer and decoder as JSON."""
    return "\u2581" in json.dumps(spec, ensure_ascii=False)


def _without_dummy_prefix(tokenizer: Tokenizer, spec: dict) -> Tokenizer:
    """`tokenizer` without SentencePiece's dummy prefix: prompts are encoded
    in separate chunks, and each would otherwise gain a leading space (and the
    decoder would strip a real one). A space the text has is still a "\u2581"
    on the word after it, as in training. `spec`: its components' JSON; those
    that change are replaced in `tokenizer` (Gemma's have no prefix to drop)."""

    def strip(component: dict | None, drop: set[str]) -> dict | None:
        if component is None:
            return None
        if component.get("type") == "Sequence":
            key = "normalizers" if "normalizers" in component else \
                "decoders" if "decoders" in component else "pretokenizers"
            kept = [c for c in (strip(c, drop) for c in component[key]) if c is not None]
            return {**component, key: kept}
        if component.get("type") in drop:
            return None
        if component.get("type") == "Metaspace":
            return {**component, "prepend_scheme": "never", "add_prefix_space": False}
        return component

    stripped = {"normalizer": strip(spec["normalizer"], {"Prepend"}),
                "pre_tokenizer": strip(spec["pre_tokenizer"], set()), "decoder": strip(spec["decoder"], {"Strip"})}
    changed = {key: value for key, value in stripped.items() if value != spec[key]}
    if changed:
        # The changed components, read by a tokenizer of no vocabulary, then moved over.
        carrier = Tokenizer.from_str(json.dumps({
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "post_processor": None,
            "model": {"type": "BPE", "vocab": {}, "merges": []}, **{key: None for key in stripped}, **changed}))
        for key in changed:
            setattr(tokenizer, key, getattr(carrier, key))
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable mapping of the 256 byte values (used by ByteLevel BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


BYTE_ENCODER = _bytes_to_unicode()
BYTE_DECODER = {ch: b for b, ch in BYTE_ENCODER.items()}


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path) -> TextTokenizer:
    """Train a byte-level BPE with our special tokens; writes tokenizer.json and
    tokenizer_config.json (so `transformers.AutoTokenizer` loads it too)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=DEFAULT_SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    write_tokenizer_config(out_dir)
    return TextTokenizer(tok, out_dir / "tokenizer.json")


def write_tokenizer_config(out_dir: Path) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT,
              "bos_token": None, "pad_token": END_OF_TEXT, "unk_token": None,
              "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

"""A SentencePiece-BPE tokenizer built here, shaped like Llama 2's / CodeLlama's
tokenizer.json, for tests (no model hub on this machine)."""

import json

from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers


def llama2_style_tokenizer(texts, vocab_size=400) -> Tokenizer:
    """A SentencePiece-BPE tokenizer.json shaped like Llama 2's / CodeLlama's:
    dummy prefix, "\u2581" for spaces, <0xNN> byte fallback, <s> added before a text."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(["\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok

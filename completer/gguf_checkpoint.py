"""Load a GGUF file (llama.cpp's format) as a checkpoint.

The config comes from the file's metadata, the tensors from ggml-org's `gguf`
reader (dequantized to fp32, then cast to the serving precision), the tokenizer
from the vocabulary, merges and token types stored in the file. Two things
differ from an HF checkpoint: llama.cpp's converter permutes the rows of Q and
K of `llama` models (its RoPE rotates adjacent pairs, HF's rotates halves), and
llama3-style RoPE scaling is stored as a `rope_freqs` tensor. Every problem is
a `CheckpointError` whose one-line message names the file and the cause.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from completer.model import CheckpointError, ModelConfig, RopeScaling
from completer.tokenizer import BYTE_ENCODER, TextTokenizer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp's tensor names, per layer and global, to HF's.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

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


def _error(path: Path, cause: str) -> CheckpointError:
    return CheckpointError(f"{path}: {cause}")


def open_gguf(path: str | Path) -> "GgufFile":
    """A GgufFile, parsed once per version of the file: a start reads the
    default model's header to check it, to pick its precision and to load it,
    and parsing its 49,152-token vocabulary costs seconds each time."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return GgufFile(path)  # names the missing file
    return _opened(path.resolve(), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _opened(path: Path, mtime_ns: int, size: int) -> "GgufFile":
    return GgufFile(path)


class GgufFile:
    """An opened GGUF: metadata by key, tensors by name (memory-mapped)."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise _error(self.path, "file not found")
        try:
            self.reader = GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError, IndexError, struct errors
            raise _error(self.path, f"not a readable GGUF file ({type(e).__name__}: {e})") from None
        size = os.path.getsize(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise _error(self.path, f"truncated: tensor {t.name!r} ends at byte "
                                        f"{t.data_offset + t.n_bytes}, the file has {size}")

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise _error(self.path, f"metadata key {key!r} missing")
        return value

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if arch not in ARCHITECTURES:
            raise _error(self.path, f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
        return arch

    def config(self) -> ModelConfig:
        arch = self.architecture
        key = lambda name: f"{arch}.{name}"  # noqa: E731
        heads = self.require(key("attention.head_count"))
        hidden = self.require(key("embedding_length"))
        if "token_embd.weight" not in self.tensors:
            raise _error(self.path, "tensor 'token_embd.weight' missing")
        kind = self.get(key("rope.scaling.type"), "none")
        if kind not in ("none", "linear", "yarn"):
            raise _error(self.path, f"unsupported rope scaling type {kind!r}")
        rope = None if kind == "none" else RopeScaling(
            rope_type=kind, factor=self.get(key("rope.scaling.factor"), 1.0),
            original_max_position_embeddings=self.get(key("rope.scaling.original_context_length")))
        return ModelConfig(
            architecture=ARCHITECTURES[arch],
            vocab_size=int(self.tensors["token_embd.weight"].shape[1]),  # ggml order: [width, rows]
            hidden_size=hidden,
            intermediate_size=self.require(key("feed_forward_length")),
            num_hidden_layers=self.require(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=self.get(key("attention.head_count_kv")) or heads,
            head_dim=self.get(key("attention.key_length")) or hidden // heads,
            max_position_embeddings=self.get(key("context_length"), 2048),
            rms_norm_eps=self.get(key("attention.layer_norm_rms_epsilon"), 1e-6),
            rope_theta=self.get(key("rope.freq_base"), 10000.0),
            rope_scaling=rope,
            tie_word_embeddings="output.weight" not in self.tensors,
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            o_bias="blk.0.attn_output.bias" in self.tensors,
            mlp_bias="blk.0.ffn_up.bias" in self.tensors,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.get("tokenizer.ggml.eos_token_id"),
        )

    def layer_weights_type(self) -> str | None:
        """The type most of the layers' matrices are stored in ("Q4_1", "F32", ...)."""
        from collections import Counter

        kinds = Counter(t.tensor_type.name for name, t in self.tensors.items()
                        if name.startswith("blk.") and len(t.shape) == 2)
        return kinds.most_common(1)[0][0] if kinds else None

    def layer_weights_types(self) -> dict[str, int]:
        """How many of the layers' matrices each type stores ({"Q4_K": 150, "Q6_K": 46})."""
        from collections import Counter

        return dict(Counter(t.tensor_type.name for name, t in self.tensors.items()
                            if name.startswith("blk.") and len(t.shape) == 2))

    def int4_groups_by_module(self, cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`int4_groups` of every layer projection stored as 4-bit groups, by
        module name ("model.layers.0.self_attn.q_proj"), rows in HF's order
        (as `state_dict` gives the weights): what quantize_cpu_linears takes."""
        permuted = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
        out = {}
        for name in self.tensors:
            parts = name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in LAYER_TENSORS:
                continue
            groups = self.int4_groups(name)
            if groups is None:
                continue
            module = LAYER_TENSORS[parts[2]]
            if cfg.architecture == "LlamaForCausalLM" and module in permuted:
                groups = tuple(unpermute_rows(g, permuted[module]) for g in groups)
            out[f"model.layers.{parts[1]}.{module}"] = groups
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to fp32, in HF's (row-major) shape."""
        from gguf import GGMLQuantizationType, dequantize

        t = self.tensors[name]
        try:
            values = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
        except NotImplementedError:
            raise _error(self.path, f"tensor {name!r} is {t.tensor_type.name}, "
                                    f"which the gguf reader cannot dequantize") from None
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist()))))

    def tensor_type(self, name: str) -> str:
        """How the file stores a tensor: "Q4_K", "Q6_K", "F16", ..."""
        return self.tensors[name].tensor_type.name

    def int4_groups(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A matrix stored as 4-bit groups of 32 (Q4_0, Q4_1, Q4_K) as the
        file holds them: (q in 0..15 uint8 [N, K], scale, minimum fp32
        [N, K / 32]), rows in the file's order, with q * scale + minimum equal
        to the gguf reader's (and llama.cpp's) dequantized weights bit for bit.
        None for any other type."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        if kind not in INT4_GROUP_TYPES:
            return None
        rows = int(t.shape[1]) if len(t.shape) == 2 else 1
        return int4_groups_of(np.asarray(t.data).reshape(rows, -1), kind)

    def state_dict(self, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """HF-named tensors; Q/K rows of `llama` files back in HF's rotate-half order."""
        permuted = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
        state = {}
        for name in self.tensors:
            if name == "rope_freqs.weight":
                continue
            base, _, suffix = name.rpartition(".")
            parts = base.split(".")
            if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
                module = LAYER_TENSORS[parts[2]]
                hf = f"model.layers.{parts[1]}.{module}.{suffix}"
            elif base in GLOBAL_TENSORS:
                module, hf = None, f"{GLOBAL_TENSORS[base]}.{suffix}"
            else:
                raise _error(self.path, f"unexpected tensor {name!r}")
            tensor = self.tensor(name)
            if cfg.architecture == "LlamaForCausalLM" and module in permuted:
                tensor = unpermute_rows(tensor, permuted[module])
            state[hf] = tensor
        return state

    def rope_freq_factors(self) -> torch.Tensor | None:
        """llama3-style RoPE scaling, as llama.cpp stores it: a divisor per frequency."""
        return self.tensor("rope_freqs.weight") if "rope_freqs.weight" in self.tensors else None

    def tokenizer(self) -> TextTokenizer:
        model = self.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise _error(self.path, f"tokenizer model {model!r} is not supported (supported: 'gpt2', byte-level BPE)")
        tokens = self.require("tokenizer.ggml.tokens")
        types = self.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = self.get("tokenizer.ggml.merges") or []
        return TextTokenizer(byte_level_bpe(tokens, types, merges, self.get("tokenizer.ggml.pre", "default"),
                                            self.get("tokenizer.ggml.bos_token_id")
                                            if self.get("tokenizer.ggml.add_bos_token", False) else None),
                             self.path)


# Types whose blocks are 4-bit values in groups of 32 with a scale and a
# minimum each, Int4Linear's shape: they repack into it exactly (`int4_groups_of`).
INT4_GROUP_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


def int4_groups_of(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The groups of a matrix's blocks (uint8 [N, bytes per row]; `kind` in
    INT4_GROUP_TYPES): (q uint8 [N, K], scale, minimum fp32 [N, K / 32]).
    Per block (ggml's layouts, ggml-common.h):
    - Q4_0, 32 weights: fp16 d, 16 bytes of nibbles (weight j in byte j % 16,
      low nibble for j < 16); w = d * (q - 8): scale d, minimum -8 d.
    - Q4_1, 32 weights: fp16 d, fp16 m, the same nibbles; w = d * q + m.
    - Q4_K, 256 weights in 8 groups: fp16 d and dmin, 12 bytes packing a 6-bit
      scale sc and min m per group, 128 bytes of nibbles (group 2i in the low
      nibbles of bytes 32i..32i+31, group 2i+1 in their high ones);
      w = (d * sc) * q - dmin * m: scale d * sc, minimum -(dmin * m), both
      exact in fp32 (an fp16 times a 6-bit integer)."""
    N = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, -1, _BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_K":
        dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        s = blocks[..., 4:16].astype(np.uint8)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        scale = d[..., None] * sc.astype(np.float32)  # [N, blocks, 8]
        low = -(dmin[..., None] * mn.astype(np.float32))
        nib = blocks[..., 16:].reshape(N, -1, 4, 1, 32)
        q = np.concatenate((nib & 15, nib >> 4), -2)  # [N, blocks, 4, 2, 32]: group 2i, 2i + 1
    else:
        if kind == "Q4_0":
            scale, low, nib = d, -8 * d, blocks[..., 2:]
        else:
            scale, low, nib = d, blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[..., 4:]
        q = np.concatenate((nib & 15, nib >> 4), -1)  # [N, blocks, 32]
    return (torch.from_numpy(np.ascontiguousarray(q).reshape(N, -1)),
            torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(N, -1)),
            torch.from_numpy(np.ascontiguousarray(low, dtype=np.float32).reshape(N, -1)))


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of the rotary dimensions of Q or K
    (rows [h, 2, d/2] were stored as [h, d/2, 2])."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str,
                   bos_id: int | None) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from a GGUF's vocabulary.
    Control tokens become special added tokens and user-defined ones plain
    added tokens (both matched whole), as transformers' GGUF converter does."""
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
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab])
    if bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tok


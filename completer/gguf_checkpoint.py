"""Load a GGUF file (llama.cpp's format) as a checkpoint.

The config comes from the file's metadata, the tensors from ggml-org's `gguf`
reader (dequantized to fp32, then cast to the serving precision), the tokenizer
from the vocabulary stored in the file (`gguf_tokenizer`). Two things
differ from an HF checkpoint: llama.cpp's converter permutes the rows of Q and
K of `llama` and `granite` models (its RoPE rotates adjacent pairs, HF's
rotates halves), and llama3-style RoPE scaling is stored as a `rope_freqs`
tensor. What differs between families is completer/architectures.py's. Every
problem is a `CheckpointError` whose one-line message names the file and the cause.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from completer import architectures
from completer.model import CheckpointError, ModelConfig, RopeScaling
from completer.tokenizer import TextTokenizer

ARCHITECTURES = architectures.HF_CLASSES  # llama.cpp's `general.architecture` -> HF's class

class LazyTensor(NamedTuple):
    """A checkpoint tensor not read yet: its shape, and how to read it."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


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


@functools.cache
def _reader_class() -> type:
    """gguf's reader, over a plain array view of its memory map: it takes a
    view per value it parses, and numpy's memmap subclass costs Python calls
    on each, 5x the parse (Gemma 3's 262,144-token vocabulary: ~24 s, ~4.5 s
    this way; SmolLM2's 49,152: ~4 s, ~0.9 s). The map stays open through
    the view's base; tensors' data are views of it as before."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._data = mapped.view(np.ndarray)

    return Reader


def forget_opened() -> None:
    """Let go of the files `open_gguf` keeps, once the models are loaded: the
    reader's parsed metadata of a 151,936-token vocabulary holds ~360 MB."""
    _opened.cache_clear()


class GgufFile:
    """An opened GGUF: metadata by key, tensors by name (memory-mapped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise _error(self.path, "file not found")
        try:
            self.reader = _reader_class()(self.path)
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
        return self.config_and_rewrite()[0]

    def config_and_rewrite(self) -> tuple[ModelConfig, architectures.Rewrite]:
        """The model the metadata describes, and how the stored weights differ from ours."""
        arch = self.architecture
        key = lambda name: f"{arch}.{name}"  # noqa: E731
        heads = self.require(key("attention.head_count"))
        hidden = self.require(key("embedding_length"))
        head_dim = self.get(key("attention.key_length")) or hidden // heads
        layers = self.require(key("block_count"))
        if "token_embd.weight" not in self.tensors:
            raise _error(self.path, "tensor 'token_embd.weight' missing")
        kind = self.get(key("rope.scaling.type"), "none")
        if kind not in ("none", "linear", "yarn"):
            raise _error(self.path, f"unsupported rope scaling type {kind!r}")
        rope = None if kind == "none" else RopeScaling(
            rope_type=kind, factor=self.get(key("rope.scaling.factor"), 1.0),
            original_max_position_embeddings=self.get(key("rope.scaling.original_context_length")))
        family_fields, rewrite = architectures.gguf_fields(
            arch, lambda name, default: self.get(key(name), default), hidden, head_dim, layers)
        fields = dict(
            architecture=ARCHITECTURES[arch],
            vocab_size=int(self.tensors["token_embd.weight"].shape[1]),  # ggml order: [width, rows]
            hidden_size=hidden,
            intermediate_size=self.require(key("feed_forward_length")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=self.get(key("attention.head_count_kv")) or heads,
            head_dim=head_dim,
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
        return ModelConfig(**{**fields, **family_fields}), rewrite

    def layer_weights_types(self) -> dict[str, int]:
        """How many of the layers' matrices each type stores ({"Q4_K": 150, "Q6_K": 46})."""
        from collections import Counter

        return dict(Counter(t.tensor_type.name for name, t in self.tensors.items()
                            if name.startswith("blk.") and len(t.shape) == 2))

    def int4_groups_of_layer(self, cfg: ModelConfig, rewrite: architectures.Rewrite,
                             layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`int4_groups` of layer `layer`'s projections stored as 4-bit
        groups, by module name in the layer ("self_attn.q_proj"), as
        `lazy_state_dict` gives their weights: rows in HF's order, the
        family's constant factor (`architectures.tensor_rewrite`) applied to
        scale and minimum. What quantize_cpu_linears takes."""
        family = architectures.family_of(cfg.architecture)
        permuted = permuted_heads(cfg)
        out = {}
        for kind, module in architectures.gguf_layer_tensors(family).items():
            name = f"blk.{layer}.{kind}.weight"
            if name not in self.tensors or len(self.tensors[name].shape) != 2:
                continue
            groups = self.int4_groups(name)
            if groups is None:
                continue
            if module in permuted:
                groups = tuple(unpermute_rows(g, permuted[module]) for g in groups)
            step = architectures.tensor_rewrite(f"model.layers.{layer}.{module}.weight", rewrite, cfg.qk_norm)
            if step is not None:  # a constant factor: on the scale and the minimum
                groups = (groups[0], step(groups[1]), step(groups[2]))
            out[module] = groups
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
        # A dequantized tensor is a new array already (copied once more, a 3B model's embedding took 1.2 GB
        # more while loading); an F32 one is a view of the read-only file, copied.
        values = np.asarray(values, dtype=np.float32)
        if not values.flags.writeable:
            values = values.copy()
        return torch.from_numpy(values.reshape(tuple(reversed(t.shape.tolist()))))

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
        """HF-named tensors; Q/K rows of `llama` / `granite` files back in HF's rotate-half order."""
        return {name: lazy.read() for name, lazy in self.lazy_state_dict(cfg).items()}

    def lazy_state_dict(self, cfg: ModelConfig) -> dict[str, LazyTensor]:
        """As `state_dict`, each tensor read (dequantized to fp32) only when
        asked: the loader builds a layer at a time, so a model's fp32 weights
        never sit in memory all at once (a 3B model's are 12 GB)."""
        family = architectures.family_of(cfg.architecture)
        layer_tensors = architectures.gguf_layer_tensors(family)
        permuted = permuted_heads(cfg)
        state = {}
        for name in self.tensors:
            if name == "rope_freqs.weight":
                continue
            base, _, suffix = name.rpartition(".")
            parts = base.split(".")
            if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
                module = layer_tensors[parts[2]]
                hf = f"model.layers.{parts[1]}.{module}.{suffix}"
            elif base in architectures.GGUF_GLOBAL_TENSORS:
                module, hf = None, f"{architectures.GGUF_GLOBAL_TENSORS[base]}.{suffix}"
            else:
                raise _error(self.path, f"unexpected tensor {name!r}")
            heads = permuted.get(module)
            shape = tuple(reversed(self.tensors[name].shape.tolist()))
            state[hf] = LazyTensor(shape, functools.partial(self._hf_tensor, name, heads))
        return state

    def _hf_tensor(self, name: str, heads: int | None) -> torch.Tensor:
        tensor = self.tensor(name)
        return tensor if heads is None else unpermute_rows(tensor, heads)

    def rope_freq_factors(self) -> torch.Tensor | None:
        """llama3-style RoPE scaling, as llama.cpp stores it: a divisor per frequency."""
        return self.tensor("rope_freqs.weight") if "rope_freqs.weight" in self.tensors else None

    def tokenizer(self) -> TextTokenizer:
        """The tokenizer its vocabulary describes (`gguf_tokenizer`)."""
        from completer.gguf_tokenizer import UnsupportedTokenizer, from_metadata

        try:
            return TextTokenizer(from_metadata(self.get), self.path)
        except UnsupportedTokenizer as e:
            raise _error(self.path, str(e)) from None


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


def permuted_heads(cfg: ModelConfig) -> dict[str, int]:
    """Modules whose rows llama.cpp's converter permuted (`llama`, `granite`), with their head counts."""
    if architectures.family_of(cfg.architecture) not in architectures.PERMUTED_QK:
        return {}
    return {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of the rotary dimensions of Q or K
    (rows [h, 2, d/2] were stored as [h, d/2, 2])."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

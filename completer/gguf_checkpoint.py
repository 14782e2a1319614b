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

    def layer_weights_type(self) -> str | None:
        """The type most of the layers' matrices are stored in ("Q4_1", "F32", ...)."""
        from collections import Counter

        kinds = Counter(t.tensor_type.name for name, t in self.tensors.items()
                        if name.startswith("blk.") and len(t.shape) == 2)
        return kinds.most_common(1)[0][0] if kinds else None

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

    def state_dict(self, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """HF-named tensors; Q/K rows of `llama` / `granite` files back in HF's rotate-half order."""
        return {name: lazy.read() for name, lazy in self.lazy_state_dict(cfg).items()}

    def lazy_state_dict(self, cfg: ModelConfig) -> dict[str, LazyTensor]:
        """As `state_dict`, each tensor read (dequantized to fp32) only when
        asked: the loader builds a layer at a time, so a model's fp32 weights
        never sit in memory all at once (a 3B model's are 12 GB)."""
        family = architectures.family_of(cfg.architecture)
        layer_tensors = architectures.gguf_layer_tensors(family)
        permuted = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
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
            heads = permuted.get(module) if family in architectures.PERMUTED_QK else None
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


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of the rotary dimensions of Q or K
    (rows [h, 2, d/2] were stored as [h, d/2, 2])."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

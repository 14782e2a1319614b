"""Load and save HF-format checkpoint directories; load GGUF files.

A directory holds `config.json`, `model.safetensors` (or shards listed in
`model.safetensors.index.json`) and `tokenizer.json`. Every problem is raised
as a `CheckpointError` whose one-line message names the file and the cause.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from completer import architectures
from completer.cpu_quant import CPU_PRECISIONS, MIXED, int8_fused_here, quantize_cpu_linears
from completer.fp8 import load_fp8_weights, quantize_linears
from completer.gguf_checkpoint import INT4_GROUP_TYPES, GgufFile, LazyTensor, open_gguf
from completer.model import CheckpointError, ModelConfig, RopeScaling, Transformer
from completer.tokenizer import TextTokenizer, write_tokenizer_config

SUPPORTED_ARCHITECTURES = tuple(architectures.FAMILIES)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# FP8 checkpoints store e4m3 `x.weight` with `x.weight_scale` (or DeepSeek-style
# `x.weight_scale_inv`); static `x.input_scale`s are dropped: we scale per token.
FP8_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def parse_config(path: Path) -> ModelConfig:
    return parse_config_and_rewrite(path)[0]


def parse_config_and_rewrite(path: Path) -> tuple[ModelConfig, architectures.Rewrite]:
    """The model a config.json describes, and how its weights differ from ours."""
    raw = _read_json(path)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported architecture {arch!r} "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    family = architectures.family_of(arch)
    why = architectures.hf_unsupported(family, raw)
    if why:
        raise CheckpointError(f"{path}: {why}")
    try:
        heads = raw["num_attention_heads"]
        scaling = architectures.hf_rope(family, raw)
        theta = scaling["rope_theta"]
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise CheckpointError(f"{path}: unsupported rope scaling type {kind!r}")
        rope_fields = {k: v for k, v in scaling.items() if k in RopeScaling.__struct_fields__}
        rope = RopeScaling(**{**rope_fields, "rope_type": kind}) if kind != "default" else None
        is_qwen = arch == "Qwen2ForCausalLM"
        family_fields, rewrite = architectures.hf_fields(family, raw)
        fields = dict(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope,
            tie_word_embeddings=raw.get("tie_word_embeddings", family in architectures.TIED_BY_DEFAULT),
            qkv_bias=True if is_qwen else raw.get("attention_bias", False),
            o_bias=False if is_qwen else raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            head_vocab_size=raw.get("head_vocab_size", 0),
            embedding_from_target=raw.get("embedding_from_target", False),
        )
        return ModelConfig(**{**fields, **family_fields}), rewrite
    except KeyError as e:
        raise CheckpointError(f"{path}: missing key {e.args[0]!r}") from None
    except CheckpointError:
        raise
    except ValueError as e:  # an activation, a rope type the family's fields name
        raise CheckpointError(f"{path}: {e}") from None


def weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        for shard in shards:
            if not (directory / shard).is_file():
                raise CheckpointError(f"{directory / shard}: shard listed in {index.name} not found")
        return [directory / s for s in shards]
    raise CheckpointError(f"{single}: file not found (nor a sharded {index.name})")


def resolve_precision(precision: str, device: str | torch.device = "cpu", source: str | Path | None = None) -> str:
    """"auto": bf16 on CUDA. On a CPU, for a GGUF whose layers are quantized,
    `gguf_cpu_precision` of its types (int4 for the default model, Q4_1: its
    groups come back exactly, so int4 serves the weights as shipped, and it
    streams the fewest bytes: the fastest CPU precision measured,
    BENCHMARKS.md); else bf16 where the hardware computes in it natively
    (CPUs with AVX512-BF16 or AMX, where bf16 halves weight traffic and
    doubles matmul rate; measured on the default target: the same bits per
    byte as fp32), fp32 elsewhere (emulated bf16 is slower than fp32)."""
    if precision != "auto":
        return precision
    if torch.device(device).type == "cuda":
        return "bf16"
    if source is not None and is_gguf(Path(source)) and Path(source).is_file():
        chosen = gguf_cpu_precision(open_gguf(source).layer_weights_types(), int8_fused_here())
        if chosen is not None:
            return chosen
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"


# Quantized types with more than 4 bits a weight: served as int8 (one scale a
# row, 7 bits), which loses less than requantizing them to int4 (docs/models.md).
WIDER_QUANT_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def gguf_cpu_precision(types: dict[str, int], int8_fused: bool) -> str | None:
    """The CPU precision for a GGUF whose layers' matrices are stored as
    `types` (type -> how many), or None (a float precision):
    - all 4-bit groups (Q4_0, Q4_1, Q4_K): int4, every matrix exact;
    - all quantized, some wider (Q5_0 .. Q8_0), where int8 runs in the fused
      layer (`int8_fused`, AVX512-VNNI): int4+int8 (the 4-bit groups exact,
      the rest int8), or int8 when none are 4-bit groups;
    - elsewhere, mostly 4-bit groups: int4 (the wider matrices requantized;
      int8 would take the whole model off the fused layer); else None."""
    total = sum(types.values())
    four = sum(n for kind, n in types.items() if kind in INT4_GROUP_TYPES)
    wider = sum(n for kind, n in types.items() if kind in WIDER_QUANT_TYPES)
    if total and four == total:
        return "int4"
    if total and int8_fused and four + wider == total:
        return MIXED if four else "int8"
    return "int4" if 2 * four > total else None


def is_gguf(path: Path) -> bool:
    """A `.gguf` name, or a file that starts with GGUF's magic."""
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def load_checkpoint(path: str | Path, precision: str = "fp32", device: str | torch.device = "cpu",
                    target: Transformer | None = None, fuse: bool = False) -> tuple[Transformer, TextTokenizer]:
    """The model and tokenizer of an HF directory or a GGUF file."""
    path = Path(path)
    if is_gguf(path):
        gguf = open_gguf(path)
        return _load_gguf(gguf, precision, device, fuse), gguf.tokenizer()
    return load_model(path, precision, device, target, fuse), load_tokenizer(path)


def load_model(path: str | Path, precision: str = "fp32", device: str | torch.device = "cpu",
               target: Transformer | None = None, fuse: bool = False) -> Transformer:
    """An HF checkpoint directory or a GGUF file. precision: auto, fp32, bf16,
    fp16, fp8 (projections as completer.fp8.Fp8Linear, the rest bf16), or on
    CPU int8 / int4 / int4+int8 (projections and head as completer.cpu_quant's,
    the rest fp32). `target`: the model a drafter with `embedding_from_target` drafts
    for. `fuse`: q/k/v and gate/up as one projection each (serving)."""
    path = Path(path)
    if is_gguf(path):
        return _load_gguf(open_gguf(path), precision, device, fuse)
    if not path.is_dir():
        raise CheckpointError(f"{path}: model directory not found")
    cfg, rewrite = parse_config_and_rewrite(path / "config.json")
    state, scales = _read_safetensors(path, cfg)
    _rewrite(state, rewrite, cfg.qk_norm, path)
    if cfg.embedding_from_target:
        embedding = None if target is None else target.model.embed_tokens.weight
        if embedding is None or tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise CheckpointError(f"{path / 'config.json'}: a drafter that reads its target's embeddings "
                                  f"({cfg.vocab_size} x {cfg.hidden_size}) needs that target")
        state["model.embed_tokens.weight"] = embedding.detach()
    model = _build(cfg, state, scales, precision, device, path, fuse)
    if cfg.embedding_from_target and model.model.embed_tokens.weight.dtype == embedding.dtype:
        model.model.embed_tokens.weight = target.model.embed_tokens.weight  # one copy in memory
    return model


def _load_gguf(gguf: GgufFile, precision: str, device, fuse: bool = False) -> Transformer:
    cfg, rewrite = gguf.config_and_rewrite()
    state = gguf.lazy_state_dict(cfg)
    _check_shapes(_expected_shapes(cfg), state, gguf.path)
    _rewrite(state, rewrite, cfg.qk_norm, gguf.path)
    groups = functools.partial(gguf.int4_groups_of_layer, cfg, rewrite) if precision in CPU_PRECISIONS else None
    model = _build(cfg, state, {}, precision, device, gguf.path, fuse, groups)
    factors = gguf.rope_freq_factors()
    if factors is not None:
        model.inv_freq = model.inv_freq / factors.to(model.inv_freq)
    return model


def _rewrite(state: dict[str, torch.Tensor | LazyTensor], rewrite: architectures.Rewrite, qk_norm: bool,
             source: Path) -> None:
    """The family's rewrite of the weights (architectures.py), as each is read."""
    for name, tensor in state.items():
        step = architectures.tensor_rewrite(name, rewrite, qk_norm)
        if step is None:
            continue
        if isinstance(tensor, LazyTensor):
            state[name] = LazyTensor(tensor.shape, lambda read=tensor.read, step=step: step(read()))
            continue
        try:
            state[name] = step(tensor)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None


def _expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    return expected


def _check_shapes(expected: dict[str, torch.Size], state: dict[str, torch.Tensor | LazyTensor], source: Path) -> None:
    for name, tensor in state.items():
        if name not in expected:
            raise CheckpointError(f"{source}: unexpected tensor {name!r}")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the config implies {tuple(expected[name])}")


def _read_safetensors(directory: Path, cfg: ModelConfig) -> tuple[dict, dict]:
    """The weights (and FP8 scales) of a checkpoint directory, checked against
    `cfg`: FP8 tensors and scales read, the others `LazyTensor`s (read as
    `_build` builds their layer)."""
    expected = _expected_shapes(cfg)
    family = architectures.family_of(cfg.architecture)
    state: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for stored in handle.keys():
                    name = architectures.hf_rename(family, stored)
                    base = name.rsplit(".", 1)[0] + ".weight"
                    if name.endswith(FP8_SCALE_SUFFIXES) and base in expected:
                        scales[name] = handle.get_tensor(stored)
                        continue
                    if name not in expected:
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            continue  # some tied checkpoints store the copy anyway
                        if name.endswith("rotary_emb.inv_freq"):
                            continue
                        raise CheckpointError(f"{f}: unexpected tensor {name!r}")
                    piece = handle.get_slice(stored)
                    if piece.get_dtype().startswith("F8"):
                        tensor = handle.get_tensor(stored)
                    else:
                        tensor = LazyTensor(tuple(piece.get_shape()), functools.partial(_safetensor, f, stored))
                    _check_shapes(expected, {name: tensor}, f)
                    state[name] = tensor
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
    return state, scales


def _safetensor(path: Path, name: str) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None


def _read(tensor: torch.Tensor | LazyTensor, dtype: torch.dtype | None, device) -> torch.Tensor:
    """The tensor on `device`, a float one cast to `dtype` (None: as stored)."""
    tensor = tensor.read() if isinstance(tensor, LazyTensor) else tensor
    return tensor.to(device=device, dtype=dtype) if dtype and tensor.is_floating_point() else tensor.to(device)


def _build(cfg: ModelConfig, state: dict[str, torch.Tensor | LazyTensor], scales: dict[str, torch.Tensor],
           precision: str, device, source: Path, fuse: bool = False,
           int4_groups: Callable[[int], dict[str, tuple]] | None = None) -> Transformer:
    """The model from its tensors, a layer at a time (each read, cast, fused
    and quantized before the next is read: loading holds the served weights
    and one layer's fp32 ones, never the whole model's twice); with FP8
    weights or at fp8, the whole model first, then converted. `int4_groups`:
    layer -> the 4-bit groups a GGUF stores for its projections
    (`GgufFile.int4_groups_of_layer`), which quantize_cpu_linears takes as they are."""
    precision = resolve_precision(precision, device)
    if precision in CPU_PRECISIONS and torch.device(device).type != "cpu":
        raise CheckpointError(f"precision {precision!r} runs on CPU only (on {device}: fp8 or bf16)")
    missing = sorted(set(_expected_shapes(cfg)) - set(state))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: tensor {missing[0]!r}{more} missing from the weights")
    dtype = torch.bfloat16 if precision == "fp8" else torch.float32 if precision in CPU_PRECISIONS \
        else DTYPES.get(precision)
    if dtype is None:
        raise CheckpointError(f"unknown precision {precision!r} "
                              f"(known: auto, {', '.join(DTYPES)}, fp8, {', '.join(CPU_PRECISIONS)})")
    fp8_weights = {name: state.pop(name) for name in list(state)
                   if isinstance(state[name], torch.Tensor) and state[name].dtype == torch.float8_e4m3fn}
    with torch.device("meta"):
        model = Transformer(cfg)
    if not fp8_weights and precision != "fp8":
        try:
            return _build_by_layer(model, state, precision, dtype, device, fuse, int4_groups)
        except ValueError as e:  # a width int4's groups do not divide
            raise CheckpointError(f"{source}: {e}") from None
    state = {name: _read(tensor, None, device) for name, tensor in state.items()}
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope(device)  # the buffers were on meta
    model = model.to(dtype).eval()
    if fp8_weights or precision == "fp8":
        try:
            load_fp8_weights(model, fp8_weights, scales, keep_fp8=precision == "fp8")
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None
        if precision == "fp8":
            quantize_linears(model)
    if fuse:
        model.fuse_projections()
    if precision in CPU_PRECISIONS:
        try:
            quantize_cpu_linears(model, precision, None if int4_groups is None else {
                f"model.layers.{i}.{name}": g for i in range(cfg.num_hidden_layers) for name, g in int4_groups(i).items()})
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None
    return model


def _build_by_layer(model: Transformer, state: dict[str, torch.Tensor | LazyTensor], precision: str,
                    dtype: torch.dtype, device, fuse: bool,
                    int4_groups: Callable[[int], dict[str, tuple]] | None = None) -> Transformer:
    """`_build` a layer at a time: its tensors read and cast (they become
    the layer's own: `assign`), then fused and quantized, then the next.
    Raises ValueError where a CPU precision cannot take a width."""
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        part = {name[len(prefix):]: _read(state.pop(name), dtype, device)
                for name in [n for n in state if n.startswith(prefix)]}
        layer.load_state_dict(part, strict=True, assign=True)
        del part
        if fuse:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if precision in CPU_PRECISIONS:
            quantize_cpu_linears(layer, precision, int4_groups(i) if int4_groups else None)
    model.load_state_dict({name: _read(t, dtype, device) for name, t in state.items()}, strict=False, assign=True)
    state.clear()
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # A buffer left on meta (not in the state dict); cast as `model.to(dtype)` casts every float buffer.
    model.reset_rope(device, dtype)
    model.eval()
    if precision in CPU_PRECISIONS:
        quantize_cpu_linears(model, precision)  # the head, the one nn.Linear left
    return model


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    """`tokenizer.json` of a checkpoint directory, or the vocabulary of a GGUF file."""
    if is_gguf(Path(directory)):
        return open_gguf(directory).tokenizer()
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return TextTokenizer.from_file(path)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None


def config_json(cfg: ModelConfig) -> dict:
    """An HF config.json for our default models (saved as LlamaForCausalLM)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "bfloat16",
        # Ours (a drafter's reduced output layer, shared embeddings); transformers does not know them.
        **({"head_vocab_size": cfg.head_vocab_size} if cfg.head_vocab_size else {}),
        **({"embedding_from_target": True} if cfg.embedding_from_target else {}),
    }


def save_model(model: Transformer, directory: Path, tokenizer: TextTokenizer,
               dtype: torch.dtype = torch.bfloat16) -> None:
    """Write an HF-format directory that transformers' AutoModelForCausalLM loads."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state = {k: (v.detach().to(dtype) if v.is_floating_point() else v).contiguous()
             for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and cfg.tie_word_embeddings)
             and not (k == "model.embed_tokens.weight" and cfg.embedding_from_target)}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_json(model.config), indent=2) + "\n")
    tokenizer.tokenizer.save(str(directory / "tokenizer.json"))
    write_tokenizer_config(directory)

"""Load and save HF-format checkpoint directories; load GGUF files.

A directory holds `config.json`, `model.safetensors` (or shards listed in
`model.safetensors.index.json`) and `tokenizer.json`. Every problem is raised
as a `CheckpointError` whose one-line message names the file and the cause.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from completer.cpu_quant import CPU_PRECISIONS, MIXED, int8_fused_here, quantize_cpu_linears
from completer.fp8 import load_fp8_weights, quantize_linears
from completer.gguf_checkpoint import INT4_GROUP_TYPES, GgufFile, open_gguf
from completer.model import CheckpointError, ModelConfig, RopeScaling, Transformer, rope_inverse_frequencies
from completer.tokenizer import TextTokenizer, write_tokenizer_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
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
    raw = _read_json(path)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported architecture {arch!r} "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{path}: sliding-window attention is not supported")
    try:
        heads = raw["num_attention_heads"]
        # transformers < 5 writes rope_theta + rope_scaling; 5 writes rope_parameters.
        scaling = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        theta = scaling.get("rope_theta", raw.get("rope_theta", 10000.0))
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise CheckpointError(f"{path}: unsupported rope scaling type {kind!r}")
        fields = {k: v for k, v in scaling.items() if k in RopeScaling.__struct_fields__}
        rope = RopeScaling(**{**fields, "rope_type": kind}) if kind != "default" else None
        is_qwen = arch == "Qwen2ForCausalLM"
        return ModelConfig(
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
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=True if is_qwen else raw.get("attention_bias", False),
            o_bias=False if is_qwen else raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            head_vocab_size=raw.get("head_vocab_size", 0),
            embedding_from_target=raw.get("embedding_from_target", False),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: missing key {e.args[0]!r}") from None


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
    cfg = parse_config(path / "config.json")
    state, scales = _read_safetensors(path, cfg)
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
    cfg = gguf.config()
    state = gguf.state_dict(cfg)
    _check_shapes(_expected_shapes(cfg), state, gguf.path)
    groups = gguf.int4_groups_by_module(cfg) if precision in CPU_PRECISIONS else None
    model = _build(cfg, state, {}, precision, device, gguf.path, fuse, groups)
    factors = gguf.rope_freq_factors()
    if factors is not None:
        model.inv_freq = model.inv_freq / factors.to(model.inv_freq)
    return model


def _expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    return expected


def _check_shapes(expected: dict[str, torch.Size], state: dict[str, torch.Tensor], source: Path) -> None:
    for name, tensor in state.items():
        if name not in expected:
            raise CheckpointError(f"{source}: unexpected tensor {name!r}")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the config implies {tuple(expected[name])}")


def _read_safetensors(directory: Path, cfg: ModelConfig) -> tuple[dict, dict]:
    """The weights (and FP8 scales) of a checkpoint directory, checked against `cfg`."""
    expected = _expected_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    base = name.rsplit(".", 1)[0] + ".weight"
                    if name.endswith(FP8_SCALE_SUFFIXES) and base in expected:
                        scales[name] = handle.get_tensor(name)
                        continue
                    if name not in expected:
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            continue  # some tied checkpoints store the copy anyway
                        if name.endswith("rotary_emb.inv_freq"):
                            continue
                        raise CheckpointError(f"{f}: unexpected tensor {name!r}")
                    tensor = handle.get_tensor(name)
                    _check_shapes(expected, {name: tensor}, f)
                    state[name] = tensor
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
    return state, scales


def _build(cfg: ModelConfig, state: dict[str, torch.Tensor], scales: dict[str, torch.Tensor],
           precision: str, device, source: Path, fuse: bool = False,
           int4_groups: dict[str, tuple] | None = None) -> Transformer:
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
    fp8_weights = {name: state.pop(name) for name in list(state) if state[name].dtype == torch.float8_e4m3fn}
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inverse_frequencies(cfg).to(device)  # buffer was on meta
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
            quantize_cpu_linears(model, precision, int4_groups)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None
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

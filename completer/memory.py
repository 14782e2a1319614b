"""What the models take in memory once served, from their shapes alone, and
the memory a server may use (`model.max_memory_gb`): `completer serve`
refuses at start, in one line, models that would not fit (cli.check_models),
before any weight is read.

The estimate counts what completer holds per weight of the projections
(attention's and the MLP's) at each precision, the embedding and the head,
the K/V pool (`engine.kv_cache_mb`, allocated whole at start) and a fixed
share for the process (Python, torch, the tokenizer, one layer's fp32
weights while loading). Measured against the RSS of a process serving
random-weight models at Qwen2.5-Coder's shapes: latency_bench/real_sizes.py
reports both. Bytes per projection weight:

- fp32 4, bf16 and fp16 2, fp8 1 (and the scales).
- int8 1 (fbgemm's packed rows), plus 1 for the fused CPU layer's tiles on
  AVX512-VNNI.
- int4 1.375 (torch's int4 pack 0.5, plain nibbles 0.5, fp32 scale and
  minimum per group of 32 0.25, the kernel's scale and zero 0.125 in bf16),
  plus the resident bf16 copy of `model.int4_dense_rows` (2; fp32, 4, where
  the CPU has no bf16), plus the fused layer's Q4_1 blocks (0.625).

The embedding stays fp32 at int8 and int4 (4 bytes a row's weight), and the
head is int8 there (1, twice with the fused layer: it keeps its own copy);
a tied head at fp32/bf16 is the embedding itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from completer.model import ModelConfig

GB = 1e9
PROCESS_BYTES = int(0.6 * GB)  # Python, torch, tokenizer and the parsed vocabulary, a layer while loading


def _has_bf16() -> bool:
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _has_vnni() -> bool:
    from completer.cpu_quant import int8_fused_here  # (imports torch: here, where it is needed)

    return int8_fused_here()


def projection_weights(cfg: ModelConfig) -> int:
    """Weights of every layer's q, k, v, o, gate, up and down projections."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    d = cfg.hidden_size
    return cfg.num_hidden_layers * (d * (q + 2 * kv) + q * d + 3 * d * cfg.intermediate_size)


def bytes_per_projection_weight(precision: str, int4_dense_rows: int = 0, fused_cpu: bool = True) -> float:
    wide = 2 if _has_bf16() else 4  # int4's compute dtype
    if precision == "int4":
        return 1.25 + 2 * wide / 32 + (wide if int4_dense_rows > 0 else 0) + (0.625 if fused_cpu else 0)
    if precision == "int8":
        return 1 + (1 if fused_cpu and _has_vnni() else 0)
    if precision == "int4+int8":  # each projection one or the other: the larger bounds it
        return max(bytes_per_projection_weight(p, int4_dense_rows, fused_cpu) for p in ("int4", "int8"))
    return {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1 + 4 / 128}[precision]


def model_bytes(cfg: ModelConfig, precision: str, int4_dense_rows: int = 0, fused_cpu: bool = True) -> int:
    """Bytes a model holds once loaded at `precision` (resolved: not "auto")."""
    rows = 0 if cfg.embedding_from_target else cfg.vocab_size * cfg.hidden_size  # (a drafter reading its target's)
    head = (cfg.head_vocab_size or cfg.vocab_size) * cfg.hidden_size
    if precision in ("int8", "int4", "int4+int8"):
        rest = 4 * rows + head * (2 if fused_cpu else 1)
    else:
        wide = 4 if precision == "fp32" else 2
        rest = wide * (rows + (0 if cfg.tie_word_embeddings else head))
    return int(projection_weights(cfg) * bytes_per_projection_weight(precision, int4_dense_rows, fused_cpu) + rest)


def available_bytes() -> tuple[int | None, str]:
    """The memory this process may still take, and where that figure came
    from: the kernel's MemAvailable, or a cgroup's limit less its usage where
    that is lower (a container). (None, why) where neither can be read."""
    found: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "available here (MemAvailable)"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append((int(limit) - used, "left under this cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    if not found and hasattr(os, "sysconf"):
        try:
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free here"))
        except (ValueError, OSError):
            pass
    return min(found) if found else (None, "unknown")


def memory_problem(max_memory_gb: float, need: dict[str, int]) -> str | None:
    """One line when `need` (what -> bytes) exceeds the budget: `max_memory_gb`,
    or with 0 the memory available at start; None when it fits (or the
    available memory cannot be read)."""
    if max_memory_gb > 0:
        budget, where = int(max_memory_gb * GB), "model.max_memory_gb"
    else:
        budget, where = available_bytes()
        if budget is None:
            return None
        where = f"{where}; model.max_memory_gb = 0"
    total = sum(need.values())
    if total <= budget:
        return None
    parts = ", ".join(f"{what} {size / GB:.2f}" for what, size in need.items())
    return (f"model.max_memory_gb: the models need about {total / GB:.1f} GB ({parts}), more than the "
            f"{budget / GB:.1f} GB {where}: choose a smaller model or precision, lower engine.kv_cache_mb or "
            "model.int4_dense_rows, or raise model.max_memory_gb")

"""`[model]`: which models, at what precision, on what device, and how a prompt is built for them."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from completer.config.problem import ConfigProblem


class ModelSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    target: str = "default"  # a named model fetched once ("default": SmolLM2-135M; "gemma3-270m"), "embedded", a path
    draft: str = "default"  # "default" (the drafter made for the target, if any), "embedded", a path, "" for none
    # auto: bf16 where native, else fp32 (a quantized GGUF on CPU: int4, int8 or int4+int8, docs/models.md);
    # int8 / int4 / int4+int8: CPU quantized weights (completer/cpu_quant.py)
    precision: Literal["auto", "fp32", "bf16", "fp8", "int8", "int4", "int4+int8"] = "auto"
    fuse_projections: bool = True  # one GEMM for q/k/v and one for gate/up (false: HF's seven per layer)
    device: str = "cpu"  # "cpu" or "cuda" (or "cuda:N")
    template: str = ""  # FIM template; "" detects it from the tokenizer
    order: str = ""  # "psm" / "spm" to override the template's order
    context_tokens: int = 1024  # prompt + completion window
    int4_dense_rows: int = 32  # int4: passes of this many rows or more use a resident bf16 copy (0: none)
    # oneDNN's and ideep's per-shape kernel caches, entries each (theirs: 1,024, ~1.2 MB more per new prompt length).
    kernel_cache_entries: int = 128
    # On a CPU, the start refuses models whose weights and K/V pool (completer/memory.py's estimate) exceed
    # this many GB; 0: the memory available when it starts.
    max_memory_gb: float = 0.0
    # The context block: the windows of the files a client sent that best match the code before the
    # cursor (completer/retrieval.py), kept while typing; false: the files whole, in the client's order.
    retrieval: bool = True
    # ... and at a jump within the window, kept unless a new choice is far better (retrieval.HOLD_MARGIN):
    # a new block recomputes the cached window behind it. false: the margin of typing alone.
    retrieval_hold: bool = True
    # Where a window may start: "content", lines chosen by a hash of their text (the same starts for the
    # same text, whatever a client sends above it; prompt.anchored); "lines", line numbers on a grid.
    window_grid: Literal["content", "lines"] = "content"
    # Token healing (completer/healing.py): where the prompt ends with the prefix, its last token is taken back
    # and the completion must spell it again, so a word cut by the cursor is continued as a word. false: off.
    token_healing: bool = True


def model_problems(m: ModelSection) -> list[ConfigProblem]:
    """Values of `[model]` that cannot work (whether the models exist and fit is checked at start)."""
    # The template names are the prompt builder's (prompt.py reaches no subsystem and no torch);
    # imported here so that importing the schemas alone (a type, a default) loads no tokenizers library.
    from completer.prompt import TEMPLATES

    found = []
    if m.template and m.template not in TEMPLATES:
        found.append(ConfigProblem(("model.template",), f"model.template = {m.template!r}: unknown "
                                   f"(known: {', '.join(TEMPLATES)}, or \"\" to detect it)"))
    if m.order not in ("", "psm", "spm"):
        found.append(ConfigProblem(("model.order",), f"model.order = {m.order!r}: must be \"psm\", \"spm\" or \"\""))
    if m.int4_dense_rows < 0:
        found.append(ConfigProblem(("model.int4_dense_rows",), f"model.int4_dense_rows = {m.int4_dense_rows}: "
                                   "must be 0 (no copy) or more"))
    if not (m.max_memory_gb >= 0 and math.isfinite(m.max_memory_gb)):  # (NaN fails too)
        found.append(ConfigProblem(("model.max_memory_gb",), f"model.max_memory_gb = {m.max_memory_gb}: "
                                   "must be 0 (the memory available at start) or a positive number of GB"))
    if m.kernel_cache_entries < 1:
        found.append(ConfigProblem(("model.kernel_cache_entries",),
                                   f"model.kernel_cache_entries = {m.kernel_cache_entries}: must be at least 1"))
    return found

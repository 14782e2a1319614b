"""The engine's config sections (`[engine]`, `[spec]`); every speed feature has a switch."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple

import msgspec

if TYPE_CHECKING:
    from completer.model import ModelConfig


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefix_cache: bool = True  # reuse cached KV across requests
    kv_cache_mb: float = 256.0  # KV block pool budget (target and drafter together)
    block_size: int = 2  # tokens per KV block: a warm keystroke recomputes its last, partly matched block
    max_running: int = 32  # sequences decoded together
    max_queue: int = 64  # waiting requests beyond this are refused (overloaded)
    prefill_chunk: int = 512  # prompt tokens per iteration, so decodes keep flowing
    batch_prefill: bool = True  # prefill chunks of similar length in one padded pass (else one pass each)
    paged_attention: Literal["auto", "torch", "triton"] = "auto"  # decode/verify attention; auto: triton on CUDA
    cuda_graphs: bool = True  # replay plain decode steps as CUDA graphs (with the triton kernel, on CUDA)
    # On CPU: torch.compile the layers' dense halves at start. Off by default: measured
    # (BENCHMARKS.md, CPU decode) it gains only at int4, and costs seconds at start.
    compile: bool = False
    # On CPU at int4 (and int8 on AVX512-VNNI): passes of up to 32 new tokens (decode, verify, a
    # keystroke's prefill) run each layer as one C++ call (kernels/cpu_decode.cpp, compiled here at first use; engine/fused_cpu.py).
    fused_cpu: bool = True
    # The fused layer's 4-bit GEMMs with activations rounded to 8 bits per block of 32 (llama.cpp's
    # math): on AVX512-VNNI a keystroke's pass ~1.5x faster, exact match within noise of fp32
    # activations (BENCHMARKS.md); false: fp32 activations.
    fused_cpu_q8: bool = True
    # How the K/V pool stores keys and values; attention's math is fp32 either way. Measured on
    # CPU (BENCHMARKS.md): fp16 ~5% off a keystroke's pass and half the memory per token, but
    # first-line exact match 14.5% against fp32's 15.5% (200 sites), so fp32 stays the default.
    kv_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    threads: int = 0  # CPU threads for prefill (compute-bound); 0 = torch's default
    decode_threads: int = 0  # CPU threads for decode steps; 0 = as `threads`
    # First tokens go out as soon as the prefill pass made them, and cancels that came
    # meanwhile apply before the decode pass (else both wait for the step's end).
    between_passes: bool = True
    # With between_passes: how long the engine waits for the event loop to write
    # those first tokens before its next pass takes every core (0 = not at all):
    # on 2 cores the loop otherwise got one only when the scheduler took it from
    # the pass (a keystroke's first text 1.5-2 ms later at the median).
    yield_to_loop_ms: float = 2.0
    # Token healing's backed-off token rides the prefill pass as a one-token
    # draft: when the healed first token is that token (most often), the pass
    # also made the second, and the first text is out a pass sooner.
    heal_in_prefill: bool = True
    # A pass whose every sequence a newer keystroke cancelled is given up
    # between layers, so the new request does not wait for it to finish.
    interrupt_superseded: bool = True
    # After a jump within a file the window's start moves and the prefix cache
    # misses; the longest run of the new prompt that a recent prompt computed
    # (at other positions) is copied in with its keys re-rotated, as llama.cpp's
    # --cache-reuse shifts chunks (engine/moved_kv.py; not with disaggregation).
    reuse_moved_kv: bool = True
    # A request's extra candidates (protocol `n`) are forked only while the
    # running batch, with them, stays within this: each is a row of every
    # decode pass, nearly free while passes are bound by reading the weights.
    candidates_max_batch: int = 8
    # Interactive work first (engine/scheduler.py): a keystroke's few new tokens and its
    # decode passes run before bulk work (a prime, another editor's cold file, anything with
    # more than `bulk_tokens` uncached prompt tokens). A bulk pass of `bulk_chunk` tokens
    # pauses between layers when interactive work arrives and resumes where it stopped;
    # when interactive work has kept bulk work waiting `bulk_starve_ms`, bulk work gets a
    # slice of `bulk_slice_ms` (at least one layer). false: first come, first served.
    interactive_first: bool = True
    bulk_tokens: int = 1024
    bulk_chunk: int = 256
    bulk_starve_ms: float = 500.0
    bulk_slice_ms: float = 25.0


class SpecConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    draft_model: bool = True  # drafter proposals
    ngram: bool = True  # n-gram proposals from the prompt and output
    max_batch: int = 8  # speculation off above this running batch size
    adaptive: bool = True  # draft length (0 = none) by measured acceptance and pass costs
    k_init: int = 4  # draft length when not adaptive
    k_max: int = 8  # longest draft
    ngram_min: int = 2
    ngram_max: int = 4
    draft_share: float = 0.15  # share of kv_cache_mb given to the drafter's cache
    # The drafter takes in a new prompt when it first drafts for it, after the
    # first token is out (and never, where speculation does not pay);
    # false: beside the target's prefill, before the first token.
    defer_draft_prefill: bool = True


# -- validation -----------------------------------------------------------------
# The structs take any value of the right type (tests and benchmarks build them
# directly); `completer.config.load_config` runs these checks on what a user
# wrote, so a value the engine cannot run with stops the start with one line.


class ConfigProblem(NamedTuple):
    keys: tuple[str, ...]  # the keys it is about, e.g. ("engine.block_size",), to say where they were set
    message: str  # one line naming them and the bound


def _below(key: str, value: int, least: int) -> list[ConfigProblem]:
    if value < least:
        return [ConfigProblem((key,), f"{key} = {value}: must be at least {least}")]
    return []


def _not_positive(key: str, value: float) -> list[ConfigProblem]:
    # Written so that NaN fails too (TOML has `nan` and `inf`).
    if not (value > 0 and math.isfinite(value)):
        return [ConfigProblem((key,), f"{key} = {value}: must be a positive number")]
    return []


def engine_problems(engine: EngineConfig) -> list[ConfigProblem]:
    """Values of `[engine]` the engine cannot run with (the size of the KV cache
    against the models is `kv_cache_problem`'s, once their shapes are known)."""
    found = _not_positive("engine.kv_cache_mb", engine.kv_cache_mb)
    for key in ("block_size", "max_running", "max_queue", "prefill_chunk", "bulk_chunk"):
        found += _below(f"engine.{key}", getattr(engine, key), 1)
    for key in ("threads", "decode_threads"):  # 0 = torch's default
        found += _below(f"engine.{key}", getattr(engine, key), 0)
    found += _below("engine.candidates_max_batch", engine.candidates_max_batch, 0)  # 0: never fork candidates
    found += _below("engine.bulk_tokens", engine.bulk_tokens, 0)
    for key in ("bulk_starve_ms", "bulk_slice_ms"):
        found += _not_positive(f"engine.{key}", getattr(engine, key))
    return found


def spec_problems(spec: SpecConfig) -> list[ConfigProblem]:
    """Values of `[spec]` speculation cannot run with."""
    found = _below("spec.k_max", spec.k_max, 0) + _below("spec.k_init", spec.k_init, 0)
    found += _below("spec.max_batch", spec.max_batch, 0)  # 0: never speculate
    found += _below("spec.ngram_min", spec.ngram_min, 1)  # a 0-gram would match everywhere
    if not found and spec.k_init > spec.k_max:
        found.append(ConfigProblem(("spec.k_init", "spec.k_max"),
                                   f"spec.k_init = {spec.k_init} is above spec.k_max = {spec.k_max}"))
    if not found and spec.ngram_max < spec.ngram_min:
        found.append(ConfigProblem(("spec.ngram_max", "spec.ngram_min"),
                                   f"spec.ngram_max = {spec.ngram_max} is below spec.ngram_min = {spec.ngram_min}"))
    # The drafter's pool is this share of kv_cache_mb, the target's the rest: both must get some.
    if spec.draft_model and not 0 < spec.draft_share < 1:
        found.append(ConfigProblem(("spec.draft_share",), f"spec.draft_share = {spec.draft_share}: must be "
                                   "between 0 and 1 (exclusive) while spec.draft_model = true"))
    return found


# Budget, in MB, over which pool_blocks' rounding down is negligible: MB per
# block measured on it is exact to a millionth for any model (no memory is taken).
_PROBE_MB = 2.0 ** 20


def kv_cache_problem(engine: EngineConfig, spec: SpecConfig, context_tokens: int,
                     models: dict[str, ModelConfig]) -> ConfigProblem | None:
    """Whether one request over the whole window fits each KV pool.

    models: role ("target", and "draft" when the drafter runs) -> its shape.
    The engine refuses a request whose worst case exceeds a pool
    (`KVCacheManager.too_large`); when not even a full-window request fits,
    every long prompt would be refused, so the start stops instead."""
    from completer.engine.paged_kv import KV_DTYPES, pool_blocks  # imports torch: only callers with models get here

    dtype = KV_DTYPES[engine.kv_dtype]

    # As EngineCore.build splits the budget between the pools.
    share = {"target": 1 - spec.draft_share, "draft": spec.draft_share} if "draft" in models else {"target": 1.0}
    # KVCacheManager.worst_case of a full window: prompt + completion = context_tokens,
    # plus a last verify pass of k_max + 1 tokens; and block 0, the scratch block.
    need = -(-(context_tokens + spec.k_max + 1) // engine.block_size) + 1
    for role, cfg in models.items():
        have = pool_blocks(cfg, engine.kv_cache_mb * share[role], engine.block_size, dtype)
        if have >= need:
            continue
        mb_per_block = _PROBE_MB / pool_blocks(cfg, _PROBE_MB, engine.block_size, dtype)
        enough = math.ceil(need * mb_per_block / share[role] * 10) / 10
        while pool_blocks(cfg, enough * share[role], engine.block_size, dtype) < need:  # float rounding: a step or two
            enough = round(enough + 0.1, 1)
        share_hint = " (or raise spec.draft_share)" if role == "draft" else ""
        return ConfigProblem(
            ("engine.kv_cache_mb", "spec.draft_share", "model.context_tokens"),
            f"engine.kv_cache_mb = {engine.kv_cache_mb} gives the {role} model {have} KV blocks of "
            f"{engine.block_size} tokens; one request over the whole window (model.context_tokens = "
            f"{context_tokens}, plus {spec.k_max + 1} tokens of a last verify pass) needs {need} with the "
            f"scratch block: set engine.kv_cache_mb to at least {enough}{share_hint}")
    return None

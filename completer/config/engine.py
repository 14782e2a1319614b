"""`[engine]` and `[spec]`: the engine's sections; every speed feature has a switch."""

from __future__ import annotations

from typing import Literal

import msgspec

from completer.config.problem import ConfigProblem, below, not_positive


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


def engine_problems(engine: EngineConfig) -> list[ConfigProblem]:
    """Values of `[engine]` the engine cannot run with (the size of the KV cache
    against the models is `engine/paged_kv.py`'s `kv_cache_problem`, once their shapes
    are known, at start)."""
    found = not_positive("engine.kv_cache_mb", engine.kv_cache_mb)
    for key in ("block_size", "max_running", "max_queue", "prefill_chunk", "bulk_chunk"):
        found += below(f"engine.{key}", getattr(engine, key), 1)
    for key in ("threads", "decode_threads"):  # 0 = torch's default
        found += below(f"engine.{key}", getattr(engine, key), 0)
    found += below("engine.candidates_max_batch", engine.candidates_max_batch, 0)  # 0: never fork candidates
    found += below("engine.bulk_tokens", engine.bulk_tokens, 0)
    for key in ("bulk_starve_ms", "bulk_slice_ms"):
        found += not_positive(f"engine.{key}", getattr(engine, key))
    return found


def spec_problems(spec: SpecConfig) -> list[ConfigProblem]:
    """Values of `[spec]` speculation cannot run with."""
    found = below("spec.k_max", spec.k_max, 0) + below("spec.k_init", spec.k_init, 0)
    found += below("spec.max_batch", spec.max_batch, 0)  # 0: never speculate
    found += below("spec.ngram_min", spec.ngram_min, 1)  # a 0-gram would match everywhere
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

"""The engine's config sections (`[engine]`, `[spec]`); every speed feature has a switch."""

from __future__ import annotations

from typing import Literal

import msgspec


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefix_cache: bool = True  # reuse cached KV across requests
    kv_cache_mb: float = 256.0  # KV block pool budget (target and drafter together)
    block_size: int = 16  # tokens per KV block
    max_running: int = 32  # sequences decoded together
    max_queue: int = 64  # waiting requests beyond this are refused (overloaded)
    prefill_chunk: int = 512  # prompt tokens per iteration, so decodes keep flowing
    paged_attention: Literal["auto", "torch", "triton"] = "auto"  # decode/verify attention; auto: triton on CUDA
    cuda_graphs: bool = True  # replay plain decode steps as CUDA graphs (with the triton kernel, on CUDA)
    threads: int = 0  # CPU threads for prefill (compute-bound); 0 = torch's default
    decode_threads: int = 0  # CPU threads for decode steps; 0 = as `threads`


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

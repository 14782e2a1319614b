"""The engine: paged warm KV cache, scheduling, speculative decoding, streaming."""

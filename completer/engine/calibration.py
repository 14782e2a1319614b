"""Pass timings at start: a target pass of every verify width (and a drafter
step) at a few batch sizes, so speculation decides from this machine's costs
from the first request on; the policy keeps refining them as it runs. And
the prefill rate, which disaggregation's decision starts from (a worker
measures its own)."""

from __future__ import annotations

import time

from completer.engine.block_manager import BlockManager
from completer.engine.model_runner import ModelRunner
from completer.engine.sequence import CacheState


def time_passes(runner: ModelRunner, blocks: BlockManager, batch: int, widths: list[int], context: int,
                reps: int) -> dict[int, float]:
    """Median seconds of a pass adding `width` tokens to each of `batch` dummy
    sequences of `context` tokens (nothing if the pool is too small)."""
    if batch * -(-(context + max(widths)) // blocks.block_size) > blocks.num_free:
        return {}
    states = [CacheState() for _ in range(batch)]
    for state in states:
        blocks.grow(state.table, context + max(widths))
    runner.execute(states, [[1] * context] * batch, last_only=True)
    timed = {}
    for width in widths:
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            int(runner.execute(states, [[1] * width] * batch).argmax())  # waits for the result
            times.append(time.perf_counter() - started)
            for state in states:
                state.computed = context
        timed[width] = sorted(times)[len(times) // 2]
    for state in states:
        blocks.release(state.table)
    return timed


def prefill_rate(runner: ModelRunner, blocks: BlockManager, tokens: int, reps: int = 2) -> float | None:
    """Prompt tokens per second of a one-sequence prefill pass of `tokens`
    (the best of `reps`; the first pass also warms the kernels up)."""
    if -(-tokens // blocks.block_size) > blocks.num_free:
        return None
    state = CacheState()
    blocks.grow(state.table, tokens)
    best = float("inf")
    for _ in range(reps + 1):
        state.computed = 0
        started = time.perf_counter()
        runner.execute([state], [[1] * tokens], last_only=True).argmax().item()
        best = min(best, time.perf_counter() - started)
    blocks.release(state.table)
    return tokens / best

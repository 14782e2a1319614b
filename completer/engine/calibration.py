"""What an engine measures and prepares on its thread before the first
request: the compiled passes (`engine.compile`); a target pass of every
verify width (and a drafter step) at a few batch sizes, so speculation
decides from this machine's costs from the first request on (the policy
keeps refining them as it runs); the prefill rate, which a KV connector's
decision starts from (a prefill worker measures its own)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from completer.engine.block_manager import BlockManager
from completer.engine.kv_cache_manager import advance
from completer.engine.model_runner import ModelRunner
from completer.engine.sequence import CacheState

if TYPE_CHECKING:
    from completer.engine.core import EngineCore

log = logging.getLogger(__name__)


def prepare(core: EngineCore) -> None:
    """All of it, as the engine thread does at start."""
    compile_passes(core)
    if core.spec.adaptive and core.speculator.proposers:
        calibrate_speculation(core)
    if core.connector is not None:
        calibrate_prefill(core)


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
    advance(states, [context] * batch)  # (the timed passes below write after it and leave it as it is)
    timed = {}
    for width in widths:
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            int(runner.execute(states, [[1] * width] * batch).argmax())  # waits for the result
            times.append(time.perf_counter() - started)
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
    for _ in range(reps + 1):  # (each pass writes the same positions: a pass leaves `computed` as it is)
        started = time.perf_counter()
        runner.execute([state], [[1] * tokens], last_only=True).argmax().item()
        best = min(best, time.perf_counter() - started)
    blocks.release(state.table)
    return tokens / best


def compile_passes(core: EngineCore) -> None:
    """With `engine.compile` on a CPU: compile each model's layers now
    (a 1-token pass, then one of several tokens: the two shapes inductor
    specializes), not under a user's first keystroke."""
    runners = {role: r for role, r in core.runners.items() if r.device.type == "cpu"}
    if not core.config.compile or not runners:
        return
    log.info("engine: compiling the decode and verify passes (torch.compile; engine.compile=false skips)")
    started = time.perf_counter()
    try:
        for role, runner in runners.items():
            runner.model.compile_layers()
            time_passes(runner, core.kv.pools[role], 1, [1, 2], 16, 1)
    except Exception as e:  # no C++ compiler, a torch bug: slower, never down
        for runner in runners.values():
            runner.model.eager_layers()
        log.warning("engine: torch.compile failed, passes run eager: %s", str(e).strip().splitlines()[0])
        log.debug("engine: the compile failure", exc_info=True)
        return
    log.info("engine: passes compiled in %.1f s", time.perf_counter() - started)


def calibrate_speculation(core: EngineCore, context: int = 256, reps: int = 3,
                          batches: tuple[int, ...] = (1, 4)) -> None:
    """Pass costs of the target at every verify width, and of a drafter step."""
    previous = torch.get_num_threads()
    torch.set_num_threads(core.decode_threads)
    try:
        for batch in batches:
            widths = list(range(1, core.spec.k_max + 2))
            for width, seconds in time_passes(core.target, core.kv.pools["target"], batch, widths,
                                              context, reps).items():
                core.policy.costs.observe_target(batch, width, seconds)
            if core.draft is not None:
                for _, seconds in time_passes(core.draft, core.kv.pools["draft"], batch, [1],
                                              context, reps).items():
                    core.policy.costs.observe_draft(batch, seconds)
    finally:
        torch.set_num_threads(previous)


def calibrate_prefill(core: EngineCore) -> None:
    """A KV connector decides from this machine's prefill rate from the first request on."""
    previous = torch.get_num_threads()
    torch.set_num_threads(core.prefill_threads)
    try:
        rate = prefill_rate(core.target, core.kv.pools["target"], min(core.config.prefill_chunk, 512))
    finally:
        torch.set_num_threads(previous)
    if rate is not None:
        core.connector.set_prefill_rate(rate)

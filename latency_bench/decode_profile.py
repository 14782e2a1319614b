"""Where a decode step's time goes: the torch profiler's top operators for one
plain decode step of the target and of the drafter (batch 1, a 1,000-token
context, through the engine's paged cache), then the pass costs the engine
calibrates at start, which decide how far it speculates.

    python -m latency_bench decode-profile --out docs/results/decode_profile.txt   # the embedded models
    python -m latency_bench decode-profile --model default --width 6   # SmolLM2 and its drafter; a
                                                                       # keystroke's pass of 6 new tokens
    python -m latency_bench decode-profile --model default --precision int8 --compile --batch 4
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from completer.engine.block_manager import BlockManager
from completer.config import EngineConfig
from completer.engine.engine import Engine, run_in_passing_thread
from completer.engine.kv_cache_manager import advance
from completer.engine.model_runner import ModelRunner
from completer.engine.paged_kv import KVPool
from completer.engine.sequence import CacheState
from completer.loading import LoadedModel, load_models
from latency_bench.run_results import write_result


def operator_table(loaded: LoadedModel, context: int, steps: int, rows: int, threads: int,
                   width: int = 1, batch: int = 1, compiled: bool = False) -> str:
    torch.set_num_threads(threads)
    if compiled:
        loaded.model.compile_layers()
    per_row = -(-(context + width) // 16)
    blocks = batch * per_row + 8
    runner = ModelRunner(loaded.model, KVPool(loaded.model.config, blocks, 16))
    manager = BlockManager(blocks, 16)
    states = [CacheState() for _ in range(batch)]
    for state in states:
        manager.grow(state.table, context + width)
        runner.execute([state], [[1] * context], last_only=True)
        advance([state], [context])

    def step() -> None:  # (the same positions each time: a pass leaves `computed` as it is)
        runner.execute(states, [[7] * width] * batch, last_only=width == 1)

    for _ in range(5):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    per_step_ms = prof.key_averages().self_cpu_time_total / steps / 1000
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return (f"{loaded.name}: {per_step_ms:.2f} ms of CPU per pass of {batch} x {width} new tokens "
            f"({steps} passes)\n{table}\n")


async def pass_costs(target: LoadedModel, draft: LoadedModel, threads: int, compiled: bool) -> str:
    engine = Engine.build(target, draft, EngineConfig(threads=threads, compile=compiled))
    engine.start()  # calibrates
    engine.stop()
    costs = engine.core.policy.costs
    lines = ["pass costs calibrated by the engine (decode threads "
             f"{engine.core.decode_threads}), relative to a 1-token target pass:"]
    for batch in sorted({b for b, _ in costs.target}):
        widths = sorted(w for b, w in costs.target if b == batch)
        plain = costs.target[(batch, 1)] * 1000
        ratios = " ".join(f"{w}:{costs.verify_ratio(batch, w):.2f}" for w in widths)
        lines.append(f"  batch {batch}: 1-token pass {plain:.2f} ms; width:ratio {ratios}; "
                     f"drafter step {costs.draft_ratio(batch):.2f}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded", help="the target setting: embedded, default, a path")
    p.add_argument("--precision", default="auto")
    p.add_argument("--width", type=int, default=1, help="new tokens per profiled pass")
    p.add_argument("--batch", type=int, default=1, help="sequences per profiled pass")
    p.add_argument("--compile", action="store_true", help="the layers compiled, as engine.compile does")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows", type=int, default=12, help="operators listed per model")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    target, draft = run_in_passing_thread(load_models, args.model, "default", args.precision)
    out = io.StringIO()
    out.write(f"precision {target.precision}, {args.threads} threads, "
              f"{'compiled' if args.compile else 'eager'}\n\n")
    for loaded in (target, draft):  # on a thread that ends, as the engine's torch work wants
        out.write(run_in_passing_thread(operator_table, loaded, args.context, args.steps, args.rows,
                                        args.threads, args.width, args.batch, args.compile))
    out.write(asyncio.run(pass_costs(target, draft, args.threads, args.compile)))
    print(out.getvalue())
    if args.out:
        write_result(args.out, out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())

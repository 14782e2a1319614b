"""What the soak (latency_bench/soak.py) does to the server besides its
clients: CPU-heavy side processes that starve it (issue #31 item 7: model
loads beside a supersede storm), faults injected into its prefill worker
(SIGSTOP then SIGCONT, SIGKILL and the server starting it again), and the
server's memory as the kernel sees it, to tell allocator retention from a
leak when RSS grows."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from latency_bench.run_results import Fault, Memory

ROOT = Path(__file__).resolve().parents[1]

# A side process: loads the cached default model again and again (reading and
# dequantizing ~100 MB of GGUF: seconds of CPU per load), or, where it is not
# cached, spins (never fetches it: a soak must not download).
LOADER = """
import sys, time
from completer.model_store import DEFAULT_TARGET, cached_path
path = cached_path(DEFAULT_TARGET)
if path.exists():
    from completer.loading import load
    while True:
        load(path, "auto")
        print("loaded", flush=True)
else:
    print("spinning: no cached default model", flush=True)
    while True:
        sum(i * i for i in range(10**6))
        print("loaded", flush=True)
"""


UP_AGAIN_S = 180.0  # a killed worker is started again: a model load, slow beside the loads


class SideLoads:
    """`n` CPU-heavy processes beside the server until `stop()`; how many loads they completed."""

    def __init__(self, n: int):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        self.procs = [subprocess.Popen([sys.executable, "-c", LOADER], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True) for _ in range(n)]
        from completer.model_store import DEFAULT_TARGET, cached_path
        self.kind = "model loads" if cached_path(DEFAULT_TARGET).exists() else "busy loops"
        self.loads = 0
        self.readers = [asyncio.get_running_loop().run_in_executor(None, self._count, p) for p in self.procs]

    def _count(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.loads += line.startswith("loaded")

    async def stop(self) -> str:
        """End them (by their own ids); what they did, in words."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                await asyncio.to_thread(p.wait, 10)
            except subprocess.TimeoutExpired:
                p.kill()
        await asyncio.gather(*self.readers)
        return f"{len(self.procs)} processes of {self.kind}, {self.loads} done"


# -- faults -------------------------------------------------------------------------

def prefill_workers(server_pid: int) -> list[psutil.Process]:
    """The `completer prefill-worker` processes the server started."""
    try:
        children = psutil.Process(server_pid).children()
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if "prefill-worker" in child.cmdline():
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


async def inject(server_pid: int, kind: str, hold_s: float, start: float, workers_up) -> Fault | None:
    """One fault on the server's first prefill worker; `workers_up()` reads the
    server's completer_prefill_workers_up (None: no answer). Returns once a
    worker is up again (or UP_AGAIN_S after the fault), None when there is no worker."""
    workers = prefill_workers(server_pid)
    if not workers:
        return None
    worker = workers[0]
    fault = Fault(kind, round(time.perf_counter() - start, 1), 0.0, worker.pid)
    watch_until = time.monotonic() + hold_s
    if kind == "stop":
        worker.send_signal(signal.SIGSTOP)
        try:
            while time.monotonic() < watch_until:
                await note_down(fault, start, workers_up)
                await asyncio.sleep(0.5)
        finally:  # never left stopped (a stopped process would not even take the SIGTERM the server's end sends)
            worker.send_signal(signal.SIGCONT)
    else:
        worker.send_signal(signal.SIGKILL)
    fault.until_s = round(time.perf_counter() - start, 1)
    give_up = time.monotonic() + UP_AGAIN_S
    while time.monotonic() < give_up:
        up = await asyncio.to_thread(workers_up)
        if up == 0:
            await note_down(fault, start, lambda: 0)
        elif up and (kind == "stop" or fault.down_at_s is not None):
            fault.up_again_s = round(time.perf_counter() - start, 1)
            break
        await asyncio.sleep(0.25)
    after = prefill_workers(server_pid)
    fault.pid_after = after[0].pid if after else None
    return fault


async def note_down(fault: Fault, start: float, workers_up) -> None:
    if fault.down_at_s is None and await asyncio.to_thread(workers_up) == 0:
        fault.down_at_s = round(time.perf_counter() - start, 1)


# -- memory -------------------------------------------------------------------------

def memory(pid: int, at_s: float) -> Memory:
    p = psutil.Process(pid)
    status = {k: v for k, _, v in (ln.partition(":") for ln in Path(f"/proc/{pid}/status").read_text().splitlines())}
    kb = lambda key: int(status.get(key, "0 kB").split()[0]) / 1024  # noqa: E731
    heap = anon = 0.0
    count = 0
    for m in p.memory_maps(grouped=False):
        if m.path == "[heap]":
            heap += m.rss / 2**20
        elif not m.path or m.path == "[anon]":
            anon += m.rss / 2**20
            count += 1
    return Memory(at_s, round(p.memory_info().rss / 2**20, 1), round(kb("RssAnon"), 1), round(kb("RssFile"), 1),
                  round(heap, 1), round(anon, 1), count, p.num_threads())

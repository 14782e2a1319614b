"""What a reliability run measured, as the soak and the fairness run write it
and RELIABILITY.md (reliability.py) reads it: the result structs, the
invariants a soak must hold (`violations`), and the machine and date every
benchmark records with its figures (`machine`, `now`)."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path

import msgspec
import psutil

ROOT = Path(__file__).resolve().parents[1]


# -- what a run measured ----------------------------------------------------------

class Machine(msgspec.Struct):
    platform: str
    cpu: str
    cores: int
    memory_gb: float
    python: str
    commit: str
    uncommitted_changes: bool
    load_average: list[float]  # 1, 5, 15 minutes, when the run ended: the machine may be shared


class KvPlan(msgspec.Struct):
    kv_cache_mb: float
    pool_blocks: dict[str, int]  # role -> blocks
    full_window_blocks: int  # what the longest request reserves
    fits: bool


class Gauges(msgspec.Struct):
    kv_blocks_used: dict[str, float] | None  # completer_kv_blocks_used{pool}, where the server has it
    kv_usage: float | None  # completer_kv_cache_usage_perc (target pool): the fallback
    tasks: float | None  # completer_event_loop_tasks
    in_flight: float | None  # completer_requests_in_flight
    workers_up: float | None = None  # completer_prefill_workers_up (disaggregation)

    def kv_in_use(self) -> float | None:
        return sum(self.kv_blocks_used.values()) if self.kv_blocks_used is not None else self.kv_usage


class Sample(msgspec.Struct, array_like=True):
    t: float  # seconds since the load started
    rss_mb: float
    kv_in_use: float | None  # None: /metrics did not answer in time
    tasks: float | None
    in_flight: float | None


class Minute(msgspec.Struct):
    minute: int
    shown: int  # completions an editor would show (done, not cancelled)
    p50_ms: float | None
    p99_ms: float | None


class Fault(msgspec.Struct):
    kind: str  # "stop" (SIGSTOP, then SIGCONT at `until_s`) or "kill" (SIGKILL)
    at_s: float  # since the load started
    until_s: float  # SIGCONT sent (stop); the signal sent (kill)
    pid: int  # the worker signalled
    pid_after: int | None = None  # the worker serving afterwards (a new one after a kill)
    down_at_s: float | None = None  # the server first reported no worker up
    up_again_s: float | None = None  # a worker up again after `until_s`
    # Port -> outcomes of the requests sent from a little before the fault to a little after the worker was
    # back (soak.AROUND_FAULT_S)
    around: dict[str, dict[str, int]] = {}


class Memory(msgspec.Struct):
    """A process's resident memory by kind (MB), as /proc shows it."""

    at_s: float
    rss_mb: float
    anon_mb: float  # RssAnon: what malloc, torch and Python hold
    file_mb: float  # RssFile: mapped files (weights, libraries) paged in
    heap_mb: float  # the [heap] mapping (brk: the main arena)
    anon_maps_mb: float  # anonymous mappings (other arenas, large allocations, thread stacks)
    anon_maps: int  # how many
    threads: int


class PhaseSpan(msgspec.Struct):
    name: str
    start_s: float  # since the load started
    end_s: float  # typing stopped
    drain_s: float  # then the last answer came (or the drain window ended)
    fault: str = ""  # injected into the prefill worker in this phase


class IdleCheck(msgspec.Struct):
    """The server once a phase's clients had left."""

    after: str  # the phase
    kv_zero_s: float | None  # from the last client leaving to no KV block in use; None: not within the wait
    gauges: Gauges
    memory: Memory | None  # None: the server had exited
    probe: dict | None = None  # --memory-probe: the server's own figures (latency_bench/memory_probe/)


class Slowest(msgspec.Struct):
    waited_s: float  # frame sent (request written) to its terminal answer read, as the client saw it
    server_ms: float | None  # its `done.timings.total_ms`: the server's frame read to its done (None: not a done)
    outcome: str


class SoakResult(msgspec.Struct):
    date: str
    machine: Machine
    command: str
    kv: KvPlan
    editors: int
    duration_s: float
    sent: int
    outcomes: dict[str, int]  # done:REASON, error:CODE, unanswered, duplicate, after_terminal, abandoned, ...
    events: dict[str, int]  # what the editors did: keystrokes, bursts, disconnects, long files, ...
    server_closes: dict[str, int]  # "CODE REASON" as the editor received it -> connections the server closed
    drain_s: float
    # Full prompt blocks prefilled by requests that got a token: each published
    # new content, so more than kv.pool_blocks["target"] means the cache evicted.
    prompt_blocks_computed: int
    cache_hit_rate: float | None
    time_to_done: list[Minute]
    cancelled_p50_ms: float | None  # time to the `done` of a superseded or cancelled request
    cancelled_p99_ms: float | None
    p99_drift: float | None  # last minute's p99 / the first's
    rss_mb_after_warmup: float
    rss_mb_end: float
    rss_mb_max: float
    samples: list[Sample]
    baseline: Gauges
    after_drain: Gauges
    healthz_after: bool
    fresh_completion_after: str
    server_exit_code: int | None  # None: still serving at the end
    server_log_tail: list[str]
    # Issue #31's parts (absent from older results): the compat port's llama.vim-like clients, a prefill
    # worker stopped and killed, CPU-heavy processes beside, phases each ending idle.
    http_editors: int = 0
    by_port: dict[str, dict[str, int]] = {}  # "ws", "ws_long" (uncached long prompts), "http" -> outcomes
    sent_by_port: dict[str, int] = {}
    unanswered: int = 0  # every port's `unanswered`: must be 0
    slowest: dict[str, Slowest] = {}  # port -> the request that waited longest for its terminal answer
    disagg: bool = False
    prefill_routes: dict[str, int] = {}  # "route/reason" -> prompts (completer_prefill_decisions)
    faults: list[Fault] = []
    side_loads: str = ""  # what the CPU-heavy processes beside did
    phases: list[PhaseSpan] = []
    idle: list[IdleCheck] = []
    # Connections the server decided to close, by why, as its own metrics count them: "slow" (1008, a reader
    # server.send_queue_frames behind), "silent" (1011, nothing heard for 3 ping periods).
    server_disconnects: dict[str, int] = {}
    # Issue #48's (absent from older results): the editors' wait after a key (client_wait.py), the keys they
    # typed, requests sent per key, and the share of keys answered (first text, or an end) before the next.
    client_wait: str = "none"
    keys: int = 0
    requests_per_key: float | None = None
    served_before_next_key: float | None = None


class Phase(msgspec.Struct):
    editors: int
    requests: int
    p50_ms: float
    p99_ms: float
    outcomes: dict[str, int]
    deadline_share: float


class FairnessResult(msgspec.Struct):
    date: str
    machine: Machine
    command: str
    rounds: int
    requests_per_editor: int
    alone: Phase
    together: Phase
    p99_ratio: float
    aim: float = 3.0  # the issue's: 32 editors' p99 at most 3x one editor's


class RunRecord(msgspec.Struct):
    date: str
    machine: Machine
    command: str
    exit_codes: dict[str, int | None]  # None: not run


def machine() -> Machine:
    cpuinfo = Path("/proc/cpuinfo")
    models = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
              if ln.startswith("model name")] if cpuinfo.exists() else []

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return Machine(platform.platform(), models[0] if models else platform.processor(), psutil.cpu_count(),
                   round(psutil.virtual_memory().total / 2**30, 1), platform.python_version(),
                   git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain")),
                   [round(x, 1) for x in psutil.getloadavg()])


def write_result(path: Path, result: bytes | str | dict) -> None:
    """A benchmark's figures to `path` (its folder made): bytes and text as
    they are, a dict as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(result, bytes):
        path.write_bytes(result)
    else:
        path.write_text(result if isinstance(result, str) else json.dumps(result, indent=2) + "\n")


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


OWED = ("unanswered", "duplicate", "after_terminal", "unknown_id", "lost_on_server_close")
BROKEN_PREFIXES = ("not_json:", "no_answer:")  # the compat port's: an answer that is not one
KV_IDLE_S = 5.0  # KV back to 0 within this long of idle (issue #31)
RSS_TOLERANCE = 0.10  # RSS at the end within this share of the first idle after warm-up


def violations(r: SoakResult) -> list[str]:
    """The soak's invariants that did not hold (none: all did)."""
    out = []
    if r.server_exit_code is not None:
        out.append(f"the server exited (code {r.server_exit_code})")
    for port, outcomes in (r.by_port or {"ws": r.outcomes}).items():
        for name, n in sorted(outcomes.items()):
            if n and (name in OWED or name.startswith(BROKEN_PREFIXES)):
                out.append(f"{n} {name}" + (f" ({port})" if r.by_port else ""))
    if r.after_drain.kv_in_use() != r.baseline.kv_in_use():
        out.append(f"KV in use after the drain {r.after_drain.kv_in_use()}, baseline {r.baseline.kv_in_use()}")
    if r.after_drain.tasks != r.baseline.tasks:
        out.append(f"event loop tasks after the drain {r.after_drain.tasks}, baseline {r.baseline.tasks}")
    for check in r.idle:
        if check.kv_zero_s is None or check.kv_zero_s > KV_IDLE_S:
            out.append(f"KV not back to 0 within {KV_IDLE_S:g} s of idle after the {check.after} "
                       f"({'-' if check.kv_zero_s is None else check.kv_zero_s} s)")
    for fault in r.faults:
        if fault.up_again_s is None:
            out.append(f"no prefill worker up again after the {fault.kind} at {fault.at_s:g} s")
    if not r.healthz_after or not r.fresh_completion_after.startswith("done:"):
        out.append(f"afterwards: /healthz ok {r.healthz_after}, a fresh completion {r.fresh_completion_after}")
    return out


def rss_growth(r: SoakResult) -> float | None:
    """RSS at the last idle over the first idle after the warm-up, less 1."""
    mem = [c.memory for c in r.idle if c.memory is not None]
    return mem[-1].rss_mb / mem[0].rss_mb - 1 if len(mem) > 1 else None

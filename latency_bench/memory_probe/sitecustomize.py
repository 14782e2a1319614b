"""Loaded by a `completer serve` the soak starts with `--memory-probe`
(this directory first on its PYTHONPATH, $COMPLETER_MEMORY_PROBE naming a
file): on SIGUSR2 the server appends one JSON line to that file telling
where its memory is, to tell memory the allocator keeps from memory still in
use (a leak):

- `malloc`: glibc's mallinfo2 over every arena (bytes taken from the system
  by brk and mmap, in use, free inside the arenas), then RSS before and after
  an explicit malloc_trim(0): what trimming gives back is retention;
- `pymalloc`: Python's own small-object allocator (its arenas are mmapped,
  outside malloc's figures): arenas held, bytes in live blocks, bytes free
  in its pools and whole unused pools, from sys._debugmallocstats (which
  writes to fd 2: it is pointed at a file for that call, so a log line
  another thread writes in those milliseconds goes there too);
- `held`: what the service keeps between requests: its clients (a
  connection's, and the compatible routes' one shared by their HTTP
  clients), their documents' prompt state, the files their retrieval cut
  (windows, characters) and the windows' token counts kept with them;
- `objects`: live Python objects by type (the 15 most numerous), from gc;
  then `cycles`: what a full gc.collect() found unreachable (the objects
  above held only by reference cycles), and the retrieval windows before and after;
- `traced`: with $COMPLETER_TRACEMALLOC set (tracemalloc started at import:
  slower), the Python allocations' total and the 15 source lines that grew
  most since the first dump.

Nothing here runs until the signal; the server's own code is unchanged."""

import os
import sys

PATH = os.environ.get("COMPLETER_MEMORY_PROBE")


def _install() -> None:
    import ctypes
    import gc
    import json
    import signal
    import time
    from collections import Counter

    libc = ctypes.CDLL(None)

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                           "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is not None:
        mallinfo2.restype = Mallinfo2
    tracing = bool(os.environ.get("COMPLETER_TRACEMALLOC"))
    if tracing:
        import tracemalloc
        tracemalloc.start(1)
    first = []

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)

    def pymalloc_mb() -> dict:
        import re
        import tempfile
        with tempfile.TemporaryFile("w+") as f:
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(f.fileno(), 2)
            try:
                sys._debugmallocstats()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            f.seek(0)
            text = f.read()

        def figure(pattern: str) -> float:
            found = re.search(pattern + r"\s*=\s*([\d,]+)", text)
            return round(int(found.group(1).replace(",", "")) / 2**20, 1) if found else -1.0
        arenas = figure(r"\d+ arenas \* \d+ bytes/arena")
        if arenas < 0:
            return None  # not pymalloc's figures (tracemalloc hooks the allocator: it prints none)
        return {"arenas_mb": arenas, "blocks_in_use_mb": figure("# bytes in allocated blocks"),
                "blocks_free_mb": figure("# bytes in available blocks"),
                "unused_pools_mb": figure(r"\d+ unused pools \* \d+ bytes")}

    def held() -> dict | None:
        services = [o for o in gc.get_objects() if type(o).__name__ == "CompletionService"]
        if not services:
            return None
        clients = list(services[0].clients)
        documents = [d for c in clients for d in c.documents.values()]
        caches = {id(c.windows): c.windows for c in clients}.values()
        return {"clients": len(clients), "documents": len(documents),
                "window_files": sum(len(w._cut) for w in caches), "window_chars": sum(w._chars for w in caches),
                "windows": sum(len(cut) for w in caches for cut in w._cut.values()),
                "token_counts": sum(len(w._tokens) for w in caches)}

    def dump(*_) -> None:
        out = {"at": time.time()}
        if mallinfo2 is not None:
            m = mallinfo2()
            mb = lambda n: round(n / 2**20, 1)  # noqa: E731
            out["malloc"] = {"arena_mb": mb(m.arena), "mmapped_mb": mb(m.hblkhd), "in_use_mb": mb(m.uordblks),
                             "free_mb": mb(m.fordblks), "rss_mb_before_trim": rss_mb()}
            libc.malloc_trim(0)
            out["malloc"]["rss_mb_after_trim"] = rss_mb()
        out["pymalloc"] = pymalloc_mb()
        out["held"] = held()
        counts = Counter(type(o).__name__ for o in gc.get_objects())
        out["objects"] = {"total": sum(counts.values()), "top": dict(counts.most_common(15))}
        windows = counts.get("Window", 0)
        unreachable = gc.collect()
        out["cycles"] = {"unreachable": unreachable, "windows_before": windows,
                         "windows_after": sum(type(o).__name__ == "Window" for o in gc.get_objects())}
        if tracing:
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            out["traced_mb"] = round(sum(s.size for s in snapshot.statistics("filename")) / 2**20, 1)
            if not first:
                first.append(snapshot)
            out["grew"] = [f"{s.traceback[0].filename}:{s.traceback[0].lineno} {s.size_diff / 1024:+.0f} KB "
                           f"({s.count_diff:+d})" for s in snapshot.compare_to(first[0], "lineno")[:15]]
        with open(PATH, "a") as f:
            f.write(json.dumps(out) + "\n")

    signal.signal(signal.SIGUSR2, dump)


if PATH and "serve" in sys.argv[1:2]:
    _install()

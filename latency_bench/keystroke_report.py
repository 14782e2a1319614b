"""The keystroke replay's results as tables, plots and pages.

    python -m latency_bench keystroke-report [docs/results/keystroke_bench.json] [--no-docs]

From `keystroke_bench.py`'s JSON: one table (every row at every editor count,
ratios against `all_on`), the aims checked, two PNG plots beside the JSON
(TTFT CDFs per row at each editor count; p99 TTFT against editors), and, unless
`--no-docs`, BENCHMARKS.md's keystroke section, between marker comments; the
README links there and carries no dated figures. A newer run's section goes
first among BENCHMARKS.md's dated sections (the page is newest first); the
section it replaces moves, marked superseded, to the top of
docs/results/benchmarks_superseded.md (newest first too), its links made
relative to that folder and the plots the newer run overwrote left out.
Re-rendering the same run replaces its section where it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- keystroke-bench:start -->", "<!-- keystroke-bench:end -->"
BENCH = ROOT / "BENCHMARKS.md"
SUPERSEDED = ROOT / "docs" / "results" / "benchmarks_superseded.md"
SUPERSEDED_INTRO = """# Superseded benchmark runs

Runs that a newer run of the same benchmark replaced in [BENCHMARKS.md](../../BENCHMARKS.md), newest first,
each as it was measured; only its links are made relative to this folder. `python -m latency_bench
keystroke-report` moves the keystroke replay's section here when it writes a newer run's. Its JSON and plots
(`docs/results/keystroke_bench.json`, `docs/results/keystroke_bench/`) are overwritten by the next run's: a
section here names the JSON as it was written and does not link the plots.
"""
# A heading's date: `2026-12-03, 20:10`, `2026-12-05, 15:49-15:58`, `2026-12-05/06, 23:46-01:24`,
# `2026-11-29 to 2026-12-01`, `CPU, 2026-11-29, later run`; a range counts by its end.
WHEN = re.compile(r"(\d{4}-\d{2}-\d{2})(?:/(\d{2}))?(?: to (\d{4}-\d{2}-\d{2}))?(?:, (\d{2}:\d{2})(?:-(\d{2}:\d{2}))?)?")
IMAGE = re.compile(r"^!\[[^\]]*\]\(([^)\s]+)\)\n?", re.M)
LINK = re.compile(r"(\]\()([^)\s#][^)\s]*)(\))")


def fmt(v, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and unit == "%":
        return f"{100 * v:.1f}%"
    return f"{v:,.0f}{unit}" if isinstance(v, (int, float)) else str(v)


def per_key(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def both_finished(mine: dict, theirs: dict) -> tuple[float, float, int] | None:
    """Exact match of two runs on the keystrokes both finished a suggestion for."""
    a, b = mine.get("finished_sites"), theirs.get("finished_sites")
    if a is None or b is None:
        return None
    sites = a.keys() & b.keys()
    if not sites:
        return None
    return sum(a[k] for k in sites) / len(sites), sum(b[k] for k in sites) / len(sites), len(sites)


def both_answered(mine: dict, theirs: dict, key: str) -> str:
    """p50 / p99 of two runs' latencies (`ttft_sites` or `line_sites`) on the
    keystrokes both have a figure for: a keystroke one row never answered is
    left out of both, so neither wins by what it lacks."""
    from latency_bench.replay import percentile_ms

    a, b = mine.get(key), theirs.get(key)
    if a is None or b is None:
        return "-"
    sites = a.keys() & b.keys()
    figures = []
    for q in (0.5, 0.99):
        x, y = (percentile_ms([row[k] / 1000 for k in sites], q) for row in (a, b))  # (sites hold ms)
        figures.append(f"p{round(q * 100)} {fmt(x)} vs {fmt(y)} ms ({ratio(x, y)})")
    return ", ".join(figures) + f" (n {len(sites)})"


def served_count(r: dict) -> str:
    """' (served of keys a next key followed)', where the run counted them."""
    return f" ({r['served_n']:,} of {r['next_key_n']:,})" if "served_n" in r else ""


def diff(a, b, unit: str = " ms") -> str:
    return f"{a - b:+,.1f}{unit}" if a is not None and b is not None else "-"


def paired(mine: dict, theirs: dict, sites: set) -> str:
    """p50 and p99 of two {site: ms} on the same `sites`, with their difference."""
    from latency_bench.replay import percentile_ms

    parts = []
    for q in (0.5, 0.99):
        x, y = (percentile_ms([row[k] / 1000 for k in sites], q) for row in (mine, theirs))
        parts.append(f"p{round(q * 100)} {fmt(x)} vs {fmt(y)} ms ({diff(x, y)})")
    return ", ".join(parts) + f" (n {len(sites)})"


def bridge(result: dict) -> list[str]:
    """The LSP rows against the WebSocket's `all_on` (same server settings and
    prompts) at each editor count both ran: what the bridge costs. An LSP
    answer is whole, so its TTFT is its answer: beside the WebSocket's first
    streamed text (the issue's figure) it also pays for the rest of the line;
    beside the WebSocket's whole answer on the same keystrokes, the bridge alone."""
    rows = result["rows"]
    ws = rows.get("all_on", {}).get("runs", {})
    out = []
    for name, row in rows.items():
        if row.get("via") != "lsp":
            continue
        for n, r in row["runs"].items():
            if n not in ws:
                continue
            b = ws[n]
            p50 = None if r["ttft_p50_ms"] is None or b["ttft_p50_ms"] is None else r["ttft_p50_ms"] - b["ttft_p50_ms"]
            aim = "-" if p50 is None else ("met" if p50 <= 10 else "missed")
            # Keystrokes both answered with text: the LSP answer against the WebSocket's `done`.
            texts = r.get("ttft_sites", {}).keys() & b.get("ttft_sites", {}).keys() & b.get("line_sites", {}).keys()
            out += [
                f"- `{name}` (through `completer lsp`) minus `all_on` (the WebSocket) at {n} editor"
                f"{'s' if n != '1' else ''}:",
                f"  - TTFT p50 {fmt(r['ttft_p50_ms'])} vs {fmt(b['ttft_p50_ms'])} ms "
                f"({diff(r['ttft_p50_ms'], b['ttft_p50_ms'])}; aim within 10 ms: {aim}), p99 {fmt(r['ttft_p99_ms'])} "
                f"vs {fmt(b['ttft_p99_ms'])} ms ({diff(r['ttft_p99_ms'], b['ttft_p99_ms'])}), n {r['ttft_n']} vs "
                f"{b['ttft_n']}: an LSP answer is whole (its TTFT is the line's end; empty answers have none), "
                f"the WebSocket streams its first text before the line ends",
                f"  - served before next key {fmt(r['served_before_next_key'], '%')}{served_count(r)} vs "
                f"{fmt(b['served_before_next_key'], '%')}{served_count(b)} "
                f"({diff(100 * r['served_before_next_key'], 100 * b['served_before_next_key'], ' points')})",
                "  - the bridge alone, on the keystrokes both answered with text, the LSP answer vs the WebSocket's "
                "whole answer: " + (paired(r["ttft_sites"], b["line_sites"], texts) if texts else "-"),
                f"  - every whole answer (text or empty), end-to-end: p50 {fmt(r['e2e_p50_ms'])} vs "
                f"{fmt(b['e2e_p50_ms'])} ms ({diff(r['e2e_p50_ms'], b['e2e_p50_ms'])}), p99 {fmt(r['e2e_p99_ms'])} vs "
                f"{fmt(b['e2e_p99_ms'])} ms ({diff(r['e2e_p99_ms'], b['e2e_p99_ms'])}), n {r['e2e_n']} vs "
                f"{b['e2e_n']}; on the keystrokes both answered whole, " + both_answered(r, b, "line_sites")]
    return out


def table(result: dict) -> list[str]:
    rows = result["rows"]
    base = rows.get("all_on", {}).get("runs", {})
    out = ["| row | editors | keys | requests per key | served before next key | TTFT p50 / p90 / p99 (n) | line end-to-end p50 / p99 (n) "
           "| ITL p50 | exact match (n) | vs all_on, both finished (n) | cached share | accepted of shown "
           "| draft acceptance | errors | p99 TTFT vs all_on | p50 line vs all_on |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        for n, r in row["runs"].items():
            b = base.get(n, {})
            pair = both_finished(r, b) if name != "all_on" else None
            out.append(
                f"| {name} | {n} | {r['keystrokes']:,} | {per_key(r.get('requests_per_key'))} "
                f"| {fmt(r['served_before_next_key'], '%')}{served_count(r)} "
                f"| {fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p90_ms'])} / {fmt(r['ttft_p99_ms'])} ms "
                f"({r.get('ttft_n', '?')}) "
                f"| {fmt(r['e2e_p50_ms'])} / {fmt(r['e2e_p99_ms'])} ms ({r.get('e2e_n', '?')}) "
                f"| {fmt(r['itl_p50_ms'])} ms "
                f"| {fmt(r['exact_match'], '%')} ({r.get('exact_n', '?')}) "
                f"| {f'{100 * pair[0]:.1f}% vs {100 * pair[1]:.1f}% ({pair[2]})' if pair else '-'} "
                f"| {fmt(r['cached_share'], '%')} "
                f"| {fmt(r['accepted_share'], '%') if r['shown'] else '-'} of {r['shown']:,} "
                f"| {fmt(r.get('draft_acceptance'), '%')} | {r['errors']} "
                f"| {ratio(r['ttft_p99_ms'], b.get('ttft_p99_ms'))} | {ratio(r['e2e_p50_ms'], b.get('e2e_p50_ms'))} |")
    return out


def aims(result: dict) -> list[str]:
    """The issue's aims, each with the figures it was judged on."""
    rows = result["rows"]
    out = []
    on = rows.get("all_on", {}).get("runs", {})
    peers = {name: row["runs"] for name, row in rows.items() if row["kind"] != "completer"}
    if "1" in on:
        s = on["1"]["served_before_next_key"]
        theirs = {name: runs["1"]["served_before_next_key"] for name, runs in peers.items() if "1" in runs}
        beats = all(s > t for t in theirs.values()) and bool(theirs)
        if theirs:
            judged = (f"aim >= 90% and more than llama.cpp's: {'met' if s >= 0.9 and beats else 'missed'}; "
                      + "; ".join(f"{name} {100 * t:.1f}%" for name, t in theirs.items()))
        else:  # a run without llama.cpp rows is judged on what it measured
            judged = f"aim >= 90%: {'met' if s >= 0.9 else 'missed'}; no llama.cpp row in this run"
        out.append(f"- keystrokes answered (first token) before the next key at 1 editor: {100 * s:.1f}% "
                   f"({judged}; whole line: {100 * on['1']['whole_before_next_key']:.1f}%)")
    if "1" in on and "32" in on and on["1"]["ttft_p99_ms"] and on["32"]["ttft_p99_ms"]:
        r = on["32"]["ttft_p99_ms"] / on["1"]["ttft_p99_ms"]
        out.append(f"- p99 TTFT at 32 editors vs 1: {on['32']['ttft_p99_ms']:,.0f} vs {on['1']['ttft_p99_ms']:,.0f} ms, "
                   f"{r:.2f}x (aim <= 3x: {'met' if r <= 3 else 'missed'})")
    # The matched peer runs the weights at completer's precision (int4: the Q4_1 file itself).
    matched = rows.get("llama_matched") or (rows.get("llama_q4_1") if result["precision"] == "int4" else None)
    peer = (matched or {}).get("runs", {})
    for n, mine in on.items():
        if n not in peer:
            continue
        theirs = peer[n]
        parts, ahead = [], True
        for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                           ("e2e_p50_ms", "line p50"), ("e2e_p99_ms", "line p99")):
            a, b = mine.get(key), theirs.get(key)
            ahead &= a is not None and b is not None and a <= b  # a figure a row lacks is no win
            fastest = min((runs[n][key] for runs in peers.values() if n in runs and runs[n].get(key)), default=None)
            parts.append(f"{label} {fmt(a)} vs {fmt(b)} ms ({ratio(a, b)}; to llama.cpp's fastest row "
                         f"{ratio(a, fastest)})")
        parts.append("on the keystrokes both answered, TTFT " + both_answered(mine, theirs, "ttft_sites")
                     + "; on the lines both finished, line " + both_answered(mine, theirs, "line_sites"))
        verdict = "at or below" if ahead else "not at or below"
        if not theirs.get("completed") and not mine.get("completed"):
            verdict = "neither finished a suggestion"
        elif not theirs.get("completed"):
            verdict += " (llama.cpp finished no suggestion)"
        out.append(f"- {n} editor{'s' if n != '1' else ''}, completer vs llama.cpp at matched precision "
                   f"({result['precision']}): " + "; ".join(parts) + f": {verdict}")
    return out


def plots(result: dict, assets: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, editors = result["rows"], [str(n) for n in result["editors"]]
    fig, axes = plt.subplots(1, len(editors), figsize=(5 * len(editors), 4), squeeze=False)
    for ax, n in zip(axes[0], editors):
        for name, row in rows.items():
            ttft = row["runs"].get(n, {}).get("ttft_ms") or []
            if ttft:
                ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name,
                        linestyle="--" if row["kind"] != "completer" else "-")
        if ax.lines:  # a run that answered nothing in time (a loaded machine) plots empty, not log-scaled
            ax.set_xscale("log")
        ax.set_title(f"{n} editor{'s' if n != '1' else ''}")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("share of keystrokes answered within")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    cdf = assets / "ttft_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in rows.items():
        xs = [int(n) for n in editors if row["runs"].get(n, {}).get("ttft_p99_ms")]
        ax.plot(xs, [row["runs"][str(x)]["ttft_p99_ms"] for x in xs], marker="o", label=name,
                linestyle="--" if row["kind"] != "completer" else "-")
    if ax.lines and any(line.get_xdata().size for line in ax.lines):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xlabel("editors typing at once")
    ax.set_ylabel("p99 TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p99 = assets / "p99_vs_editors.png"
    fig.savefig(p99, dpi=100)
    plt.close(fig)
    return [cdf, p99]


def section(result: dict, json_path: Path, images: list[Path]) -> str:
    m = result["machine"]
    def rel(p: Path) -> str:  # as the pages link it (a run written elsewhere keeps its full path)
        p = p.resolve()
        return p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else str(p)

    peers = {r.get("gguf") for r in result["rows"].values() if r["kind"] != "completer"}
    through_lsp = bridge(result)
    # Said only of the run it comes from: which model, and llama.cpp only when it had rows.
    model = result.get("model", "default")
    served = "Default model" if model == "default" else f"Model {result.get('model_name', model)} (--model {model})"
    title = "every speed feature" + (", llama.cpp on the same weights" if peers else " (no llama.cpp rows)")
    lines = [
        f"## {result['date'][:10]}, {result['date'][11:16]}: keystroke replay, {title}",
        f"<!-- run {result['date']} -->",
        "",
        f"Machine: {m['cpu']}, {m['cores']} CPUs, {m['memory_gb']} GB, load average {m['load_average']} at the "
        f"start; commit {m['commit']}{' (with changes)' if m['uncommitted_changes'] else ''}. {served}, precision "
        f"{result['precision']} (what `auto` picks here), window {result['context_tokens']} tokens. "
        f"Corpus: {result['corpus']}. {result['seconds']:.0f} s of typing per editor count, "
        f"{result.get('wall_s', 0) / 60:.1f} min in all.",
        "",
        "Command: `" + " ".join(["python", "-m", "latency_bench", "keystroke", *result["command"][1:]]) + "`; "
        f"JSON: `{rel(json_path)}`" + (f"; llama.cpp {next((r['version'] for r in result['rows'].values() if r['kind'] != 'completer'), '')} "
                                        f"on {', '.join(sorted(p for p in peers if p))}" if peers else "") + ".",
        "",
        "Latencies are the editors' own (frame sent to first text, to the end of the line); 'served before next "
        "key' counts a keystroke whose first text (or empty answer) came before the editor's next key; exact "
        "match compares each finished suggestion with the rest of the real line; 'accepted' is the share of "
        "suggestions shown in time that the next keys typed.",
        "",
        *table(result),
        "",
        "Aims:",
        "",
        *aims(result),
        "",
        *(["The LSP bridge:", "", *through_lsp, ""] if through_lsp else []),
        *[f"![{p.stem}]({rel(p)})" for p in images],
        "",
    ]
    return "\n".join(lines)


def replace_between(text: str, start: str, end: str, new: str) -> tuple[str, str | None]:
    """`text` with what is between the markers replaced (added after the title if absent); the old part."""
    m = re.search(re.escape(start) + r"\n(.*?)" + re.escape(end) + r"\n?", text, flags=re.S)
    block = f"{start}\n{new}{end}\n"
    if m:
        return text[: m.start()] + block + text[m.end():], m.group(1)
    first = text.find("\n## ")
    return (text[: first + 1] + block + "\n" + text[first + 1:] if first >= 0 else text + "\n" + block), None


def render(json_path: Path, write_docs: bool = True) -> str:
    result = json.loads(json_path.read_text())
    assets = json_path.with_suffix("")
    assets.mkdir(parents=True, exist_ok=True)
    images = plots(result, assets)
    shot = assets / "dashboard.png"
    if shot.is_file():
        images.append(shot)
    text = section(result, json_path, images)
    print(text)
    if write_docs:
        superseded = SUPERSEDED.read_text() if SUPERSEDED.exists() else SUPERSEDED_INTRO
        page, superseded = write_pages(BENCH.read_text(), superseded, text, result["date"])
        BENCH.write_text(page)
        SUPERSEDED.write_text(superseded)
    return text


# -- BENCHMARKS.md: newest first, superseded runs in docs/results/ ------------------------------------

def sections(text: str) -> tuple[str, list[str]]:
    """A page split before each `## ` heading outside code blocks (the start
    marker on the line before a heading goes with it): the intro, the sections."""
    lines = text.splitlines(keepends=True)
    starts, fence = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("## "):
            starts.append(i - 1 if i and lines[i - 1].rstrip("\n") == START else i)
    bounds = [*starts, len(lines)]
    return "".join(lines[:bounds[0]]), ["".join(lines[a:b]) for a, b in zip(bounds, bounds[1:])]


def join(intro: str, parts: list[str]) -> str:
    """`sections` undone, one blank line between sections."""
    return intro.rstrip("\n") + "\n\n" + "\n\n".join(s.rstrip("\n") for s in parts) + "\n"


def heading(section: str) -> str:
    return re.search(r"^## (.*)$", section, re.M).group(1)


def when(title: str) -> tuple[str, str | None] | None:
    """A heading's date and time (None: it names no date), a range by its end."""
    m = WHEN.search(title)
    if not m:
        return None
    date, day, to, start, end = m.groups()
    return (to or (date[:8] + day if day else date)), end or start


def newer(a: tuple[str, str | None], b: tuple[str, str | None]) -> bool:
    """`a` after `b`: a later day, or the same day at a later time (a time only where both give one)."""
    return a[0] > b[0] or (a[0] == b[0] and a[1] is not None and b[1] is not None and a[1] > b[1])


def out_of_order(text: str) -> list[tuple[str, str]]:
    """(heading, a heading above it that is older) for a page meant newest first."""
    titles = [heading(s) for s in sections(text)[1]]
    dated = [(t, w) for t in titles if (w := when(t)) is not None]
    return [(t, u) for i, (u, wu) in enumerate(dated) for t, wt in dated[i + 1:] if newer(wt, wu)]


def superseded_copy(old: str, new: str, date: str) -> str:
    """The replaced section as docs/results/benchmarks_superseded.md holds it:
    marked, the images the newer section links (the same files, overwritten)
    left out, its other links relative to that page."""
    old = re.sub(r"^## (.*)$", rf"## \1 (superseded by the run of {date})", old, count=1, flags=re.M)
    taken = set(IMAGE.findall(new))
    old = IMAGE.sub(lambda m: "" if m.group(1) in taken else m.group(0), old)

    def rebase(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"[a-z]+:|/", target):
            return m.group(0)
        return m.group(1) + Path(os.path.relpath(ROOT / target, SUPERSEDED.parent)).as_posix() + m.group(3)

    return LINK.sub(rebase, old).rstrip("\n") + "\n"


def write_pages(bench: str, superseded: str, new: str, run_date: str) -> tuple[str, str]:
    """BENCHMARKS.md and the superseded runs' page once `new` (the keystroke
    section of the run of `run_date`) is written: the same run's section
    replaced where it is; a newer run's first among the sections, the one it
    replaces on top of the superseded page."""
    page, old = replace_between(bench, START, END, new)
    if old and f"<!-- run {run_date} -->" not in old:
        intro, parts = sections(page)
        block = next(s for s in parts if s.startswith(START))
        page = join(intro, [block, *(s for s in parts if s is not block)])
        date = f"{run_date[:10]}, {run_date[11:16]}"
        intro, parts = sections(superseded)
        superseded = join(intro, [superseded_copy(old, new, date), *parts])
    return page, superseded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="?", type=Path, default=ROOT / "docs/results/keystroke_bench.json")
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    render(a.json, write_docs=not a.no_docs)


if __name__ == "__main__":
    sys.exit(main())

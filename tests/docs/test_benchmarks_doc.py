"""BENCHMARKS.md is newest first and holds each benchmark's current run only
(issue #47: docs drift): runs a newer run replaced are in
docs/results/benchmarks_superseded.md, where keystroke_report.py moves the
keystroke replay's section when it writes a newer run's."""

import re

from latency_bench import keystroke_report as kr
from latency_bench.harness import ROOT

LINK = re.compile(r"\]\(([^)\s#][^)\s]*)\)")


def test_benchmarks_md_is_newest_first_every_section_dated():
    text = kr.BENCH.read_text()
    titles = [kr.heading(s) for s in kr.sections(text)[1]]
    assert len(titles) > 20
    undated = [t for t in titles if kr.when(t) is None]
    assert not undated, f"BENCHMARKS.md sections without a date in their heading: {undated}"
    assert not kr.out_of_order(text), f"BENCHMARKS.md is not newest first (newer, above it): {kr.out_of_order(text)}"
    assert not kr.out_of_order(kr.SUPERSEDED.read_text())


def test_benchmarks_md_holds_no_superseded_copy():
    text = kr.BENCH.read_text()
    marked = [t for t in (kr.heading(s) for s in kr.sections(text)[1]) if "superseded" in t.lower()]
    assert not marked, f"superseded runs belong in docs/results/benchmarks_superseded.md: {marked}"
    assert text.count(kr.START) == text.count(kr.END) == 1
    assert len(re.findall(r"^<!-- run ", text, re.M)) == 1, "one keystroke replay section, the newest run's"
    assert "(docs/results/benchmarks_superseded.md)" in text
    old = kr.sections(kr.SUPERSEDED.read_text())[1]
    assert old and all("(superseded by the run of " in kr.heading(s) for s in old)


def test_the_links_of_both_pages_resolve():
    for page in (kr.BENCH, kr.SUPERSEDED):
        broken = [t for t in LINK.findall(page.read_text())
                  if not re.match(r"[a-z]+:", t) and not (page.parent / t).exists()]
        assert not broken, f"{page.relative_to(ROOT)} links what does not exist: {broken}"


def test_the_order_check_sees_a_section_out_of_place():
    page = "# B\n\n## 2026-12-03, 07:00: a\n\n## 2026-12-03: b\n\n## 2026-12-03, 08:00-08:10: c\n"
    assert kr.out_of_order(page) == [("2026-12-03, 08:00-08:10: c", "2026-12-03, 07:00: a")]
    assert kr.when("2026-12-05/06, 23:46-01:24: x") == ("2026-12-06", "01:24")
    assert kr.when("2026-11-29 to 2026-12-01: x") == ("2026-12-01", None)
    assert kr.when("CPU, 2026-11-29, later run") == ("2026-11-29", None)
    assert not kr.out_of_order("# B\n\n## 2026-12-01, evening: a\n\n## 2026-12-01, 20:08: b\n\n## 2026-12-01: c\n")


def keystroke(date: str, figure: str, images: str = "docs/results/keystroke_bench") -> str:
    return (f"## {date[:10]}, {date[11:16]}: keystroke replay\n<!-- run {date} -->\n\n| p50 | {figure} |\n\n"
            f"JSON: [json](docs/results/keystroke_bench.json)\n\n![ttft_cdf]({images}/ttft_cdf.png)\n")


def test_a_newer_run_goes_first_and_the_one_it_replaces_to_the_superseded_page():
    first, second = "2026-12-03T20:10:51+00:00", "2026-12-07T09:30:00+00:00"
    bench = ("# Benchmarks\n\nNewest first.\n\n## 2026-12-06, 08:21: other\n\ntext\n\n"
             f"{kr.START}\n{keystroke(first, '16 ms')}{kr.END}\n\n## 2026-12-01: older\n\nmore\n")
    page, superseded = kr.write_pages(bench, kr.SUPERSEDED_INTRO, keystroke(first, "17 ms"), first)
    assert superseded == kr.SUPERSEDED_INTRO and "17 ms" in page and "16 ms" not in page  # the same run: in place
    assert page.index("## 2026-12-06") < page.index(kr.START)

    page, superseded = kr.write_pages(page, superseded, keystroke(second, "12 ms"), second)
    titles = [kr.heading(s) for s in kr.sections(page)[1]]
    assert titles == ["2026-12-07, 09:30: keystroke replay", "2026-12-06, 08:21: other", "2026-12-01: older"]
    assert page.startswith("# Benchmarks\n\nNewest first.\n\n" + kr.START) and "17 ms" not in page
    assert page.count("<!-- run ") == 1 and not kr.out_of_order(page)
    intro, old = kr.sections(superseded)
    assert intro.rstrip() == kr.SUPERSEDED_INTRO.rstrip() and len(old) == 1
    assert kr.heading(old[0]) == "2026-12-03, 20:10: keystroke replay (superseded by the run of 2026-12-07, 09:30)"
    assert "| p50 | 17 ms |" in old[0]  # the figures as measured
    assert "ttft_cdf.png" not in old[0]  # the newer run overwrote that plot
    assert "[json](keystroke_bench.json)" in old[0]  # links relative to docs/results/

    third = "2026-12-08T10:00:00+00:00"
    page, superseded = kr.write_pages(page, superseded, keystroke(third, "11 ms", "docs/results/elsewhere"), third)
    old = kr.sections(superseded)[1]
    assert [kr.heading(s)[:17] for s in old] == ["2026-12-07, 09:30", "2026-12-03, 20:10"]
    assert "![ttft_cdf](keystroke_bench/ttft_cdf.png)" in old[0]  # not overwritten: kept, relative
    assert not kr.out_of_order(superseded)


def test_a_first_run_goes_before_every_section():
    date = "2026-12-07T09:30:00+00:00"
    page, superseded = kr.write_pages("# Benchmarks\n\nIntro.\n\n## 2026-12-06: other\n\ntext\n",
                                      kr.SUPERSEDED_INTRO, keystroke(date, "12 ms"), date)
    assert [kr.heading(s) for s in kr.sections(page)[1]] == ["2026-12-07, 09:30: keystroke replay", "2026-12-06: other"]
    assert superseded == kr.SUPERSEDED_INTRO

"""The dashboard in real headless Chromium, driven over the DevTools protocol:
opened with the token while traffic runs, it keeps updating, and its TTFT p99
tile and series show /v1/stats' figures (a screenshot goes to test-artifacts/);
opened without it, or with a wrong one, it shows no figures and says how to
open it."""

import asyncio
import base64
import json

import pytest

from support.devtools import CHROMIUM, chromium, wait_for
from latency_bench.harness import ROOT, TOKEN, collect, complete_msg, connect, running_server

ARTIFACTS = ROOT / "test-artifacts"


async def traffic(server, stop):
    async with connect(server) as ws:
        i = 0
        while not stop.is_set():
            await ws.send(complete_msg(f"t{i}", "def f(x):\n    return x" + "+1" * (i % 5),
                                       mode="free", max_tokens=4))
            await collect(ws, f"t{i}")
            i += 1


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
async def test_dashboard_shows_updating_p99(server):
    stop = asyncio.Event()
    load = asyncio.create_task(traffic(server, stop))
    try:
        async with chromium() as open_page:
            page = await open_page(f"{server.http}/dashboard?token={TOKEN}")
            refreshed = await wait_for(page, "Number(document.body?.dataset.updates || 0) >= 4")
            seen = [int(x) for x in (await page.evaluate("document.body.dataset.requests")).split(",")]
            stop.set()
            await load  # the traffic is over: what the page shows and /v1/stats hold still
            shown = await shown_with_stats(page)
            shot = await page.call("Page.captureScreenshot", format="png")
    finally:
        stop.set()
        await load
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "dashboard.png").write_bytes(base64.b64decode(shot["data"]))
    assert refreshed, "the page stopped refreshing"
    assert seen[-1] > seen[0], f"request counts did not move: {seen}"
    stats = shown["stats"]
    # The tile: the chosen window's TTFT p99, in ms to a tenth.
    want = stats["windows"][shown["window"]]["ttft_ms"]["p99"]
    assert want is not None and shown["tile"].endswith(" ms"), shown["tile"]
    assert abs(float(shown["tile"].removesuffix(" ms")) - want) <= 0.05 + 1e-9, (shown["tile"], want)
    # The series: one point per step of /v1/stats' series with a TTFT p99, oldest first, each
    # drawn at its value's height on the chart's scale (chart() in dashboard.html: 0 at y 162,
    # the largest of the chart's p50/p95/p99 values, or 1 ms, at y 6; a tenth of a pixel).
    values = [step["ttft_ms"]["p99"] for step in stats["series"] if step["ttft_ms"]["p99"] is not None]
    top = max([1.0] + [step["ttft_ms"][q] or 0 for step in stats["series"] for q in ("p50", "p95", "p99")])
    assert shown["p99"], "no p99 series drawn"
    points = [tuple(map(float, point.split(","))) for point in shown["p99"].split()]
    assert len(points) == len(values) > 0, (shown["p99"], values)
    xs = [x for x, _ in points]
    assert xs == sorted(xs) and 40 <= xs[0] and xs[-1] <= 396, xs
    for (_, y), v in zip(points, values):
        assert abs(y - (162 - 156 * v / top)) <= 0.06, (y, v, top)


async def shown_with_stats(page, tries: int = 5) -> dict:
    """The window chosen, the TTFT p99 tile and series as the page shows them
    after a refresh, and /v1/stats as the page fetches it now: the page's last
    refresh saw the same figures (as many requests as now: one that ended
    just before it may be counted after; then the next refresh is taken)."""
    for _ in range(tries):
        updates = int(await page.evaluate("document.body.dataset.updates"))
        assert await wait_for(page, f"Number(document.body.dataset.updates) > {updates}"), "no refresh"
        shown = await page.evaluate(f"""(async () => ({{
            window: document.getElementById("window").value,
            requests: Number(document.body.dataset.requests.split(",").pop()),
            tile: document.querySelector('[data-tile="TTFT p99"]').textContent,
            p99: document.querySelector("[data-series=ttft-p99]")?.getAttribute("points"),
            stats: await (await fetch("/v1/stats", {{cache: "no-store",
                                                     headers: {{Authorization: "Bearer " + {json.dumps(TOKEN)}}}}}))
                         .json(),
        }}))()""", await_promise=True)
        if shown["requests"] == shown["stats"]["windows"]["15m"]["requests"]:
            return shown
    raise AssertionError(f"the page's figures never caught up with /v1/stats: {shown['requests']} requests, "
                         f"{shown['stats']['windows']['15m']['requests']}")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
async def test_dashboard_without_the_token_shows_no_figures_and_says_how_to_open_it(server):
    async with chromium() as open_page:
        for address, auth in ((f"{server.http}/dashboard", "missing"),
                              (f"{server.http}/dashboard?token=wrong", "refused")):
            page = await open_page(address)
            seen = await wait_for(page, "document.body?.dataset.auth", tries=20)
            notice = await page.evaluate("document.getElementById('notice').textContent")
            tiles = await page.evaluate("document.querySelectorAll('[data-tile]').length")
            assert seen == auth, f"{address}: the page did not report the token {auth}"
            assert f"{server.http}/dashboard?token=" in notice, notice
            assert tiles == 0, f"{address}: figures shown without the token"

"""The dashboard in real headless Chromium, driven over the DevTools protocol:
opened with the token while traffic runs, the p99 series is drawn and keeps
updating (a screenshot goes to test-artifacts/); opened without it, or with a
wrong one, it shows no figures and says how to open it."""

import asyncio
import base64

import pytest

from devtools import CHROMIUM, chromium, wait_for
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
            p99 = await page.evaluate("document.querySelector('[data-series=ttft-p99]')?.getAttribute('points')")
            tile = await page.evaluate("document.querySelector('[data-tile=\"TTFT p99\"]').textContent")
            shot = await page.call("Page.captureScreenshot", format="png")
    finally:
        stop.set()
        await load
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "dashboard.png").write_bytes(base64.b64decode(shot["data"]))
    assert refreshed, "the page stopped refreshing"
    assert seen[-1] > seen[0], f"request counts did not move: {seen}"
    assert p99 and len(p99.split()) >= 1, "no p99 series drawn"
    assert tile.endswith(" ms")


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

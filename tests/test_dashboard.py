"""The dashboard in real headless Chromium, driven over the DevTools protocol:
opened with the token while traffic runs, the p99 series is drawn and keeps
updating (a screenshot goes to test-artifacts/); opened without it, or with a
wrong one, it shows no figures and says how to open it."""

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import websockets

from server_harness import ROOT, TOKEN, collect, complete_msg, connect, running_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = ROOT / "test-artifacts"


class DevTools:
    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    async def call(self, method, **params):
        self.next_id += 1
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                return msg["result"]

    async def evaluate(self, expression):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


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


@asynccontextmanager
async def chromium():
    """Headless Chromium on a scratch profile; yields `open(url) -> DevTools` of a new page."""
    # Chromium's helper processes may still write the profile after the browser
    # exits; the scratch profile's cleanup must not fail the test.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        browser = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--window-size=1280,1000", "--remote-debugging-port=0", "about:blank"],
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            url = None
            while url is None:
                line = await asyncio.to_thread(browser.stderr.readline)
                assert line, "chromium exited"
                if m := re.search(r"DevTools listening on (ws://\S+)", line):
                    url = m.group(1)
            async with AsyncExitStack() as pages:
                async def open_page(page_url: str) -> DevTools:
                    async with websockets.connect(url, max_size=None) as browser_ws:
                        target = await DevTools(browser_ws).call("Target.createTarget", url=page_url)
                    ws_url = url.split("/devtools/")[0] + f"/devtools/page/{target['targetId']}"
                    return DevTools(await pages.enter_async_context(websockets.connect(ws_url, max_size=None)))

                yield open_page
        finally:
            os.killpg(browser.pid, signal.SIGTERM)  # the browser and its helpers
            browser.wait(timeout=20)


async def wait_for(page: DevTools, expression: str, tries: int = 100):
    """The value of `expression` once truthy (real time: the page polls every 2 s)."""
    for _ in range(tries):
        if value := await page.evaluate(expression):
            return value
        await asyncio.sleep(0.5)
    return await page.evaluate(expression)


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

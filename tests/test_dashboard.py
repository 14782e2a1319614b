"""The dashboard in real headless Chromium, driven over the DevTools protocol,
while traffic runs: the p99 series is drawn and keeps updating. Saves a
screenshot under test-artifacts/."""

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile

import pytest
import websockets

from server_harness import ROOT, collect, complete_msg, connect, running_server

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


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
async def test_dashboard_shows_updating_p99():
    # Chromium's helper processes may still write the profile after the browser
    # exits; the scratch profile's cleanup must not fail the test.
    with running_server() as server, tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        stop = asyncio.Event()
        load = asyncio.create_task(traffic(server, stop))
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
            async with websockets.connect(url, max_size=None) as browser_ws:
                root = DevTools(browser_ws)
                target = await root.call("Target.createTarget", url=f"{server.http}/dashboard")
            page_url = url.split("/devtools/")[0] + f"/devtools/page/{target['targetId']}"
            async with websockets.connect(page_url, max_size=None) as page_ws:
                page = DevTools(page_ws)
                for _ in range(100):  # real time: the page polls every 2 s
                    updates = await page.evaluate("Number(document.body?.dataset.updates || 0)")
                    if updates >= 4:
                        break
                    await asyncio.sleep(0.5)
                seen = [int(x) for x in (await page.evaluate("document.body.dataset.requests")).split(",")]
                p99 = await page.evaluate(
                    "document.querySelector('[data-series=ttft-p99]')?.getAttribute('points')")
                tile = await page.evaluate("document.querySelector('[data-tile=\"TTFT p99\"]').textContent")
                shot = await page.call("Page.captureScreenshot", format="png")
            ARTIFACTS.mkdir(exist_ok=True)
            (ARTIFACTS / "dashboard.png").write_bytes(base64.b64decode(shot["data"]))
        finally:
            stop.set()
            await load
            os.killpg(browser.pid, signal.SIGTERM)  # the browser and its helpers
            browser.wait(timeout=20)
        assert updates >= 4, "the page stopped refreshing"
        assert seen[-1] > seen[0], f"request counts did not move: {seen}"
        assert p99 and len(p99.split()) >= 1, "no p99 series drawn"
        assert tile.endswith(" ms")

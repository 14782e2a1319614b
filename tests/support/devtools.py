"""Headless Chromium (the system's: Debian's `chromium`) driven over the
DevTools protocol, for the tests that look at a real page: the dashboard
(test_dashboard.py) and VS Code's workbench in code-server
(test_vscode_workbench.py)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from contextlib import AsyncExitStack, asynccontextmanager

import websockets

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Input.dispatchKeyEvent's fields of the keys the tests press: key, code, Windows virtual key
# code, and the text the key types (Enter's "\r": an editor inserts its line break on that).
KEYS = {
    "Tab": ("Tab", "Tab", 9, ""),
    "Enter": ("Enter", "Enter", 13, "\r"),
    "Escape": ("Escape", "Escape", 27, ""),
    "Backspace": ("Backspace", "Backspace", 8, ""),
    "End": ("End", "End", 35, ""),
    "Home": ("Home", "Home", 36, ""),
    "p": ("p", "KeyP", 80, ""),
    "Space": (" ", "Space", 32, ""),  # only with Ctrl here (Ctrl+Space: the suggest widget)
}
CTRL = 2  # Input.dispatchKeyEvent's modifiers bit


class DevTools:
    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    async def call(self, method, timeout: float = 120, **params):
        """`method`'s result; fails after `timeout` s without one (a page that stopped answering)."""
        self.next_id += 1
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        try:
            async with asyncio.timeout(timeout):
                while True:
                    msg = json.loads(await self.ws.recv())
                    if msg.get("id") == self.next_id:
                        if "error" in msg:
                            raise RuntimeError(msg["error"])
                        return msg["result"]
        except TimeoutError:
            raise AssertionError(f"no answer to {method} {json.dumps(params)[:300]} in {timeout:.0f} s") from None

    async def evaluate(self, expression, await_promise: bool = False):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=await_promise)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:200]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def press(self, name: str, modifiers: int = 0) -> None:
        """One key down and up (with the text it types, if any)."""
        key, code, vk, text = KEYS[name]
        text = "" if modifiers else text
        down = {"type": "keyDown", "text": text, "unmodifiedText": text} if text else {"type": "rawKeyDown"}
        for event in (down, {"type": "keyUp"}):
            await self.call("Input.dispatchKeyEvent", key=key, code=code, windowsVirtualKeyCode=vk,
                            nativeVirtualKeyCode=vk, modifiers=modifiers, **event)

    async def type(self, text: str) -> None:
        """`text` as typed input (Input.insertText, as an input method commits it)."""
        await self.call("Input.insertText", text=text)


@asynccontextmanager
async def chromium(window: str = "1280,1000"):
    """Headless Chromium on a scratch profile; yields `open(url) -> DevTools` of a new page."""
    # Chromium's helper processes may still write the profile after the browser
    # exits; the scratch profile's cleanup must not fail the test.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        browser = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             # a page in the background (none here) must not have its timers throttled
             "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
             f"--user-data-dir={profile}", f"--window-size={window}", "--remote-debugging-port=0", "about:blank"],
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


async def wait_for(page: DevTools, expression: str, tries: int = 100, every: float = 0.5):
    """The value of `expression` once truthy, else its last value after `tries` polls `every` seconds apart."""
    for _ in range(tries):
        if value := await page.evaluate(expression):
            return value
        await asyncio.sleep(every)
    return await page.evaluate(expression)

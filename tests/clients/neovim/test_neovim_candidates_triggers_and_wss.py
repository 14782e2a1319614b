"""The Neovim plugin, in a real headless Neovim (Debian's 0.7 and
a modern build) against the real `completer serve`: cycling through
candidates, blink.cmp's menu, Tab inside a snippet, the manual trigger and the
snooze, wss:// with certificate checks, and files git ignores."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from latency_bench.nvim_editor import free_port, keys, server_on, wait_until
from latency_bench.harness import ROOT, TOKEN
from support.neovim import (SETTINGS, capture, expand, idle, lua_current, needs_nvim, no_errors, result_of, sent,
                            settle, setup, start_typing, status, type_until_completion)

pytestmark = needs_nvim


def unique(texts: list[str]) -> list[str]:
    out = []
    for t in texts:
        if t and t not in out:
            out.append(t)
    return out


# -- 1. Cycling through candidates ---------------------------------------------------------


def test_cycle_asks_for_candidates_and_shows_i_of_n(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16, prime=False, speculative=False)
    capture(editor)
    start_typing(editor, tmp_path / "cyc.py")
    for attempt in ("retur", "x = ", "print(", "if o"):
        cur = type_until_completion(editor, attempt)
        idle(editor)
        n0 = len(sent(editor))
        assert editor.ghost()["counter"] is None  # no cycle yet: no "i/N", and no `n` asked for
        assert all("n" not in m for m in sent(editor) if m["type"] == "complete" and m["id"] == cur["id"])
        before = editor.buffer_text()
        editor.nvim.input("<M-]>")
        ask = wait_until(lambda: next((m for m in sent(editor)[n0:] if m.get("n")), None), 5,
                         what="the cycle's request")
        assert ask["n"] == 4 and ask["supersede"] is False and ask["document"]["prefix"].endswith(before[-3:])
        done = result_of(editor, ask["id"])
        assert done["type"] == "done"
        own = [done["text"], *(done.get("candidates") or [])]  # the cycle's texts: candidate 0, 1, ...
        texts = unique([cur["text"], *own])
        now = wait_until(lambda: (c := lua_current(editor)) and c.get("count") and c, 5, what="the cycle")
        count = now["count"]
        if count < 2:  # the server had none to add this time (it may not): the counter says 1/1
            assert editor.ghost()["counter"] == " 1/1" and editor.ghost()["text"] == expand(cur["text"])
            editor.nvim.input("<Esc>A")
            continue
        assert count == len(texts) and now["index"] == 2, (now, texts)
        shown = editor.ghost()
        assert shown["text"] == expand(texts[1]) and shown["counter"] == f" 2/{count}"
        assert editor.buffer_text() == before  # cycling inserts nothing
        editor.nvim.input("<M-[>")
        wait_until(lambda: (editor.ghost() or {}).get("counter") == f" 1/{count}", 5, what="the previous one")
        assert editor.ghost()["text"] == expand(texts[0])
        editor.nvim.input("<M-[>")  # wraps around to the last
        wait_until(lambda: (editor.ghost() or {}).get("counter") == f" {count}/{count}", 5, what="wrap around")
        assert editor.ghost()["text"] == expand(texts[-1])
        editor.nvim.input("<M-]>")  # and forward again, to the first, then the second
        wait_until(lambda: (editor.ghost() or {}).get("counter") == f" 1/{count}", 5, what="back to the first")
        editor.nvim.input("<M-]>")
        wait_until(lambda: (editor.ghost() or {}).get("counter") == f" 2/{count}", 5, what="the second")
        assert len([m for m in sent(editor)[n0:] if m.get("n")]) == 1  # asked once
        editor.nvim.input("<Tab>")
        wait_until(lambda: editor.buffer_text() == before + texts[1], 5, what="accepting the candidate")
        # The feedback: the cycle's request, with the index of the text kept among its own;
        # the first completion shown and not kept.
        fb = wait_until(lambda: {m["id"]: m for m in sent(editor, "feedback")}.get(ask["id"]), 5, what="feedback")
        assert fb["candidate"] == own.index(texts[1]) and fb["accepted_chars"] == len(texts[1]) and fb["shown"]
        first = {m["id"]: m for m in sent(editor, "feedback")}[cur["id"]]
        assert first["accepted_chars"] == 0 and first["shown"] is True
        return
    pytest.fail("the server offered no candidate in any attempt")


def test_cycle_with_nothing_shown_asks_here_with_candidates(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16, trigger="manual")
    capture(editor)
    start_typing(editor, tmp_path / "cyc0.py")
    editor.nvim.input(keys("retur"))
    time.sleep(0.5)
    assert sent(editor) == [] and editor.ghost() is None
    editor.nvim.input("<M-]>")
    ask = wait_until(lambda: next(iter(sent(editor)), None), 5, what="a request")
    assert ask["n"] == 4 and "supersede" not in ask
    result_of(editor, ask["id"])
    cur = lua_current(editor)
    if cur and cur["text"]:
        assert editor.ghost()["text"] == expand(cur["text"]) and editor.ghost()["counter"] == f" 1/{cur['count']}"
    # candidates = 1: the keys ask without `n`, and never cycle.
    setup(editor, server, mode="line", max_tokens=16, trigger="manual", candidates=1)
    capture(editor)
    editor.nvim.input("<M-]>")
    ask = wait_until(lambda: next(iter(sent(editor)), None), 5, what="a request")
    assert "n" not in ask


# -- 2. blink.cmp ----------------------------------------------------------------------


# blink.cmp cannot be installed here (it is on GitHub only; this machine reaches PyPI,
# npm and Debian, none of which carries it), so the test stands in the two things of it
# the plugin uses: the module's is_visible() and its User events BlinkCmpMenuOpen/Close.
FAKE_BLINK = """
_G.blink_open = false
package.loaded['blink.cmp'] = { is_visible = function() return _G.blink_open end }
"""


def test_blink_cmp_menu_hides_ghost_text_and_keeps_tab(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16)
    editor.lua(FAKE_BLINK)
    start_typing(editor, tmp_path / "blink.py")
    cur = type_until_completion(editor, "retur")
    shown = editor.ghost()
    editor.lua("_G.blink_open = true; vim.cmd('doautocmd <nomodeline> User BlinkCmpMenuOpen')")
    wait_until(lambda: editor.ghost() is None, 5, what="ghost text hidden under blink's menu")
    assert not editor.lua("return require('completer').visible()")
    editor.lua("_G.blink_open = false; vim.cmd('doautocmd <nomodeline> User BlinkCmpMenuClose')")
    wait_until(lambda: editor.ghost() is not None, 5, what="ghost text back")
    assert editor.ghost()["text"] == shown["text"]
    # The menu open (is_visible), no event: <Tab> is the menu's, not an accept.
    editor.lua("_G.blink_open = true")
    before = editor.buffer_text()
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.buffer_text() != before, 5, what="the key's own action")
    assert editor.buffer_text() == before + "\t" and cur["text"] not in editor.buffer_text()[len(before):]
    # A completion arriving while the menu is open is not drawn.
    for ch in "x = o":
        editor.nvim.input(keys(ch))
        settle(editor)
        assert editor.ghost() is None


# -- 3. Tab inside a snippet -----------------------------------------------------------


def test_tab_jumps_in_a_vim_snippet(server, editor, tmp_path):
    if not editor.nvim.funcs.has("nvim-0.10"):
        # 0.7 has no vim.snippet: Tab accepts as ever (the LuaSnip test below covers 0.7).
        assert editor.lua("return vim.snippet == nil")
        pytest.skip("vim.snippet is 0.10+")
    setup(editor, server, mode="line", max_tokens=16)
    start_typing(editor, tmp_path / "snip.py", "import os\n\n")
    editor.lua("vim.snippet.expand('value = $1\\nother = $2')")
    wait_until(lambda: editor.lua("return vim.snippet.active({direction = 1})"), 5, what="the snippet")
    # Neovim 0.11+ maps <Tab> globally to vim.snippet.jump (the plugin's <Tab> replaces it,
    # so the jump below is the plugin's doing); 0.10 maps nothing. Should a build map it in
    # the buffer for the session, it would shadow ours: set aside, back after the jump.
    editor.lua("""local m = vim.fn.maparg('<Tab>', 'i', false, true)
        if m.buffer == 1 then _G.snippet_tab = m; vim.keymap.del('i', '<Tab>', {buffer = 0}) end""")
    assert editor.nvim.funcs.maparg("<Tab>", "i", False, True)["desc"].startswith("completer")
    type_until_completion(editor, "os.pa")
    assert editor.lua("return vim.snippet.active({direction = 1})")
    before, (row, _) = editor.buffer_text(), editor.nvim.current.window.cursor
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.nvim.current.window.cursor[0] == row + 1, 5, what="the jump to $2")
    assert editor.buffer_text() == before and editor.nvim.current.line.strip() == "other ="
    editor.lua("""local m = _G.snippet_tab
        if m then
          vim.keymap.set('i', '<Tab>', m.callback or m.rhs, {buffer = 0, expr = m.expr == 1, silent = m.silent == 1,
            remap = m.noremap == 0, desc = m.desc})
        end
        ;(vim.snippet.stop or vim.snippet.exit)()
        pcall(vim.keymap.del, 'i', '<Tab>', {buffer = 0})""")
    # Out of the snippet Tab accepts again.
    cur = type_until_completion(editor, " os.")
    before = editor.buffer_text()
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.buffer_text() == before + cur["text"], 5, what="accept")


# LuaSnip cannot be installed here either (GitHub and LuaRocks only): its two functions
# the plugin calls, on a module in package.loaded as LuaSnip puts itself there.
FAKE_LUASNIP = """
_G.ls_jumpable, _G.ls_jumps = false, 0
package.loaded.luasnip = {
  expand_or_jumpable = function() return _G.ls_jumpable end,
  jumpable = function(dir) return _G.ls_jumpable end,
  expand_or_jump = function() _G.ls_jumps = _G.ls_jumps + 1; return true end,
}
"""


def test_tab_defers_to_an_active_luasnip(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16)
    editor.lua(FAKE_LUASNIP)
    start_typing(editor, tmp_path / "ls.py")
    cur = type_until_completion(editor, "retur")
    editor.lua("_G.ls_jumpable = true")
    before = editor.buffer_text()
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.lua("return _G.ls_jumps") == 1, 5, what="the snippet's jump")
    time.sleep(0.2)
    assert editor.buffer_text() == before  # not accepted, no tab either
    editor.lua("_G.ls_jumpable = false")
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.buffer_text() == before + cur["text"], 5, what="accept")
    assert editor.lua("return _G.ls_jumps") == 1


# -- 4. Manual trigger, snooze ---------------------------------------------------------


def suggest_until_shown(ed, chars: str) -> dict:
    """Type each of `chars`, then ask (:CompleterSuggest from insert mode), until a completion is shown."""
    for ch in chars:
        ed.nvim.input(keys(ch))
        n0 = len(sent(ed))
        ed.nvim.input("<Cmd>CompleterSuggest<CR>")
        wait_until(lambda: len(sent(ed)) > n0, 5, what="the request")
        settle(ed)
        cur = lua_current(ed)
        if cur and cur["done"] and cur["text"]:
            return cur
    raise AssertionError("no completion shown")


def test_manual_trigger_asks_only_when_asked(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16, trigger="manual", debounce_ms=10)
    capture(editor)
    assert editor.lua("return require('completer').statusline()") == "completer: manual"
    start_typing(editor, tmp_path / "man.py")
    for ch in "retur":
        editor.nvim.input(keys(ch))
        time.sleep(0.05)
    time.sleep(0.5)
    assert sent(editor) == [] and editor.ghost() is None  # no request, no prime
    cur = suggest_until_shown(editor, "n ")
    assert editor.ghost()["text"] == expand(cur["text"])
    # Typed through it still goes (no request); a whole accept asks for nothing next.
    n0 = len(sent(editor))
    before = editor.buffer_text()
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.buffer_text() == before + cur["text"], 5, what="accept")
    time.sleep(0.5)
    assert [m for m in sent(editor)[n0:] if m["type"] == "complete"] == []
    # The suggest key does what the command does.
    n0 = len(sent(editor))
    editor.nvim.input("<M-\\>")
    wait_until(lambda: len(sent(editor)) > n0, 5, what="the suggest key's request")
    assert "manual" in editor.nvim.api.exec("CompleterStatus", True)
    editor.nvim.input("<Esc>")
    editor.nvim.command("checkhealth completer")
    assert "trigger manual" in editor.buffer_text()


def test_snooze_pauses_automatic_completions(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16, debounce_ms=10, prime=False)
    capture(editor)
    start_typing(editor, tmp_path / "snooze.py")
    type_until_completion(editor, "retur")
    assert "snoozed for 5 min" in editor.nvim.api.exec("CompleterSnooze 5", True)
    assert editor.ghost() is None  # what was shown goes
    assert editor.lua("return require('completer').statusline()") == "completer: snoozed 5m"
    assert "snoozed: no automatic completions for 5 more min" in editor.nvim.api.exec("CompleterStatus", True)
    assert editor.mode() == "i"
    n0 = len(sent(editor))
    for ch in "n os.":
        editor.nvim.input(keys(ch))
        time.sleep(0.05)
    time.sleep(0.5)
    assert sent(editor)[n0:] == [] and editor.ghost() is None
    suggest_until_shown(editor, "path.j")  # asking still works
    editor.nvim.input("<Esc>")
    assert "snooze ended" in editor.nvim.api.exec("CompleterSnooze 0", True)
    assert editor.lua("return require('completer').statusline()") == "completer: ready"
    editor.nvim.input("A")
    type_until_completion(editor, "oin(a, b)")
    # A snooze ends by itself: one of 0.01 min (0.6 s).
    editor.nvim.input("<Esc>")
    editor.lua("require('completer').snooze(0.01)")
    assert editor.lua("return require('completer').snoozed()") is not None
    time.sleep(0.8)
    assert editor.lua("return require('completer').snoozed()") is None
    no_errors(editor)


# -- 5. wss:// -------------------------------------------------------------------------


def make_ca(dir: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA (certificate, key) made with `openssl req`."""
    cert, key = dir / f"{name}.pem", dir / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    f"/CN={name}", "-keyout", key, "-out", cert], check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """The real server with server.tls_cert/tls_key: a certificate for localhost and
    127.0.0.1 signed by a CA of the test's own; and another CA, which did not sign it."""
    d = tmp_path_factory.mktemp("tls")
    ca, ca_key = make_ca(d, "test-ca")
    other_ca, _ = make_ca(d, "other-ca")
    key, csr, cert, ext = d / "server.key", d / "server.csr", d / "server.pem", d / "san.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", key,
                    "-out", csr], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
                    "-days", "2", "-extfile", ext, "-out", cert], check=True, capture_output=True)
    with server_on(free_port(), *SETTINGS, f"server.tls_cert={cert}", f"server.tls_key={key}") as s:
        yield {"server": s, "ca": ca, "other_ca": other_ca, "url": f"wss://localhost:{s.port}/v1/ws"}


def test_wss_with_a_verified_certificate(tls, editor, tmp_path):
    assert "wss://" in "".join(tls["server"].log)
    editor.setup(url=tls["url"], token=TOKEN, tls_ca_file=str(tls["ca"]), mode="line", max_tokens=16)
    wait_until(editor.connected, 20, what="the TLS connection")
    start_typing(editor, tmp_path / "tls.py")
    cur = type_until_completion(editor, "retur")
    assert editor.ghost()["text"] == expand(cur["text"]) == expand(result_of(editor, cur["id"])["text"])
    before = editor.buffer_text()
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.buffer_text() == before + cur["text"], 5, what="accept")
    editor.nvim.input("<Esc>")
    # The TLS is an openssl process of Neovim's: ended with the connection, not left behind.
    pid = editor.lua("return require('completer')._state.client.conn.proc:get_pid()")
    os.kill(pid, 0)
    editor.lua("require('completer').disable(); require('completer')._state.client:stop()")
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10, what="openssl's exit")
    # By IP address too (-verify_ip); and :checkhealth reaches /healthz through openssl.
    editor.setup(url=f"wss://127.0.0.1:{tls['server'].port}/v1/ws", token=TOKEN, tls_ca_file=str(tls["ca"]))
    wait_until(editor.connected, 20, what="the TLS connection by IP address")
    editor.nvim.command("checkhealth completer")
    out = editor.buffer_text()
    assert "TLS through" in out and "is reachable" in out and "ERROR" not in out, out


def test_wss_refuses_a_certificate_it_cannot_verify(tls, editor, tmp_path):
    editor.setup(url=tls["url"], token=TOKEN, tls_ca_file=str(tls["other_ca"]), reconnect_min_ms=100,
                 reconnect_max_ms=200)
    err = wait_until(lambda: status(editor).get("error"), 15, what="the refused connection")
    assert "certificate did not verify" in err and str(tls["other_ca"]) in err, err
    time.sleep(1.0)  # several retries: refused each time, said once
    st = status(editor)
    assert st["state"] != "open" and st["attempts"] >= 2 and st["connects"] == 0
    assert editor.messages().count("certificate did not verify") == 1
    # Without tls_ca_file the system's CAs are used, which did not sign it either.
    editor.setup(url=tls["url"], token=TOKEN)
    wait_until(lambda: "certificate did not verify" in (status(editor).get("error") or ""), 15, what="refused")
    assert "set tls_ca_file" in status(editor)["error"]


def test_wss_without_openssl_says_so(editor, tmp_path):
    editor.setup(url=f"wss://localhost:{free_port()}/v1/ws", token=TOKEN, openssl="/nonexistent/openssl")
    err = wait_until(lambda: status(editor).get("error"), 10, what="the failure")
    assert "needs the openssl command" in err and "/nonexistent/openssl" in err, err
    assert editor.messages().count("needs the openssl command") == 1
    editor.nvim.command("checkhealth completer")
    assert "needs the openssl command" in editor.buffer_text()


# -- 6. Files git ignores --------------------------------------------------------------


def test_gitignored_files_are_excluded_on_request(server, editor, tmp_path):
    repo, outside = tmp_path / "repo", tmp_path / "plain"
    repo.mkdir()
    outside.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("generated.py\nbuild/\n")
    (repo / "build").mkdir()
    blocked = lambda: editor.lua("return require('completer').blocked()")  # noqa: E731
    setup(editor, server, mode="line", max_tokens=8, debounce_ms=10)
    editor.open_python(repo / "generated.py", "x = 1\n")
    assert blocked() is None  # off by default
    setup(editor, server, mode="line", max_tokens=8, debounce_ms=10, exclude_gitignored=True)
    capture(editor)
    for path in (repo / "generated.py", repo / "build" / "out.py"):
        start_typing(editor, path, "import os\n")
        assert blocked() == "ignored by git"
        for ch in "x = os.":
            editor.nvim.input(keys(ch))
        time.sleep(0.4)
        assert editor.lua("return require('completer').statusline()") == "completer: excluded"
        editor.nvim.input("<Esc>")
    assert sent(editor) == []
    for path in (repo / "kept.py", outside / "norepo.py"):  # tracked or untracked, and outside any repository
        editor.open_python(path, "x = 1\n")
        assert blocked() is None
    # Asked once per path: a .gitignore changed later counts from the next setup().
    (repo / ".gitignore").write_text("")
    editor.nvim.command(f"edit {repo / 'generated.py'}")
    assert blocked() == "ignored by git"
    setup(editor, server, mode="line", max_tokens=8, exclude_gitignored=True)
    assert blocked() is None


# -- 7. The docs state every setting, with its default --------------------------------


def test_readme_and_help_state_every_setting_with_its_default(editor):
    plugin = ROOT / "editor_clients" / "neovim"
    readme = (plugin / "README.md").read_text()
    block = re.search(r"```lua\n(require\('completer'\)\.setup\(\{\n.*?\n\}\))\n```", readme, re.S).group(1)
    top = re.sub(r"--[^\n]*", "", block[block.index("{") + 1:block.rindex("}")])  # no comments
    while re.search(r"\{[^{}]*\}", top):  # no nested tables (context, keymaps, filetypes)
        top = re.sub(r"\{[^{}]*\}", "", top)
    named = set(re.findall(r"(?:^|,)\s*(\w+) =", top, re.M))
    config_lua = (plugin / "lua" / "completer" / "config.lua").read_text()
    optional = set(re.findall(r"(\w+) = '\w+'", re.search(r"local OPTIONAL = \{(.*?)\n\}", config_lua, re.S).group(1)))
    defaults = set(editor.lua("return vim.tbl_keys(require('completer.config').defaults)"))
    assert named == defaults | optional, (named ^ (defaults | optional))
    # The values: the README's table, evaluated, against config.lua's defaults.
    differ = editor.lua("""
        local code = (...):gsub("^require%('completer'%)%.setup%(", 'return '):gsub('%)$', '')
        local readme = assert(loadstring(code))()
        local out = {}
        for k, v in pairs(require('completer.config').defaults) do
          if not vim.deep_equal(readme[k], v) then out[#out + 1] = k end
        end
        for k in pairs(readme) do
          if require('completer.config').defaults[k] == nil then out[#out + 1] = k .. ' (not nil)' end
        end
        return out""", block)
    assert differ == [], differ
    help_text = (plugin / "doc" / "completer.txt").read_text()
    missing = [n for n in sorted(named) if not re.search(rf"(^|, ){n} = ", help_text, re.M)]
    assert missing == [], missing
    for cmd in ("CompleterSuggest", "CompleterNext", "CompleterPrev", "CompleterSnooze", "CompleterStatus"):
        assert f"*:{cmd}*" in help_text and f":{cmd}" in readme, cmd
        assert editor.nvim.funcs.exists(f":{cmd}") == 2, cmd
    for key in ("<M-]>", "<M-[>", "<M-\\>"):
        assert f"`{key}`" in readme.split("## Keys")[1].split("## Settings")[0], key
    assert "*completer-troubleshooting*" in help_text and "checkhealth completer" in help_text

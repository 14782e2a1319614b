"""Each editor client's README says how to install it, names every setting
(the VS Code extension's contributes.configuration, the Neovim plugin's
config.lua defaults and optional options) and has a troubleshooting section
(the token, the port, `:checkhealth completer`, VS Code's output channel)."""

import json
import re

from latency_bench.harness import ROOT

CLIENTS = ROOT / "editor_clients"


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def vscode_settings() -> list[str]:
    package = json.loads((CLIENTS / "vscode" / "package.json").read_text())
    return list(package["contributes"]["configuration"]["properties"])


def neovim_options() -> list[str]:
    """The options of setup(): config.lua's M.defaults (and the keys of its tables of named
    options, as `table.key`) and those whose default is nil (OPTIONAL)."""
    source = (CLIENTS / "neovim" / "lua" / "completer" / "config.lua").read_text()
    defaults = re.search(r"\nM\.defaults = \{\n(.*?)\n\}\n", source, re.S).group(1)
    names, table = [], None
    for line in defaults.splitlines():
        if m := re.match(r"^  (\w+) = \{\s*(--.*)?$", line):  # a table spread over lines
            table = m.group(1)
            names.append(table)
        elif re.match(r"^  \},?", line):
            table = None
        elif m := re.match(r"^    (\w+) = ", line):
            names.append(f"{table}.{m.group(1)}")
        elif m := re.match(r"^  (\w+) = ", line):
            names.append(m.group(1))
    optional = re.search(r"\nlocal OPTIONAL = \{(.*?)\n\}", source, re.S).group(1)
    names += re.findall(r"(\w+) = '(?:string|number|table|boolean)'", optional)
    return list(dict.fromkeys(names))


def test_the_option_lists_are_read():
    assert len(vscode_settings()) >= 20 and "completer.requestTimeoutMs" in vscode_settings()
    options = neovim_options()
    assert len(options) >= 40, options
    for name in ("url", "exclude", "exclude_sensitive_files", "context.max_chunks", "keymaps", "request_timeout_ms",
                 "deadline_ms", "latency_records"):
        assert name in options, (name, options)


def test_vscode_readme_names_every_setting():
    readme = (CLIENTS / "vscode" / "README.md").read_text()
    table = section(readme, "Settings")
    # `completer.debounce.minMs` / `maxMs` share a row.
    named = set(re.findall(r"`(completer\.[\w.]+)`", table)) | {
        m.group(1) + "." + m.group(2) for m in re.finditer(r"`(completer\.\w+)\.\w+` / `(\w+)`", table)}
    missing = [s for s in vscode_settings() if s not in named]
    assert not missing, f"the README's Settings section does not name {missing}"


def test_neovim_readme_names_every_option():
    readme = (CLIENTS / "neovim" / "README.md").read_text()
    table = section(readme, "Every option")
    rows = set(re.findall(r"^\| `([\w.]+)` \|", table, re.M))
    missing = []
    for name in neovim_options():
        top, _, key = name.partition(".")
        # A table's keys in the table (context), or named anywhere (keymaps: the Keys section).
        if name in rows or any(r.startswith(f"{name}.") for r in rows):  # (a table by its keys' rows)
            continue
        if not (key and top == "keymaps" and re.search(rf"\b{key}\b", readme)):
            missing.append(name)
    assert not missing, f"the README's option table does not name {missing}"


def test_each_readme_says_how_to_install_and_troubleshoot():
    vscode = (CLIENTS / "vscode" / "README.md").read_text()
    assert "code --install-extension" in section(vscode, "Install")
    trouble = section(vscode, "Troubleshooting")
    for needed in ("output", "Set Token", "completer.serverUrl", "--port", "completer.tokenFile"):
        assert needed in trouble, needed
    neovim = (CLIENTS / "neovim" / "README.md").read_text()
    assert "require('completer').setup" in section(neovim, "Install")
    trouble = section(neovim, "Troubleshooting")
    for needed in (":checkhealth completer", ":CompleterStatus", "token", "--port", "url"):
        assert needed in trouble, needed

"""Both editor clients exclude one default list of secret-file globs: the VS
Code extension's SENSITIVE_GLOBS (src/privacy.ts) and the Neovim plugin's
SECRETS (lua/completer/config.lua) are the same list in the same order, and
the extension's README names every one of them (its setting's description
points there)."""

import re

from latency_bench.harness import ROOT

CLIENTS = ROOT / "editor_clients"


def quoted(block: str) -> list[str]:
    """The single-quoted strings of `block`, comments left out."""
    lines = [re.sub(r"^\s*(//|--).*$", "", line) for line in block.splitlines()]
    return re.findall(r"'([^']*)'", "\n".join(lines))


def vscode_globs() -> list[str]:
    source = (CLIENTS / "vscode" / "src" / "privacy.ts").read_text()
    return quoted(re.search(r"SENSITIVE_GLOBS: readonly string\[\] = \[(.*?)\n\];", source, re.S).group(1))


def neovim_globs() -> list[str]:
    source = (CLIENTS / "neovim" / "lua" / "completer" / "config.lua").read_text()
    return quoted(re.search(r"M\.SECRETS = \{(.*?)\n\}", source, re.S).group(1))


def test_both_clients_have_one_list():
    vscode, neovim = vscode_globs(), neovim_globs()
    assert len(vscode) > 30 and len(set(vscode)) == len(vscode), vscode
    assert vscode == neovim, (f"only VS Code: {sorted(set(vscode) - set(neovim))}, "
                              f"only Neovim: {sorted(set(neovim) - set(vscode))}, or another order")


def test_the_extension_readme_names_every_one():
    readme = (CLIENTS / "vscode" / "README.md").read_text()
    privacy = readme[readme.index("## Privacy"):]
    privacy = privacy[:privacy.index("\n## ", 1)]
    named = re.findall(r"`([^`]+)`", privacy)
    missing = [g for g in vscode_globs() if g not in named]
    assert not missing, f"the README's Privacy section does not name {missing}"

"""Both editor clients and `completer lsp` exclude one default list of
secret-file globs: the VS Code extension's SENSITIVE_GLOBS (src/privacy.ts),
the Neovim plugin's SECRETS (lua/completer/config.lua) and the language
server's SECRETS (completer/lsp/privacy.py) are the same list in the same order, and
the extension's README names every one of them (its setting's description
points there)."""

import re

import pytest

from completer.lsp import privacy
from completer.lsp.settings import LspSettings

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


def test_both_clients_and_the_language_server_have_one_list():
    vscode, neovim, lsp = vscode_globs(), neovim_globs(), list(privacy.SECRETS)
    assert len(vscode) > 30 and len(set(vscode)) == len(vscode), vscode
    assert vscode == neovim, (f"only VS Code: {sorted(set(vscode) - set(neovim))}, "
                              f"only Neovim: {sorted(set(neovim) - set(vscode))}, or another order")
    assert lsp == vscode, (f"only completer lsp: {sorted(set(lsp) - set(vscode))}, "
                           f"only the plugins: {sorted(set(vscode) - set(lsp))}, or another order")


@pytest.mark.parametrize("path, why", [
    ("/home/me/app/.env", "excluded by .env"), ("/home/me/app/config/ID_RSA.pub", "excluded by id_rsa*"),
    ("/home/me/.ssh/config", "excluded by **/.ssh/**"), ("/home/me/app/prod.tfvars", "excluded by *.tfvars"),
    ("/home/me/app/certs/Server.PEM", "excluded by *.pem"), ("/home/me/app/main.py", None),
    ("/home/me/app/secret_sauce.py", None)])
def test_the_language_server_blocks_what_the_plugins_block(path, why):
    assert privacy.blocked(f"file://{path}", LspSettings()) == why
    assert privacy.blocked(f"file://{path}", LspSettings(exclude_sensitive_files=False)) is None


def test_the_language_servers_exclude_include_and_schemes():
    settings = LspSettings(exclude=["**/vendor/**"], include=["*.py", "*.lua"])
    assert privacy.blocked("file:///w/vendor/lib.py", settings) == "excluded by **/vendor/**"
    assert privacy.blocked("file:///w/app.js", settings) == "not in include"
    assert privacy.blocked("file:///w/app.py", settings) is None
    assert privacy.blocked("git:///w/app.py", settings) == "scheme git"
    assert privacy.blocked("untitled:Untitled-1", LspSettings()) is None


def test_the_extension_readme_names_every_one():
    readme = (CLIENTS / "vscode" / "README.md").read_text()
    privacy = readme[readme.index("## Privacy"):]
    privacy = privacy[:privacy.index("\n## ", 1)]
    named = re.findall(r"`([^`]+)`", privacy)
    missing = [g for g in vscode_globs() if g not in named]
    assert not missing, f"the README's Privacy section does not name {missing}"

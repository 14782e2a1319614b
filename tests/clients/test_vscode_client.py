"""The VS Code extension (editor_clients/vscode): its lint and type check, its
node tests (which start the real `completer serve` themselves, with only the
`vscode` module faked; the packaged models, and for the emoji test SmolLM2-135M,
which the server fetches into the user's cache as `default_model` does) and its
packaging into a .vsix. Needs Node 20+ and npm; `npm ci` runs when
node_modules is missing (the npm registry, once)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# `npm ci` (up to 600 s) before the first test; the node tests against the real server take up to 600 s.
pytestmark = pytest.mark.timeout(1500)

ROOT = Path(__file__).resolve().parents[2]
EXTENSION = ROOT / "editor_clients" / "vscode"


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Run `cmd` in the extension's directory; fail with its output on a non-zero exit or a timeout."""
    if shutil.which(cmd[0]) is None:
        pytest.fail(f"`{cmd[0]}` not found: the VS Code extension's tests need Node 20+ and npm on PATH")
    proc = subprocess.Popen(cmd, cwd=EXTENSION, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # npm's children too (node, the server it started)
        out, _ = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` timed out after {timeout:.0f} s:\n{out[-12000:]}")
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{out[-12000:]}")
    return out


@pytest.fixture(scope="module")
def installed() -> None:
    if not (EXTENSION / "node_modules").is_dir():
        run(["npm", "ci", "--no-audit", "--no-fund"], timeout=600)


def test_lint_and_types(installed):
    run(["npm", "run", "lint"], timeout=300)


def test_node_tests_against_the_real_server(installed):
    out = run(["npm", "test"], timeout=600, env={"COMPLETER_PYTHON": sys.executable})
    assert "# fail 0" in out and "# pass " in out, out[-4000:]


def test_vsix_package(installed, tmp_path):
    vsix = tmp_path / "completer.vsix"
    run(["npm", "run", "package", "--", "--out", str(vsix)], timeout=300, env={"npm_config_offline": "true"})
    assert vsix.is_file(), f"{vsix} was not written"
    names = set(zipfile.ZipFile(vsix).namelist())
    for needed in ("extension/package.json", "extension/out/src/extension.js", "extension/out/src/client.js",
                   "extension/node_modules/ws/index.js", "extension/readme.md"):
        assert needed in names, f"{needed} missing from the .vsix: {sorted(names)}"
    assert not any(n.startswith("extension/out/test/") or n.startswith("extension/src/") for n in names)

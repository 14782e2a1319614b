"""The Neovim plugin's fixtures: its server (the embedded models), each
Neovim build, and a fresh editor per test (support/neovim.py: the helpers)."""

import pytest

from latency_bench.nvim_editor import Editor, free_port, nvim_build, nvim_builds, server_on
from support.neovim import SETTINGS, no_errors


@pytest.fixture(scope="module")
def server():
    with server_on(free_port(), *SETTINGS) as s:
        yield s


@pytest.fixture(scope="module", params=nvim_builds())
def build(request):
    """Every test on Debian's Neovim 0.7 and on a modern build (0.12)."""
    return nvim_build(request.param)


@pytest.fixture
def editor(tmp_path, build):
    """A fresh Neovim; at the end neither :messages nor its stderr holds an error."""
    ed = Editor(tmp_path, build, env={"COMPLETER_TOKEN": "", "XDG_CONFIG_HOME": str(tmp_path / "config")})
    try:
        yield ed
        no_errors(ed)
    finally:
        stderr = ed.close()
    assert "Error" not in stderr and "E5108" not in stderr, stderr


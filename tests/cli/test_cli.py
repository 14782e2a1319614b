"""The `completer complete` command: the engine and the pipeline, from the command line."""

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "completer.cli", *args], capture_output=True,
                          text=True, input=stdin, cwd=ROOT, timeout=300)


def test_complete_command_on_shipped_models():
    done = run_cli("complete", "--model", "embedded", "examples/shapes.py:27:9")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "empty completion"
    assert "prompt" in done.stderr and "ttft" in done.stderr and "generated" in done.stderr


def test_complete_command_default_model_suggests_the_perimeter(default_model):
    """The README's example on the real default target (SmolLM2-135M)."""
    done = run_cli("complete", "examples/shapes.py:27:9")
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[0]
    assert line.startswith("return") and "self.width" in line and "self.height" in line, line
    assert "SmolLM2" in done.stderr


def test_complete_command_from_stdin():
    done = run_cli("complete", "--model", "embedded", "--prefix", "-", "--suffix", "\n",
                   stdin="import os\n\ndef main():\n    ")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_complete_command_bad_model_dir(tmp_path):
    done = run_cli("complete", "--model", str(tmp_path / "nope"), "--prefix", "x")
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "nope" in done.stderr


def test_complete_command_cursor_outside_file():
    done = run_cli("complete", "examples/shapes.py:999:1")
    assert done.returncode != 0 and "outside the file" in done.stderr


def test_complete_command_reads_the_config_and_its_overrides(tmp_path):
    """`completer complete` takes the server's config: here `[request]` from a
    TOML file, one key overridden with --set."""
    config = tmp_path / "c.toml"
    config.write_text('[model]\ntarget = "embedded"\n[request]\nmode = "free"\nmax_tokens = 7\n')
    done = run_cli("complete", "--config", str(config), "--set", "request.max_tokens=3",
                   "--prefix", "def add(a, b):\n    ")
    assert done.returncode == 0, done.stderr
    assert "generated 3 tok" in done.stderr and "length" in done.stderr, done.stderr
    bad = run_cli("complete", "--config", str(config), "--set", "engine.max_tokens=3", "--prefix", "x")
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0
    assert "request.max_tokens" in bad.stderr

"""The wheel a user installs (`pip install .`, not the editable install the
tests run from) carries every module of the source tree: a subpackage left
out of pyproject's list imports fine here and breaks `completer serve`
there."""

import shutil
import subprocess
import sys
import zipfile

from latency_bench.harness import ROOT


def test_the_wheel_carries_every_python_file_and_packaged_model(tmp_path):
    # From a copy: setuptools would otherwise reuse a build/ folder left by an earlier build.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "node_modules", "docs"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("completer-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"completer/{p.relative_to(ROOT / 'completer').as_posix()}"
                for p in (ROOT / "completer").rglob("*") if p.suffix in (".py", ".html", ".safetensors")}
    expected |= {f"completer_kernels/{p.relative_to(ROOT / 'kernels').as_posix()}"
                 for p in (ROOT / "kernels").rglob("*") if p.suffix in (".py", ".cpp", ".h")}
    expected |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "latency_bench").rglob("*.py")}
    assert sorted(expected - shipped) == []

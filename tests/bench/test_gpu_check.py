"""latency_bench/gpu_check.py runs end to end on CPU with --dry-run (tiny
shapes, Triton interpreter), as `python -m latency_bench gpu-check` runs it,
installed or from a checkout that is not (`completer_kernels` then is
kernels/, which has no __init__.py), and as `python latency_bench/gpu_check.py`
from such a checkout: every section, correctness passing, JSON written, the
table printed last."""

import json
import os
import subprocess
import sys

import pytest

from latency_bench.harness import ROOT

# Put first on PYTHONPATH: the interpreter then finds this project's packages only where a checkout
# puts them (the current directory, the script's), not installed (site-packages, an editable
# install's finders), as on a machine that got the working tree and no `pip install`.
NOT_INSTALLED = """
import site, sys
from importlib.machinery import PathFinder
OURS = {"completer", "completer_kernels", "latency_bench"}
INSTALLED = tuple(site.getsitepackages() + [site.getusersitepackages()])

class CheckoutOnly(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None and name in OURS:
            path = [p for p in sys.path if not (p and (p.startswith(INSTALLED) or "__editable__" in p))]
        return super().find_spec(name, path, target)

sys.meta_path[:] = [CheckoutOnly if f is PathFinder else f for f in sys.meta_path if "Editable" not in repr(f)]
"""


@pytest.fixture
def checkout(tmp_path):
    """The environment, and a directory outside the checkout, with the install hidden."""
    hide = tmp_path / "not_installed"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(NOT_INSTALLED)
    env = {**os.environ, "PYTHONPATH": str(hide)}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = "import importlib.util as u; print([u.find_spec(n) for n in ('completer', 'completer_kernels')])"
    found = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert found.stdout.strip() == "[None, None]", found.stdout + found.stderr  # hidden indeed
    return env, elsewhere


@pytest.mark.parametrize("how", ["installed", "checkout, -m", "checkout, the file"])
def test_gpu_check_dry_run(tmp_path, request, how):
    out = tmp_path / "out"
    command, cwd, env = [sys.executable, "-m", "latency_bench", "gpu-check"], ROOT, None
    if how != "installed":
        env, elsewhere = request.getfixturevalue("checkout")
        if how == "checkout, the file":
            command, cwd = [sys.executable, str(ROOT / "latency_bench" / "gpu_check.py")], elsewhere
    r = subprocess.run([*command, "--dry-run", "--out", str(out)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["dry_run"] and results["fp8_emulation"]
    sections = results["sections"]
    assert set(sections) == {"kernels", "gemm", "decode", "engine"}
    for name, section in sections.items():
        assert "error" not in section and "skipped" not in section, (name, section)

    kernels = sections["kernels"]
    for name in ("gemm_q,o", "gemm_k,v", "gemm_gate,up", "gemm_down"):
        row = kernels[name]
        assert row["quant_byte_mismatch"] == 0 and row["quant_scales_equal"]
        assert row["triton_rowwise_within_bound"] and row["triton_blockwise_within_bound"]
        assert 0 < row["rowwise_rel_err_vs_bf16_inputs"] < 0.06
    assert kernels["paged_attention_float32"]["pass"] and kernels["paged_attention_bfloat16"]["pass"]
    assert kernels["paged_attention_verify"]["pass"]

    gemm = sections["gemm"]
    assert {"gate,up_M1", "down_M16"} <= set(gemm)
    assert all(v > 0 for v in gemm["down_M16"]["tflops"].values())

    decode = sections["decode"]
    for key in ("bf16_b1", "fp8_b1", "bf16_b2", "fp8_b2"):
        assert decode[key]["eager_ms"] > 0 and decode[key]["floor_ms"] > 0
    assert decode["fp8_b1"]["weight_bytes"] < decode["bf16_b1"]["weight_bytes"]

    engine = sections["engine"]
    for key in ("bf16_spec_off", "bf16_spec_on", "fp8_spec_off", "fp8_spec_on"):
        assert engine[key]["tokens"] > 0 and engine[key]["tok_per_s"] > 0

    assert all(row[2] != "FAIL" for row in results["rows"])
    lines = r.stdout.rstrip().splitlines()
    assert "gpu_check on" in r.stdout and lines[-1].startswith("└")  # the table comes last

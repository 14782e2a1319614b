"""latency_bench/gpu_check.py runs end to end on CPU with --dry-run (tiny
shapes, Triton interpreter), as `python -m latency_bench gpu-check` runs it:
every section, correctness passing, JSON written, the table printed last."""

import json
import subprocess
import sys

from latency_bench.harness import ROOT


def test_gpu_check_dry_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "latency_bench", "gpu-check", "--dry-run", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
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

"""Triton kernels with plain-torch references, imported as `completer_kernels`.

(PyPI's `kernels` distribution owns the import name `kernels`, hence the
different import name for this directory; see pyproject.toml.)

fp8_quant: per-token and per-1x128-group dynamic e4m3 quantization.
fp8_gemm: W8A8 FP8 GEMMs, row-wise and 128x128 block-scaled, bf16 out.
paged_attention: fp32 decode attention through the paged KV block tables.
"""

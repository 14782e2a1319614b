"""Triton kernels with plain-torch references, imported as `completer_kernels`.

(PyPI's `kernels` distribution owns the import name `kernels`, hence the
different import name for this directory; see pyproject.toml.) The FP8 GEMM,
activation quantization and paged-attention kernels land with the FP8 issue.
"""

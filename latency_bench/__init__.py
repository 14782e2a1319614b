"""The benchmarks and the harness they share with the tests: `python -m
latency_bench COMMAND` runs one (`python -m latency_bench --help` lists them,
latency_bench/README.md says what each measures); `latency_bench.harness`
starts real servers and speaks the protocol, for benchmarks and tests alike.

Importing the package imports nothing else: a benchmark may need to set the
environment before torch or triton is imported (gpu_check.py's --dry-run)."""

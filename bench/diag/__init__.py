"""Diagnostic probes: `python -m bench.diag.<name>` (loop_overhead, dump_engine_hlo;
loop_probes, hlo_kernels and token_clock are the pieces they and the benchmarks share)."""

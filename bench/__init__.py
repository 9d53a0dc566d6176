"""Benchmarks, one module each, run from the repository root: `python -m bench.<name>`
(executor, sched, step, serving, hf_reference, kernel_profile, combine_ab; bench/diag/ holds
the probes). Results: bench/results/. The GPU runner: `bash bench/gpu_check.sh RECIPE...`."""

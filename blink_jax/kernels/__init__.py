"""The fast kernels of a model step (Pallas and CUDA) and `select`, the one module that picks
a step's kernels from the engine's `KernelOptions`."""

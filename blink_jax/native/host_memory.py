"""Host memory the GPU reads and writes in place: the mailbox lives in it (DESIGN.md, "The
mailbox protocol"), registered with `cudaHostRegister(..., Mapped)` so that the device loop
polls it across PCIe without any host thread."""
from __future__ import annotations

import ctypes

from blink_jax.native import ffi


class Registration:
  """`nbytes` of host memory at `address` mapped into the GPU's address space until
  `release()`; `device_address` is where kernels reach it."""

  def __init__(self, address: int, nbytes: int):
    cuda = ffi.cuda_library()
    if cuda is None:
      raise RuntimeError("running on a GPU but the CUDA handlers were not built "
                         "(reinstall with nvcc on PATH)")
    dev = ctypes.c_uint64()
    rc = cuda.blink_cuda_register_host(address, nbytes, ctypes.byref(dev))
    if rc:
      raise RuntimeError(f"cudaHostRegister failed: {cuda.blink_cuda_error_string(rc)}")
    self.address, self.nbytes, self.device_address = address, nbytes, dev.value
    self._cuda = cuda

  def release(self) -> None:
    """Unregisters the memory (idempotent); the device must no longer touch it."""
    if self.address is not None:
      self._cuda.blink_cuda_unregister_host(self.address)
      self.address = None

"""A mailbox kept in GPU memory: what an RDMA NIC writes in Blink's design.

The device loop reads it at HBM speed and never touches host memory; this process reaches it
through copies on a private CUDA stream (so they run beside the serving loop). Each read or
write is one copy (~10 us), so it suits benchmarks and control words, not a busy frontend.
"""
from __future__ import annotations

import ctypes

import numpy as np

from blink_jax.native import ffi


class DeviceRegion:
  """A zeroed region of GPU memory behind the Region interface (read / write)."""

  def __init__(self, nbytes: int):
    self._cuda = ffi.cuda_library()
    if self._cuda is None:
      raise RuntimeError("DeviceRegion needs the CUDA handlers (built where nvcc exists)")
    ptr = ctypes.c_void_p()
    self._check(self._cuda.blink_cuda_alloc(nbytes, ctypes.byref(ptr)))
    self.address, self.nbytes = int(ptr.value), nbytes

  def _check(self, rc: int) -> None:
    if rc:
      raise RuntimeError(f"CUDA error: {self._cuda.blink_cuda_error_string(rc).decode()}")

  def _bounds(self, offset: int, n: int) -> None:
    if offset < 0 or offset + n > self.nbytes:
      raise ValueError(f"range [{offset}, {offset + n}) outside the {self.nbytes}-byte region")

  def read(self, offset: int, nbytes: int) -> bytes:
    self._bounds(offset, nbytes)
    out = np.empty(nbytes, np.uint8)
    self._check(self._cuda.blink_cuda_copy(out.ctypes.data, self.address + offset, nbytes))
    return out.tobytes()

  def write(self, offset: int, data: bytes) -> None:
    self._bounds(offset, len(data))
    src = np.frombuffer(data, np.uint8)
    self._check(self._cuda.blink_cuda_copy(self.address + offset, src.ctypes.data, len(data)))

  def upload(self, image: np.ndarray) -> None:
    """Copies a whole host-built image (header and submitted slots) in one go."""
    self._bounds(0, image.nbytes)
    self._check(self._cuda.blink_cuda_copy(self.address, image.ctypes.data, image.nbytes))

  def free(self) -> None:
    if self.address:
      self._cuda.blink_cuda_free(self.address)
      self.address = 0

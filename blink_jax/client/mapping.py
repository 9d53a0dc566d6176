"""Memory mapped at a chosen virtual address when that address is free (JAX-free).

Why an address is chosen at all: the serving loop's scheduler calls carry the mailbox's
address as an FFI attribute, so the compiled loop is another program for every address the
mailbox gets; mapped at the same address in every process, a restarted engine's loop is the
same program, which JAX's persistent compilation cache loads instead of compiling it again
(docs/ARCHITECTURE.md, "Compilation cache"). Where the address is taken (another mapping of
this process, a kernel without MAP_FIXED_NOREPLACE, not Linux), the memory goes wherever the
kernel puts it: only the cache misses.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import weakref

import numpy as np

# The engine's mailbox: 96 TiB, between a Linux x86-64 process's heap (near 0x55...) and its
# mmap area (below 0x7f...), away from the ranges the CUDA driver reserves.
MAILBOX_ADDRESS = 0x6000_0000_0000
_MAP_FIXED_NOREPLACE = 0x100000  # Linux 4.17+: map there or fail, never replace a mapping


def page_bytes(nbytes: int) -> int:
  """nbytes rounded up to whole pages."""
  return (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


@functools.cache
def _libc():
  if not sys.platform.startswith("linux"):
    return None
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mmap.restype = ctypes.c_void_p
  libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                        ctypes.c_int, ctypes.c_long]
  libc.munmap.restype = ctypes.c_int
  libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
  return libc


def map_at(address: int, nbytes: int, fd: int = -1) -> np.ndarray | None:
  """nbytes (whole pages) of fd's memory (MAP_SHARED; fd -1: anonymous shared memory) at
  `address` as a uint8 array, or None where the address is not free. The mapping lasts as
  long as some array views it (as an `mmap.mmap`'s does)."""
  libc = _libc()
  if libc is None:
    return None
  size = page_bytes(nbytes)
  flags = mmap.MAP_SHARED | _MAP_FIXED_NOREPLACE | (mmap.MAP_ANONYMOUS if fd < 0 else 0)
  got = libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
  if got is None or got == ctypes.c_void_p(-1).value:
    return None
  if got != address:  # a kernel that took the flag as a hint put it elsewhere
    libc.munmap(got, size)
    return None
  memory = (ctypes.c_uint8 * size).from_address(got)
  # Unmapped with the last view; at exit the process's end does it (a thread still polling
  # the mailbox during interpreter shutdown must not find it gone).
  weakref.finalize(memory, libc.munmap, got, size).atexit = False
  return np.frombuffer(memory, np.uint8)


def map_memory(nbytes: int, fd: int = -1, address: int | None = None) -> np.ndarray:
  """nbytes (whole pages) of fd's memory, or of anonymous shared memory, as a uint8 array:
  at `address` when given and free, else wherever the kernel puts it."""
  if address is not None:
    buf = map_at(address, nbytes, fd)
    if buf is not None:
      return buf
  if fd < 0:
    return np.frombuffer(mmap.mmap(-1, page_bytes(nbytes)), np.uint8)
  return np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE), np.uint8)

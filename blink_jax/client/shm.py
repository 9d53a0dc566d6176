"""POSIX shared memory transport: the engine creates the mailbox, frontends map it.

The segment is created with mode 0600 (only the engine's user can map it) and mapped with mmap
directly. multiprocessing.shared_memory is not used on purpose: its resource tracker unlinks a
segment when any process that merely opened it exits, which would pull the mailbox from under
the engine when a frontend worker stops.

The engine side registers `.address` .. `.address + .nbytes` with the GPU itself
(cudaHostRegister); the mapping is page aligned.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets

import numpy as np

from blink_jax.client import mapping
from blink_jax.client.mailbox import LocalRegion

try:  # CPython's own binding of shm_open/shm_unlink (what multiprocessing uses).
  import _posixshmem  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - non-CPython
  _posixshmem = None

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
_DEV_SHM = "/dev/shm"


def _check_name(name: str) -> str:
  name = name.lstrip("/")
  if not _NAME_RE.match(name):
    raise ValueError(f"bad shared memory name {name!r}: letters, digits, '_', '.', '-' only")
  return name


def _shm_open(name: str, flags: int, mode: int) -> int:
  if _posixshmem is not None:
    return _posixshmem.shm_open("/" + name, flags, mode)
  return os.open(os.path.join(_DEV_SHM, name), flags | os.O_NOFOLLOW, mode)


def _shm_unlink(name: str) -> None:
  if _posixshmem is not None:
    _posixshmem.shm_unlink("/" + name)
  else:
    os.unlink(os.path.join(_DEV_SHM, name))


def exists(name: str) -> bool:
  """Whether a segment of this name exists (Linux: looks in /dev/shm)."""
  name = _check_name(name)
  if os.path.isdir(_DEV_SHM):
    return os.path.exists(os.path.join(_DEV_SHM, name))
  try:
    os.close(_shm_open(name, os.O_RDONLY, 0))
    return True
  except FileNotFoundError:
    return False


def default_name() -> str:
  return f"blink-{os.getpid()}-{secrets.token_hex(4)}"


class ShmRegion(LocalRegion):
  """A mapped POSIX shared memory segment; a `Region` through LocalRegion's read/write."""

  def __init__(self, name: str, mapped: np.ndarray, nbytes: int, owner: bool):
    self.name = name
    self.nbytes = nbytes
    self.owner = owner
    self._mapped: np.ndarray | None = mapped
    # An mmap.mmap behind the array (not a `mapping.map_at` mapping) is closed by close().
    base = mapped.base
    self._mmap = base.obj if isinstance(base, memoryview) and isinstance(
        base.obj, mmap.mmap) else None
    super().__init__(mapped[:nbytes])
    self._unlinked = False

  @property
  def closed(self) -> bool:
    return self._mapped is None

  def close(self) -> None:
    """Unmaps the segment in this process (views of `.buf` must not be used afterwards)."""
    mapped, self._mapped = self._mapped, None
    if mapped is None:
      return
    self.buf = np.zeros(0, np.uint8)
    del mapped  # the array exports the mmap's buffer: with it alive, close() could not unmap
    mm, self._mmap = self._mmap, None
    if mm is not None:
      try:
        mm.close()
      except BufferError:
        # Someone still holds a view of the buffer: the mapping goes away with the last one.
        pass
    # (A mapping at a chosen address, `mapping.map_at`, goes with its last view anyway.)

  def unlink(self) -> None:
    """Removes the name (engine side, at shutdown); existing mappings stay valid."""
    if self._unlinked:
      return
    self._unlinked = True
    try:
      _shm_unlink(self.name)
    except FileNotFoundError:
      pass

  def __enter__(self) -> "ShmRegion":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
    if self.owner:
      self.unlink()

  def __repr__(self) -> str:
    return f"ShmRegion(name={self.name!r}, nbytes={self.nbytes}, owner={self.owner})"


def create_region(name: str | None, nbytes: int, address: int | None = None) -> ShmRegion:
  """Creates (exclusively) and maps a zero-filled segment of `nbytes`, mode 0600; at
  `address` when given and free (`mapping.map_memory`)."""
  if nbytes <= 0:
    raise ValueError(f"nbytes must be positive, got {nbytes}")
  name = _check_name(name or default_name())
  fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
  try:
    os.fchmod(fd, 0o600)  # whatever the umask did
    os.ftruncate(fd, nbytes)
    mapped = mapping.map_memory(nbytes, fd, address)
  except BaseException:
    os.close(fd)
    _shm_unlink(name)
    raise
  os.close(fd)
  return ShmRegion(name, mapped, nbytes, owner=True)


def open_region(name: str) -> ShmRegion:
  """Maps an existing segment read-write (frontend side); never unlinks it."""
  name = _check_name(name)
  fd = _shm_open(name, os.O_RDWR, 0)
  try:
    nbytes = os.fstat(fd).st_size
    if nbytes <= 0:
      raise ValueError(f"shared memory {name!r} is empty (the engine has not sized it yet)")
    mapped = mapping.map_memory(nbytes, fd)
  finally:
    os.close(fd)
  return ShmRegion(name, mapped, nbytes, owner=False)

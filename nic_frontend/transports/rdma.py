"""RDMA transport: one-sided RDMA WRITE / READ into the engine's mailbox (pyverbs).

The closest software form of Blink's SmartNIC path: the frontend's stores and loads become
RDMA WRITE and READ work requests on a reliable connection; the engine host's CPU takes no part
once the connection is up. Kept thin on purpose:

  engine host: `RdmaRegionServer(region, token, host, port).start()` registers the mailbox
               (remote read + write) and, per frontend connection, checks the token and sends
               (address, rkey, size) of the registration;
  frontend   : `RdmaRegion(host, port, token)` implements `Region`; each read / write is one
               signalled work request on a staging buffer, completed before the call returns.

Needs pyverbs (rdma-core >= 36 for CMID.post_read / post_write) and an RDMA device; `available()`
says whether both are here. The same mailbox protocol runs over the shm and tcp transports.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import threading
import time

import numpy as np

log = logging.getLogger(__name__)

_INFO = struct.Struct("<QIQ")  # address, rkey, size
_TOKEN_BYTES = 32


def available() -> tuple[bool, str]:
  """(True, device names) when pyverbs imports and an RDMA device is present, else (False, why)."""
  try:
    import pyverbs.device as d  # noqa: F401
  except Exception as e:  # ImportError or a broken rdma-core install
    return False, f"pyverbs is not importable ({type(e).__name__}: {e})"
  try:
    devs = d.get_device_list()
  except Exception as e:
    return False, f"cannot list RDMA devices ({type(e).__name__}: {e})"
  if not devs:
    return False, "no RDMA device present"
  names = [dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name) for dev in devs]
  return True, ", ".join(names)


def _require() -> None:
  ok, why = available()
  if not ok:
    raise RuntimeError(f"RDMA transport unavailable: {why}")


def _digest(token: str | bytes) -> bytes:
  key = token.encode() if isinstance(token, str) else token
  return hmac.new(key, b"blink-rdma-v1", hashlib.sha256).digest()


def _qp_init_attr(depth: int = 16):
  from pyverbs.qp import QPCap, QPInitAttr
  import pyverbs.enums as e
  cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
  return QPInitAttr(qp_type=e.IBV_QPT_RC, cap=cap, sq_sig_all=1)


def _wait(get_comp, what: str, timeout: float = 10.0):
  import pyverbs.enums as e
  deadline = time.monotonic() + timeout
  while True:
    wc = get_comp()
    if wc is not None:
      if wc.status != e.IBV_WC_SUCCESS:
        raise ConnectionError(f"RDMA {what} failed: work completion status {wc.status}")
      return wc
    if time.monotonic() > deadline:
      raise TimeoutError(f"RDMA {what} did not complete in {timeout}s")


class RdmaRegionServer:
  """Engine side: exposes `region` (numpy uint8 buffer or an object with .buf) over RDMA."""

  def __init__(self, region, token: str | bytes, host: str = "0.0.0.0", port: int = 18515):
    _require()
    buf = region.buf if hasattr(region, "buf") else region
    self.buf = np.asarray(buf).view(np.uint8).reshape(-1)
    self.host, self.port = host, port
    self._digest = _digest(token)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._conns: list = []

  def start(self) -> "RdmaRegionServer":
    from pyverbs.cmid import AddrInfo, CMID
    import pyverbs.cm_enums as ce
    info = AddrInfo(src=self.host, service=str(self.port), port_space=ce.RDMA_PS_TCP,
                    flags=ce.RAI_PASSIVE)
    self._listen = CMID(creator=info, qp_init_attr=_qp_init_attr())
    self._listen.listen()
    self._thread = threading.Thread(target=self._accept_loop, name="blink-rdma-relay",
                                    daemon=True)
    self._thread.start()
    return self

  def _accept_loop(self) -> None:
    import pyverbs.enums as e
    from pyverbs.mr import MR
    while not self._stop.is_set():
      try:
        conn = self._listen.get_request()
      except Exception:
        if self._stop.is_set():
          return
        log.exception("rdma relay: get_request failed")
        continue
      try:
        access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
                  | e.IBV_ACCESS_REMOTE_READ)
        region_mr = MR(self._listen.pd, self.buf.size, access,
                       address=self.buf.ctypes.data)
        msg = conn.reg_msgs(max(_TOKEN_BYTES, _INFO.size))
        conn.post_recv(msg)
        conn.accept()
        _wait(conn.get_recv_comp, "token receive")
        if not hmac.compare_digest(bytes(msg.read(_TOKEN_BYTES, 0)), self._digest):
          log.warning("rdma relay: rejected a client (bad token)")
          conn.disconnect()
          conn.close()
          region_mr.close()
          continue
        reply = conn.reg_msgs(_INFO.size)
        reply.write(_INFO.pack(self.buf.ctypes.data, region_mr.rkey, self.buf.size), _INFO.size,
                    0)
        conn.post_send(reply)
        _wait(conn.get_send_comp, "info send")
        self._conns.append((conn, region_mr, msg, reply))
      except Exception:
        log.exception("rdma relay: connection setup failed")

  def stop(self) -> None:
    self._stop.set()
    for conn, mr, *_ in self._conns:
      try:
        conn.disconnect()
      except Exception:
        pass
      mr.close()
      conn.close()
    try:
      self._listen.close()
    except Exception:
      pass


class RdmaRegion:
  """Frontend side `Region`: one-sided RDMA READ / WRITE of the engine's mailbox."""

  def __init__(self, host: str, port: int, token: str | bytes, *, staging_bytes: int = 1 << 20):
    _require()
    from pyverbs.cmid import AddrInfo, CMID
    import pyverbs.cm_enums as ce
    self._lock = threading.Lock()
    info = AddrInfo(dst=host, service=str(port), port_space=ce.RDMA_PS_TCP)
    self._id = CMID(creator=info, qp_init_attr=_qp_init_attr())
    recv = self._id.reg_msgs(_INFO.size)
    self._id.post_recv(recv)
    self._id.connect()
    token_mr = self._id.reg_msgs(_TOKEN_BYTES)
    token_mr.write(_digest(token), _TOKEN_BYTES, 0)
    self._id.post_send(token_mr)
    _wait(self._id.get_send_comp, "token send")
    _wait(self._id.get_recv_comp, "info receive")
    self._remote, self._rkey, self.size = _INFO.unpack(bytes(recv.read(_INFO.size, 0)))
    self._staging_bytes = staging_bytes
    import pyverbs.enums as e
    self._signaled = e.IBV_SEND_SIGNALED
    self._mr = self._id.reg_msgs(staging_bytes)

  def _check(self, offset: int, n: int) -> None:
    if offset < 0 or offset + n > self.size:
      raise ValueError(f"{n} bytes at {offset} are outside the region of {self.size} bytes")

  def read(self, offset: int, nbytes: int) -> bytes:
    self._check(offset, nbytes)
    out = bytearray()
    with self._lock:
      for start in range(0, nbytes, self._staging_bytes):
        n = min(self._staging_bytes, nbytes - start)
        self._id.post_read(self._mr, n, self._remote + offset + start, self._rkey,
                           flags=self._signaled)
        _wait(self._id.get_send_comp, "read")
        out += bytes(self._mr.read(n, 0))
    return bytes(out)

  def write(self, offset: int, data: bytes) -> None:
    self._check(offset, len(data))
    with self._lock:
      for start in range(0, len(data), self._staging_bytes):
        chunk = bytes(data[start:start + self._staging_bytes])
        self._mr.write(chunk, len(chunk), 0)
        self._id.post_write(self._mr, len(chunk), self._remote + offset + start, self._rkey,
                            flags=self._signaled)
        _wait(self._id.get_send_comp, "write")

  def close(self) -> None:
    with self._lock:
      try:
        self._id.disconnect()
      except Exception:
        pass
      self._mr.close()
      self._id.close()

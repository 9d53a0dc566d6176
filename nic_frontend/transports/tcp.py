"""TCP transport: a relay on the engine host applies a remote frontend's loads and stores.

For hosts without RDMA. The relay holds the mailbox mapping (the engine's shared memory) and
serves one-sided operations over a tiny binary protocol, one TCP connection per frontend
worker; operations of a connection are applied in order, so "payload first, sequence word
last" survives the trip.

Handshake (the token never crosses the wire):
  relay  -> client : b"BLKRELAY" | u32 version | 32-byte nonce | u64 region size
  client -> relay  : HMAC-SHA256(token, b"blink-relay-v1" + nonce)   (32 bytes)
  relay  -> client : u8 1 (accepted) or u8 0 (rejected, then the relay closes)
Operations (client -> relay), a 16-byte header `<B3xIQ`: op, length, offset:
  READ  (1): the relay answers u8 0 and `length` bytes.
  WRITE (2): `length` payload bytes follow; no answer (writes are posted, like RDMA WRITE).
  SYNC  (3): the relay answers u8 0 once every earlier write of the connection is applied.
A rejected operation (out of bounds, not writable, unknown op) is answered with u8 1, u32
message length and the message, and the relay closes the connection; the client raises it at
its next answered operation.

The token authenticates the frontend; the stream itself is neither encrypted nor integrity
protected, so run it on a trusted network (or inside a tunnel).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import socketserver
import struct
import threading
from typing import Callable

import numpy as np

from blink_jax.client import protocol

log = logging.getLogger(__name__)

MAGIC = b"BLKRELAY"
VERSION = 1
OP_READ, OP_WRITE, OP_SYNC = 1, 2, 3
_HELLO = struct.Struct("<8sI32sQ")
_OP = struct.Struct("<B3xIQ")
_ERR = struct.Struct("<BI")
MAX_OP_BYTES = 64 << 20


def _mac(token: str | bytes, nonce: bytes) -> bytes:
  key = token.encode() if isinstance(token, str) else token
  return hmac.new(key, b"blink-relay-v1" + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    k = sock.recv_into(view[got:], n - got)
    if k == 0:
      raise ConnectionError("connection closed by the peer")
    got += k
  return bytes(buf)


def mailbox_write_filter(buf: np.ndarray) -> Callable[[int, int], bool]:
  """Writes a frontend may make: its doorbells, the request side of the slots and the prompt
  arena.

  The header geometry, the engine's control words and every output ring belong to the engine
  and the GPU (one writer per field); the relay refuses to store there.
  """
  from blink_jax.client import mailbox
  h = np.frombuffer(bytes(buf[:protocol.HEADER_BYTES]), protocol.HEADER_DTYPE)[0]
  geo = mailbox.geometry_of(h)
  db0 = protocol.HEADER_DTYPE.fields["doorbell"][1]
  db1 = db0 + 8 * protocol.MAX_WORKERS

  def allowed(offset: int, n: int) -> bool:
    end = offset + n
    if db0 <= offset and end <= db1:
      return True
    if offset < protocol.HEADER_BYTES or end > geo.total_bytes:
      return False
    if offset >= geo.arena_offset:
      return True
    slot = (offset - protocol.HEADER_BYTES) // geo.slot_bytes
    start = geo.request_offset(slot)
    return end <= start + geo.request_bytes
  return allowed


def _store(buf: np.ndarray, offset: int, data: bytes) -> None:
  """Stores `data`; aligned 4- and 8-byte words with a single store (sequence words)."""
  n = len(data)
  if n in (4, 8) and offset % n == 0:
    buf[offset:offset + n].view("<u4" if n == 4 else "<u8")[0] = int.from_bytes(data, "little")
  else:
    buf[offset:offset + n] = np.frombuffer(data, np.uint8)


class TcpRelayServer:
  """Serves a local region (numpy uint8 buffer, e.g. ShmRegion.buf) to remote frontends.

  `writable(offset, n)` restricts stores (default: `mailbox_write_filter` of the header, built
  at the first write, i.e. once the engine wrote its geometry); pass `lambda o, n: True` for a
  raw region.
  """

  def __init__(self, region, token: str | bytes, host: str = "127.0.0.1", port: int = 0, *,
               writable: Callable[[int, int], bool] | None = None,
               handshake_timeout: float = 5.0):
    if not token:
      raise ValueError("the relay needs a non-empty token")
    buf = region.buf if hasattr(region, "buf") else region
    self.buf = np.asarray(buf).view(np.uint8).reshape(-1)
    self.size = int(self.buf.size)
    self._token = token
    self._writable = writable
    self._lock = threading.Lock()
    self._handshake_timeout = handshake_timeout
    relay = self

    class Handler(socketserver.BaseRequestHandler):
      def handle(self):
        relay._serve(self.request, self.client_address)

    class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
      daemon_threads = True
      allow_reuse_address = True
      address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    self._server = Server((host, port), Handler, bind_and_activate=True)
    self.host, self.port = self._server.server_address[:2]
    self._thread: threading.Thread | None = None
    self._conns: set[socket.socket] = set()
    self.connections = 0
    self.rejected = 0

  @property
  def address(self) -> str:
    return f"{self.host}:{self.port}"

  def start(self) -> "TcpRelayServer":
    self._thread = threading.Thread(target=self._server.serve_forever,
                                    kwargs={"poll_interval": 0.1}, name="blink-tcp-relay",
                                    daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    self._server.shutdown()
    self._server.server_close()
    with self._lock:
      conns = list(self._conns)
    for c in conns:
      try:
        c.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    if self._thread is not None:
      self._thread.join(timeout=5)

  def __enter__(self) -> "TcpRelayServer":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def _allowed(self, offset: int, n: int) -> bool:
    if self._writable is None:
      magic = int(self.buf[:8].view("<u8")[0]) if self.size >= protocol.HEADER_BYTES else 0
      if magic != protocol.MAGIC:
        return False  # no geometry yet: nothing is a frontend field
      self._writable = mailbox_write_filter(self.buf)
    return self._writable(offset, n)

  def _serve(self, sock: socket.socket, peer) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with self._lock:
      self._conns.add(sock)
    try:
      sock.settimeout(self._handshake_timeout)
      nonce = os.urandom(32)
      sock.sendall(_HELLO.pack(MAGIC, VERSION, nonce, self.size))
      answer = _recv_exact(sock, 32)
      if not hmac.compare_digest(answer, _mac(self._token, nonce)):
        self.rejected += 1
        log.warning("tcp relay: rejected a client from %s (bad token)", peer)
        sock.sendall(b"\x00")
        return
      sock.sendall(b"\x01")
      sock.settimeout(None)
      self.connections += 1
      self._loop(sock)
    except (ConnectionError, OSError, socket.timeout):
      pass
    finally:
      with self._lock:
        self._conns.discard(sock)
      try:
        sock.close()
      except OSError:
        pass

  def _fail(self, sock: socket.socket, msg: str) -> None:
    data = msg.encode()
    log.warning("tcp relay: %s", msg)
    sock.sendall(_ERR.pack(1, len(data)) + data)
    # Close gracefully: closing with unread input (a payload, pipelined writes) would reset
    # the connection and could destroy the error before the client reads it.
    try:
      sock.shutdown(socket.SHUT_WR)
      sock.settimeout(2.0)
      while sock.recv(65536):
        pass
    except OSError:
      pass

  def _loop(self, sock: socket.socket) -> None:
    buf, size = self.buf, self.size
    while True:
      op, n, off = _OP.unpack(_recv_exact(sock, _OP.size))
      if op == OP_SYNC:
        sock.sendall(b"\x00")
        continue
      if op not in (OP_READ, OP_WRITE):
        return self._fail(sock, f"unknown op {op}")
      if n > MAX_OP_BYTES or off + n > size:
        return self._fail(sock, f"{'read' if op == OP_READ else 'write'} of {n} bytes at "
                                f"{off} is outside the region of {size} bytes")
      if op == OP_READ:
        sock.sendall(b"\x00" + buf[off:off + n].tobytes())
        continue
      data = _recv_exact(sock, n)
      if not self._allowed(off, n):
        return self._fail(sock, f"write of {n} bytes at {off} is not a frontend field")
      _store(buf, off, data)


class RelayError(ConnectionError):
  """The relay refused an operation or the connection broke."""


class TcpRegion:
  """Frontend side: a `Region` whose loads and stores travel to the relay.

  Thread safe (one operation at a time). A broken connection is reported once (RelayError)
  and re-established at the next operation.
  """

  def __init__(self, host: str, port: int, token: str | bytes, *, timeout: float = 10.0):
    self.host, self.port = host, port
    self._token = token
    self._timeout = timeout
    self._lock = threading.Lock()
    self._sock: socket.socket | None = None
    self.size = 0
    with self._lock:
      self._connect()

  def _connect(self) -> None:
    sock = socket.create_connection((self.host, self.port), timeout=self._timeout)
    try:
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      magic, version, nonce, size = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
      if magic != MAGIC or version != VERSION:
        raise RelayError(f"{self.host}:{self.port} is not a blink relay (version {version})")
      sock.sendall(_mac(self._token, nonce))
      if _recv_exact(sock, 1) != b"\x01":
        raise PermissionError(f"the relay at {self.host}:{self.port} rejected the token")
    except BaseException:
      sock.close()
      raise
    self._sock, self.size = sock, int(size)

  def _conn(self) -> socket.socket:
    if self._sock is None:
      self._connect()
    return self._sock

  def _broken(self, e: BaseException) -> RelayError:
    if self._sock is not None:
      try:
        self._sock.close()
      except OSError:
        pass
    self._sock = None
    return e if isinstance(e, RelayError) else RelayError(f"tcp relay connection lost: {e}")

  def _status(self, sock: socket.socket) -> None:
    status = _recv_exact(sock, 1)
    if status != b"\x00":
      (n,) = struct.unpack("<I", _recv_exact(sock, 4))
      raise RelayError("relay: " + _recv_exact(sock, n).decode(errors="replace"))

  def read(self, offset: int, nbytes: int) -> bytes:
    with self._lock:
      try:
        sock = self._conn()
        sock.sendall(_OP.pack(OP_READ, nbytes, offset))
        self._status(sock)
        return _recv_exact(sock, nbytes)
      except (OSError, RelayError) as e:
        raise self._broken(e) from e

  def write(self, offset: int, data: bytes) -> None:
    with self._lock:
      try:
        self._conn().sendall(_OP.pack(OP_WRITE, len(data), offset) + bytes(data))
      except (OSError, RelayError) as e:
        raise self._broken(e) from e

  def sync(self) -> None:
    """Waits until every earlier write reached the region."""
    with self._lock:
      try:
        sock = self._conn()
        sock.sendall(_OP.pack(OP_SYNC, 0, 0))
        self._status(sock)
      except (OSError, RelayError) as e:
        raise self._broken(e) from e

  def close(self) -> None:
    with self._lock:
      if self._sock is not None:
        self._sock.close()
        self._sock = None

  def __repr__(self) -> str:
    return f"TcpRegion({self.host}:{self.port}, size={self.size})"

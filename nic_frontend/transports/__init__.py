"""Transports of the mailbox: one flat byte region, read and written at offsets.

Every transport implements `blink_jax.client.mailbox.Region` (`read(offset, nbytes) -> bytes`,
`write(offset, data)`), so the mailbox protocol above it is the same whether the frontend shares
memory with the engine (shm), reaches it through a relay on the engine host (tcp), or writes
into it with one-sided RDMA (rdma).
"""
from __future__ import annotations

from typing import Any

TRANSPORTS = ("shm", "tcp", "rdma")


def open_transport(kind: str, *, shm_name: str | None = None, address: str | None = None,
                   token: str | None = None) -> Any:
  """The frontend side of a transport: a Region over the engine's mailbox.

  kind "shm": `shm_name` of the engine's POSIX shared memory; "tcp" and "rdma": `address`
  "host:port" of the engine host's relay and its shared `token`.
  """
  if kind == "shm":
    from blink_jax.client import shm
    if not shm_name:
      raise ValueError("the shm transport needs the shared memory name")
    return shm.open_region(shm_name)
  if kind in ("tcp", "rdma"):
    if not address or token is None:
      raise ValueError(f"the {kind} transport needs the relay address host:port and a token")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
      raise ValueError(f"bad relay address {address!r}: expected host:port")
    host = host.strip("[]")
    if kind == "tcp":
      from nic_frontend.transports import tcp
      return tcp.TcpRegion(host, int(port), token)
    from nic_frontend.transports import rdma
    return rdma.RdmaRegion(host, int(port), token)
  raise ValueError(f"unknown transport {kind!r}; one of {', '.join(TRANSPORTS)}")

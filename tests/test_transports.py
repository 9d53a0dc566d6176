"""Transports of the mailbox: POSIX shm, the TCP relay, RDMA (skipped without a device)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from blink_jax.client import mailbox as M
from blink_jax.client import protocol as P
from blink_jax.client import shm
from nic_frontend.transports import open_transport, rdma, tcp
from tests import fake_device as FD

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def region():
  r = shm.create_region(None, 1 << 16)
  yield r
  r.close()
  r.unlink()


# ---- shm ------------------------------------------------------------------------------------

def test_shm_create_open_and_permissions(region):
  assert region.buf.size == region.nbytes == 1 << 16 and not region.buf.any()
  assert region.address % 4096 == 0
  assert shm.exists(region.name)
  mode = stat.S_IMODE(os.stat(f"/dev/shm/{region.name}").st_mode)
  assert mode == 0o600, oct(mode)
  other = shm.open_region(region.name)
  other.write(100, b"hello")
  assert region.read(100, 5) == b"hello"
  region.write(200, (0xDEADBEEF).to_bytes(4, "little"))
  assert other.read(200, 4) == (0xDEADBEEF).to_bytes(4, "little")
  other.close()
  assert other.closed and not region.closed
  with pytest.raises(FileExistsError):
    shm.create_region(region.name, 4096)
  with pytest.raises(ValueError):
    shm.create_region("../etc/passwd", 4096)
  with pytest.raises(FileNotFoundError):
    shm.open_region("blink-no-such-segment")


def test_shm_opener_exit_does_not_unlink(region):
  """A frontend process that opens the segment and exits leaves it alone (no resource tracker
  cleanup); its stores are visible to the engine."""
  code = ("import sys; from blink_jax.client import shm; "
          "r = shm.open_region(sys.argv[1]); r.write(8, b'from-child'); r.close()")
  run = subprocess.run([sys.executable, "-c", code, region.name], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
  assert run.returncode == 0, run.stderr
  assert "resource_tracker" not in run.stderr
  assert shm.exists(region.name)
  assert region.read(8, 10) == b"from-child"


def test_shm_unlink_keeps_mappings():
  r = shm.create_region(None, 4096)
  other = shm.open_region(r.name)
  r.unlink()
  assert not shm.exists(r.name)
  r.write(0, b"still")
  assert other.read(0, 5) == b"still"
  r.unlink()  # idempotent
  other.close()
  r.close()


def test_open_transport_errors():
  with pytest.raises(ValueError, match="shared memory name"):
    open_transport("shm")
  with pytest.raises(ValueError, match="host:port"):
    open_transport("tcp", address="nohost", token="t")
  with pytest.raises(ValueError, match="unknown transport"):
    open_transport("carrier-pigeon")


# ---- tcp relay ------------------------------------------------------------------------------

GEO = P.Geometry(num_slots=4, max_prompt=32, ring_capacity=8, max_top_logprobs=FD.TOP)


@pytest.fixture
def mailbox_region():
  r = shm.create_region(None, GEO.total_bytes)
  M.init_header(r, GEO, vocab_size=320, max_context=64, num_workers=1, eos_id=1)
  yield r
  r.close()
  r.unlink()


@pytest.fixture
def relay(mailbox_region):
  with tcp.TcpRelayServer(mailbox_region, token="s3cret") as server:
    yield server


def test_tcp_read_write_and_sync(relay, mailbox_region):
  remote = tcp.TcpRegion("127.0.0.1", relay.port, "s3cret")
  assert remote.size == GEO.total_bytes
  assert remote.read(0, P.HEADER_BYTES) == mailbox_region.read(0, P.HEADER_BYTES)
  # A frontend field: the request side of slot 1 and worker 0's doorbell.
  off = GEO.request_offset(1) + 16
  remote.write(off, b"\x01\x02\x03\x04\x05\x06\x07\x08\x09")
  db = P.HEADER_DTYPE.fields["doorbell"][1]
  remote.write(db, (7).to_bytes(8, "little"))
  remote.sync()
  assert mailbox_region.read(off, 9) == bytes(range(1, 10))
  assert int.from_bytes(mailbox_region.read(db, 8), "little") == 7
  assert remote.read(off, 9) == bytes(range(1, 10))
  remote.close()


def test_tcp_rejects_bad_token(relay):
  with pytest.raises(PermissionError, match="rejected the token"):
    tcp.TcpRegion("127.0.0.1", relay.port, "wrong")
  assert relay.rejected == 1


@pytest.mark.parametrize("where", ["geometry", "engine_state", "output", "past_end"])
def test_tcp_refuses_fields_that_are_not_the_frontends(relay, mailbox_region, where):
  remote = tcp.TcpRegion("127.0.0.1", relay.port, "s3cret")
  off = {"geometry": 16, "engine_state": P.HEADER_DTYPE.fields["engine_state"][1],
         "output": GEO.output_offset(2), "past_end": GEO.total_bytes - 2}[where]
  before = mailbox_region.read(0, GEO.total_bytes)
  remote.write(off, b"\xff\xff\xff\xff")
  with pytest.raises(tcp.RelayError, match="not a frontend field|outside the region"):
    remote.read(0, 8)
  assert mailbox_region.read(0, GEO.total_bytes) == before
  # The next operation reconnects.
  assert remote.read(0, 8) == mailbox_region.read(0, 8)
  with pytest.raises(tcp.RelayError, match="outside the region"):
    remote.read(GEO.total_bytes - 4, 8)
  remote.close()


def test_tcp_concurrent_users(relay, mailbox_region):
  remote = tcp.TcpRegion("127.0.0.1", relay.port, "s3cret")
  errors = []

  def work(slot):
    try:
      off = GEO.request_offset(slot) + 64
      for i in range(200):
        data = bytes([slot, i % 256]) * 8
        remote.write(off, data)
        assert remote.read(off, 16) == data
    except BaseException as e:  # pragma: no cover - reported below
      errors.append(e)

  threads = [threading.Thread(target=work, args=(s,)) for s in range(GEO.num_slots)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  remote.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_mailbox_client_over_transport(tokenizer_path, transport):
  """The mailbox protocol through each transport against the real scheduler (no HTTP)."""
  dc = FD.DeviceConfig(num_slots=8, max_prompt=32, ring_capacity=8, max_context=64,
                       max_seqs=4, num_pages=32, buckets=(8, 32))
  with FD.running_device(tokenizer_path, dc, eos=False) as fake:
    _mailbox_client_over(transport, fake)


def _mailbox_client_over(transport, fake):
  engine_side, device = fake.region, fake.device
  relay = None
  try:
    if transport == "shm":
      front = shm.open_region(engine_side.name)
    else:
      relay = tcp.TcpRelayServer(engine_side, token="t").start()
      front = tcp.TcpRegion("127.0.0.1", relay.port, "t")
    client = M.MailboxClient(front)
    prompts = [[2, 10, 11], [2] + list(range(20, 40))]
    slots = [client.submit(M.Request(prompt=p, max_tokens=20, ignore_eos=True, logprobs=True,
                                     num_logprobs=2)) for p in prompts]
    got = {s: [] for s in slots}
    done: set[int] = set()
    deadline = time.monotonic() + 30
    while len(done) < len(slots):
      assert time.monotonic() < deadline, "requests did not finish"
      for s in slots:
        if s in done:
          continue
        out = client.poll(s)
        got[s] += out.tokens
        if out.finished:
          assert out.finish_reason == P.Finish.LENGTH
          done.add(s)
          client.release(s)
      time.sleep(0.001)
    for p, s in zip(prompts, slots):
      assert got[s] == device.model.expected(len(p), 20)
    assert int(M.read_header(front)["pages_in_use"]) == 0
    front.close()
  finally:
    if relay is not None:
      relay.stop()


def test_mailbox_client_reclaims_slots_left_by_a_dead_worker(tmp_path):
  """A worker that dies with a request in flight: its successor cancels the request and gets
  the slot back once the device finished it."""
  dc = FD.DeviceConfig(num_slots=2, max_prompt=32, ring_capacity=4, max_context=64,
                       max_seqs=2, num_pages=16, buckets=(8, 32))
  region = shm.create_region(None, dc.geometry.total_bytes)
  device = FD.FakeDevice(region, dc).start()
  try:
    dead = M.MailboxClient(region)
    for _ in range(2):
      dead.submit(M.Request(prompt=[2, 3, 4], max_tokens=50, ignore_eos=True))
    # Nobody reads: the rings fill up and both requests stall on the device.
    successor = M.MailboxClient(region)
    assert successor.stale_slots == 2 and successor.free_slots == 0
    deadline = time.monotonic() + 20
    while successor.reclaim():
      assert time.monotonic() < deadline, "stale slots were not reclaimed"
      time.sleep(0.002)
    assert successor.free_slots == 2
    h = M.read_header(region)
    assert int(h["requests_cancelled"]) == 2 and int(h["pages_in_use"]) == 0
    slot = successor.submit(M.Request(prompt=[2, 3], max_tokens=2, ignore_eos=True))
    while not successor.poll(slot).finished:
      assert time.monotonic() < deadline
      time.sleep(0.001)
  finally:
    device.stop()
    region.close()
    region.unlink()


# ---- rdma -----------------------------------------------------------------------------------

RDMA_OK, RDMA_WHY = rdma.available()


def test_rdma_feature_detection():
  ok, why = rdma.available()
  assert isinstance(ok, bool) and why
  if not ok:
    with pytest.raises(RuntimeError, match="RDMA transport unavailable"):
      rdma.RdmaRegion("127.0.0.1", 1, "t")


@pytest.mark.skipif(not RDMA_OK, reason=f"RDMA transport unavailable here: {RDMA_WHY}")
def test_rdma_loopback(mailbox_region):  # pragma: no cover - needs an RDMA device
  server = rdma.RdmaRegionServer(mailbox_region, token="t", host="127.0.0.1", port=18515).start()
  try:
    remote = rdma.RdmaRegion("127.0.0.1", 18515, "t")
    assert remote.read(0, P.HEADER_BYTES) == mailbox_region.read(0, P.HEADER_BYTES)
    off = GEO.request_offset(0) + 16
    remote.write(off, b"abcdefgh")
    assert mailbox_region.read(off, 8) == b"abcdefgh"
    remote.close()
  finally:
    server.stop()

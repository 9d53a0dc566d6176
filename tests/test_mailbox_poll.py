"""MailboxClient.poll_many's vectorized pick over local memory (blink_jax/client/mailbox.py):
it polls only the slots whose output count or finish moved, and returns exactly what polling
every slot returns."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blink_jax.client import mailbox as M
from blink_jax.client import protocol as P

GEO = P.Geometry(num_slots=24, max_prompt=8, ring_capacity=4, max_top_logprobs=0)


class RemoteLike:
  """The same buffer behind the Region protocol only: poll_many then polls every slot."""

  def __init__(self, local: M.LocalRegion):
    self.local = local

  def read(self, offset: int, nbytes: int) -> bytes:
    return self.local.read(offset, nbytes)

  def write(self, offset: int, data: bytes) -> None:
    self.local.write(offset, data)


def _client(remote: bool) -> M.MailboxClient:
  region = M.LocalRegion(np.zeros(GEO.total_bytes, np.uint8))
  M.init_header(region, GEO, vocab_size=100, max_context=GEO.max_prompt + 1, num_workers=1,
                eos_id=1)
  return M.MailboxClient(RemoteLike(region) if remote else region)


def _device_writes(client: M.MailboxClient, slot: int, produced: int, finished: bool) -> None:
  """What the device writes for the request in `slot`: entries, then count, then finish."""
  words = client.region.local.buf if isinstance(client.region, RemoteLike) else client.region.buf
  words = words.view("<u4")
  seq = client._seq[slot]
  out = GEO.output_offset(slot) // 4
  field = lambda name: out + P.OUTPUT_DTYPE.fields[name][1] // 4  # noqa: E731
  for e in range(int(words[field("count")]), produced):
    words[GEO.out_tokens_offset(slot) // 4 + e % GEO.ring_capacity] = 10 + e
  words[field("started_seq")] = seq
  words[field("count")] = produced
  if finished:
    words[field("finished_seq")] = seq


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.integers(0, 2), st.booleans()),
                min_size=1, max_size=60))
def test_the_pick_returns_what_polling_every_slot_returns(actions):
  """The same device writes on two mailboxes, one local (picked), one behind a plain Region
  (every slot polled): every poll_many returns the same outputs."""
  clients = [_client(remote) for remote in (False, True)]
  slots = [[c.submit(M.Request(prompt=[3, 4], max_tokens=99)) for _ in range(12)]
           for c in clients]
  produced, done, read = [0] * 12, [False] * 12, [0] * 12
  active = [list(ss) for ss in slots]
  for k, more, finish in actions:
    if done[k]:
      continue
    # A ring holds ring_capacity unread entries: the device never writes past it.
    produced[k] += min(more, GEO.ring_capacity - (produced[k] - read[k]))
    done[k] = finish
    for c, ss in zip(clients, slots):
      _device_writes(c, ss[k], produced[k], finish)
    got = [c.poll_many(a) for c, a in zip(clients, active)]
    assert [(s, o.tokens, o.finished) for s, o in got[0]] == \
           [(s, o.tokens, o.finished) for s, o in got[1]]
    for c, out, a, ss in zip(clients, got, active, slots):
      for s, o in out:
        read[ss.index(s)] = o.produced
        if o.finished:  # as the driver does: released, out of flight
          c.release(s)
          a.remove(s)


def test_only_slots_with_news_are_polled(monkeypatch):
  client = _client(remote=False)
  slots = [client.submit(M.Request(prompt=[3], max_tokens=9)) for _ in range(20)]
  for s in slots:
    _device_writes(client, s, 0, False)  # taken, nothing produced yet
  _device_writes(client, slots[3], 2, False)
  _device_writes(client, slots[7], 1, True)
  polled = []
  real = client.poll
  monkeypatch.setattr(client, "poll", lambda s: polled.append(s) or real(s))
  got = client.poll_many(slots)
  assert polled == [slots[3], slots[7]]
  assert [(s, o.tokens, o.finished) for s, o in got] == [(slots[3], [10, 11], False),
                                                          (slots[7], [10], True)]
  client.release(slots[7])  # as the driver does with a finished request
  rest = [s for s in slots if s != slots[7]]
  assert client.poll_many(rest) == [] and polled == [slots[3], slots[7]]  # all read now

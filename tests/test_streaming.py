"""Incremental detokenization and stop strings with hold-back (nic_frontend.streaming)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blink_jax.client import protocol as P
from blink_jax.client.tokenizer import Tokenizer
from blink_jax.client.streaming import ChoiceDecoder, DeviceError, StopMatcher, token_info


@pytest.fixture(scope="module")
def tok(tokenizer_path) -> Tokenizer:
  return Tokenizer(str(tokenizer_path))


# ---- StopMatcher ----------------------------------------------------------------------------

def _run(stops, chunks):
  m = StopMatcher(stops)
  outs = [m.push(c) for c in chunks]
  outs.append(m.flush())
  return outs, m.matched


def _expected(stops, text):
  """The text up to the stop string that completes first (then: starts first)."""
  hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
  if not hits:
    return text, None
  return text[:min(hits)[1]], True


def test_stop_matcher_basics():
  outs, matched = _run(["STOP"], ["hello S", "T", "O", "P and more"])
  assert "".join(outs) == "hello " and matched == "STOP"
  # The held-back prefix is released when it turns out not to be a stop string.
  outs, matched = _run(["STOP"], ["hello S", "T", "x"])
  assert outs == ["hello ", "", "STx", ""] and matched is None
  # Held text at the end of the output is released by flush().
  outs, matched = _run(["STOP"], ["abc ST"])
  assert outs == ["abc ", "ST"] and matched is None
  # The stop string that completes first wins; nothing after a match.
  outs, matched = _run(["world", "lo w"], ["hello world", "!!"])
  assert "".join(outs) == "hel" and matched == "lo w"
  outs, matched = _run(["T", "SSTS"], ["SSSSTS"])
  assert "".join(outs) == "SSSS" and matched == "T"
  assert _run([], ["a", "b"])[0] == ["a", "b", ""]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet="abcST é🙂", max_size=40), data=st.data())
def test_stop_matcher_never_leaks(text, data):
  """Whatever the chunking: the output is the text up to the first stop string, and every
  emitted prefix is a prefix of that (no part of a stop string is ever sent)."""
  n_stops = data.draw(st.integers(0, 3))
  stops = []
  for _ in range(n_stops):
    if text and data.draw(st.booleans()):
      i = data.draw(st.integers(0, len(text) - 1))
      j = data.draw(st.integers(i + 1, min(len(text), i + 6)))
      stops.append(text[i:j])
    else:
      stops.append(data.draw(st.text(alphabet="abcST é🙂", min_size=1, max_size=4)))
  cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
  chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
  want, hit = _expected(stops, text)
  m = StopMatcher(stops)
  sent = ""
  for c in chunks:
    sent += m.push(c)
    assert want.startswith(sent), (stops, chunks, sent)
  sent += m.flush()
  assert sent == want
  assert (m.matched is not None) == bool(hit)


# ---- ChoiceDecoder --------------------------------------------------------------------------

def test_decoder_streams_text_without_splitting_characters(tok):
  text = "crème brûlée 🙂 東京 done"
  ids = tok.encode(text)
  assert any(tok.sp.is_byte(i) for i in ids), "the story must exercise byte fallback"
  d = ChoiceDecoder(tok)
  pieces = [d.feed([t]) for t in ids]
  pieces.append(d.feed([], finished=True, finish=P.Finish.LENGTH))
  assert "".join(p.text for p in pieces) == text == d.text
  assert not any("\ufffd" in p.text for p in pieces)
  assert d.finish_reason == "length" and d.tokens == ids
  # A multi-byte character arrives whole or not at all.
  emoji = [tok.sp.piece_to_id(f"<0x{b:02X}>") for b in "🙂".encode()]
  d = ChoiceDecoder(tok)
  assert [d.feed([t]).text for t in emoji] == ["", "", "", "🙂"]


@pytest.mark.parametrize("stop", ["brûlée", "ûl", "🙂 東", "e b", "done"])
def test_decoder_stop_string_across_tokens(tok, stop):
  text = "crème brûlée 🙂 東京 done and more"
  ids = tok.encode(text)
  for batch in (1, 3, 7):
    d = ChoiceDecoder(tok, [stop])
    sent = []
    for i in range(0, len(ids), batch):
      p = d.feed(ids[i:i + batch])
      sent.append(p.text)
      assert len(p.tokens) == len(p.logprobs) or not p.logprobs
      if d.done:
        break
    assert d.done and d.finish_reason == "stop" and d.stopped_by_string
    want = text[:text.index(stop)]
    assert "".join(sent) == want and not any(stop in s for s in sent)
    # Tokens count up to the one that completed the stop string, no further.
    assert tok.decode(d.tokens).find(stop) >= 0
    assert tok.decode(d.tokens[:-1]).find(stop) < 0


def test_decoder_finishes(tok):
  ids = tok.encode("hello world")
  d = ChoiceDecoder(tok)
  p = d.feed(ids + [tok.eos_id], [-1.0] * (len(ids) + 1), [], finished=True,
             finish=P.Finish.STOP)
  assert p.text == "hello world" and p.finish_reason == "stop" and len(p.tokens) == len(ids) + 1
  # A stop string held back at the finish is released when it is not completed.
  d = ChoiceDecoder(tok, ["world!"])
  assert d.feed(ids).text == "hello "
  assert d.feed([], finished=True, finish=P.Finish.LENGTH).text == "world"
  # Cut in the middle of a character: the incomplete tail decodes as U+FFFD at the end.
  first = [tok.sp.piece_to_id(f"<0x{b:02X}>") for b in "🙂".encode()][:2]
  d = ChoiceDecoder(tok)
  assert d.feed(first).text == ""
  assert d.feed([], finished=True, finish=P.Finish.LENGTH).text.startswith("\ufffd")
  # A device error surfaces as DeviceError.
  with pytest.raises(DeviceError, match="top_p"):
    ChoiceDecoder(tok).feed([], finished=True, finish=P.Finish.ERROR, error=P.Error.TOP_P)
  # Output after the end is ignored.
  assert d.feed([5, 6]).tokens == []


def test_token_info(tok):
  b = tok.sp.piece_to_id("<0xC3>")
  assert token_info(tok, b) == ("bytes:\\xc3", [0xC3])
  assert token_info(tok, tok.eos_id) == ("", [])
  i = tok.encode("hello")[0]
  text, raw = token_info(tok, i)
  assert text and raw == list(text.encode())

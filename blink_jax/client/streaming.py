"""Output text of a request: incremental detokenization and stop strings with hold-back.

A slot's output ring yields token ids in batches (`blink_jax.client.mailbox.Output`).
`ChoiceDecoder` turns each batch into the text that may be sent now:

* the incremental detokenizer never emits part of a UTF-8 character (byte-fallback tokens are
  held until the character is complete);
* text that could still become a stop string is held back, so no part of a stop string ever
  reaches the client; when a stop string completes, the text is cut before it, the tokens after
  the one that completed it are dropped, and the choice ends with finish_reason "stop" (the
  caller cancels the request on the device).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from blink_jax.client import protocol


class StopMatcher:
  """Finds the first stop string to complete in a stream of text deltas.

  push() returns the text that is safe to emit: everything except a tail that is a proper
  prefix of some stop string (it may still become one). Once a stop string completes, push()
  returns the text before it and `matched` is set; later pushes return "".
  """

  def __init__(self, stops: Sequence[str] = ()):
    self.stops = tuple(s for s in stops if s)
    self._longest = max((len(s) for s in self.stops), default=0)
    self._pending = ""
    self.matched: str | None = None

  @property
  def held(self) -> str:
    return self._pending

  def push(self, text: str) -> str:
    if self.matched is not None:
      return ""
    if not self.stops:
      return text
    pending = self._pending + text
    # The stop string that completes first (smallest end; then the earliest start): what a
    # token-by-token check sees, so the result does not depend on how the text was chunked.
    first, which, best = -1, None, None
    for s in self.stops:
      i = pending.find(s)
      if i >= 0 and (best is None or (i + len(s), i) < best):
        first, which, best = i, s, (i + len(s), i)
    if which is not None:
      self.matched = which
      self._pending = ""
      return pending[:first]
    hold = 0
    for k in range(min(len(pending), self._longest - 1), 0, -1):
      tail = pending[-k:]
      if any(s.startswith(tail) for s in self.stops):
        hold = k
        break
    self._pending = pending[len(pending) - hold:] if hold else ""
    return pending[:len(pending) - hold]

  def flush(self) -> str:
    """At the end of the output: the held tail was not a stop string after all."""
    out, self._pending = ("" if self.matched is not None else self._pending), ""
    return out


FINISH_REASONS = {protocol.Finish.STOP: "stop", protocol.Finish.LENGTH: "length"}


class _NoText:
  """The detokenizer of a choice without a tokenizer."""

  def push(self, token: int) -> str:
    return ""

  def flush(self) -> str:
    return ""


class DeviceError(Exception):
  """The device finished the request with an error (it rejected a field)."""

  def __init__(self, finish: protocol.Finish, error: protocol.Error):
    self.finish, self.error = finish, error
    if finish == protocol.Finish.ERROR:
      msg = protocol.ERROR_MESSAGES.get(
          error, f"request rejected by the engine (error {int(error)})")
    else:
      msg = "the request was cancelled by the engine"
    super().__init__(msg)


@dataclasses.dataclass
class Piece:
  """What one batch of output adds to a choice."""
  text: str
  tokens: list[int]
  logprobs: list[float]
  top: list[list[tuple[int, float]]]
  finish_reason: str | None = None


class ChoiceDecoder:
  """One choice's output: token batches in, text pieces out (see the module docstring).

  `tokens` are the tokens that count for the client (usage.completion_tokens, logprobs): all
  the device produced, up to and including the one that completed a stop string. Without a
  tokenizer (an engine fed token ids only) there is no text, so no stop string matches.
  The HTTP frontend and `Engine.generate` both stream through this class.
  """

  def __init__(self, tokenizer, stop: Sequence[str] = ()):
    self._detok = tokenizer.detokenizer() if tokenizer is not None else _NoText()
    self._stop = StopMatcher(stop)
    self.tokens: list[int] = []
    self.text_parts: list[str] = []
    self.finish_reason: str | None = None
    self.stopped_by_string = False

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def text(self) -> str:
    return "".join(self.text_parts)

  def feed(self, tokens: Sequence[int], logprobs: Sequence[float] = (),
           top: Sequence = (), finished: bool = False,
           finish: protocol.Finish = protocol.Finish.NONE,
           error: protocol.Error = protocol.Error.NONE) -> Piece:
    """Adds a batch of output (and its finish, if the device finished the request)."""
    if self.done:
      return Piece("", [], [], [], None)
    out: list[str] = []
    n_used = 0
    for t in tokens:
      n_used += 1
      out.append(self._stop.push(self._detok.push(t)))
      if self._stop.matched is not None:
        self.finish_reason = "stop"
        self.stopped_by_string = True
        break
    used = list(tokens[:n_used])
    if finished and not self.done:
      if finish not in FINISH_REASONS:
        raise DeviceError(finish, error)
      # The end of the output: what the detokenizer held (an incomplete character decodes to
      # U+FFFD) and what the stop matcher held may go out now.
      out.append(self._stop.push(self._detok.flush()))
      if self._stop.matched is not None:
        self.finish_reason, self.stopped_by_string = "stop", True
      else:
        out.append(self._stop.flush())
        self.finish_reason = FINISH_REASONS[finish]
    text = "".join(out)
    self.tokens += used
    self.text_parts.append(text)
    return Piece(text, used, list(logprobs[:n_used]), list(top[:n_used]), self.finish_reason)


@functools.lru_cache(maxsize=8)
def _token_table(tokenizer) -> dict:
  return {}


def token_info(tokenizer, token_id: int) -> tuple[str, list[int]]:
  """(text, UTF-8 bytes) of one token, for logprobs.

  A byte-fallback token that is not a whole character is shown as "bytes:\\xNN" with its byte,
  as OpenAI-compatible servers do; control tokens (<eos>, turn markers) have empty text.
  """
  table = _token_table(tokenizer)
  hit = table.get(token_id)
  if hit is not None:
    return hit
  sp = tokenizer.sp
  token_id = int(token_id)
  if 0 <= token_id < tokenizer.vocab_size and sp.is_byte(token_id):
    b = int(sp.id_to_piece(token_id)[3:5], 16)
    info = (chr(b), [b]) if b < 0x80 else (f"bytes:\\x{b:02x}", [b])
  elif 0 <= token_id < tokenizer.vocab_size and (sp.is_control(token_id)
                                                 or sp.is_unknown(token_id)):
    info = ("", [])
  else:
    text = tokenizer.decode([token_id])
    info = (text, list(text.encode("utf-8")))
  if len(table) < 1_000_000:
    table[token_id] = info
  return info

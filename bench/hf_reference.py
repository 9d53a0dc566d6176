"""External reference: single-stream greedy decode of Hugging Face transformers (PyTorch) in the
same model shape with random weights, on the same GPU.

Static KV cache (cache_implementation="static"). With a compileable cache on CUDA,
`generate` compiles the decoding forward itself (transformers' automatic compilation, CUDA
graphs through mode "reduce-overhead" by default): `--compile auto` is that default, `eager`
turns it off (`disable_compile`), any other name is a torch.compile mode passed as
`compile_config` (wrapping model.forward in torch.compile by hand on top of the automatic
compilation fails: "accessing tensor output of CUDAGraphs that has been overwritten"). Reports
per-token decode latency (median over --repeats generations of --tokens new tokens after a
--prompt-token prompt, the prefill excluded by timing a 1-token generation separately).

  python -m bench.hf_reference --config gemma3-1b --prompt 1024 --tokens 128
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
from absl import app, flags

from bench import common as C

FLAGS = flags.FLAGS


def define_flags():
  """Defined when run as a script only: tests import this module beside other absl scripts."""
  flags.DEFINE_string("config", "gemma3-1b", "blink_jax model config name (the shape)")
  flags.DEFINE_integer("prompt", 1024, "prompt tokens")
  flags.DEFINE_integer("tokens", 128, "new tokens per generation")
  flags.DEFINE_integer("repeats", 5, "timed generations")
  flags.DEFINE_list("compile", ["eager", "auto", "max-autotune"],
                    "'eager', 'auto' (transformers' automatic compilation) or torch.compile modes")
  flags.DEFINE_string("device", "cuda", "torch device ('cpu' only checks that the script runs)")
  flags.DEFINE_string("out", "bench/results/hf_reference.json", "JSON result file")


def hf_config(cfg):
  """The transformers Gemma 3 text config of a blink_jax ModelConfig (same shape; RoPE and
  other details that do not change the cost are left at transformers' defaults)."""
  from transformers import Gemma3TextConfig
  return Gemma3TextConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffw_hidden,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      query_pre_attn_scalar=int(cfg.query_pre_attn_scalar), sliding_window=cfg.sliding_window,
      layer_types=["full_attention" if cfg.is_global(i) else "sliding_attention"
                   for i in range(cfg.num_layers)],
      max_position_embeddings=8192, tie_word_embeddings=True)


@contextlib.contextmanager
def gguf_parsed_once(gguf_file):
  """While open, `gguf.GGUFReader` parses this file's metadata once: transformers' GGUF loads
  (its tokenizer, its config, its tensors) each parse all of it, Gemma's 262k-token vocabulary
  included (about 25 s on 2 cores). Other files are read as usual."""
  import functools
  import os
  import pathlib
  from unittest import mock

  import gguf
  path = pathlib.Path(gguf_file).resolve()
  real = gguf.GGUFReader
  parsed = functools.lru_cache(maxsize=1)(real)

  def reader(p, *args, **kw):
    if not args and not kw and pathlib.Path(os.fspath(p)).resolve() == path:
      return parsed(str(path))
    return real(p, *args, **kw)

  with mock.patch.object(gguf, "GGUFReader", reader):
    yield


def hf_gemma_from_gguf(gguf_file, dtype):
  """transformers' Gemma3ForCausalLM with the weights transformers itself reads from a GGUF:
  (model, the state dict's tensors).

  `from_pretrained(dir, gguf_file=...)` needs the `accelerate` package, which is not a
  dependency here, so the same steps are taken by hand: the config from the GGUF
  (AutoConfig), a model from it, and the state dict from transformers' own GGUF loader
  (load_gguf_checkpoint: its own dequantization and its own undoing of llama.cpp's +1 on
  norms). The tied output layer is the embedding."""
  import pathlib

  import torch
  import transformers
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  gguf_file = pathlib.Path(gguf_file)
  with gguf_parsed_once(gguf_file):  # the config and the tensors: two reads of the file
    hf_cfg = transformers.AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True,
                                   model_to_load=model)["tensors"]
  result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()},
                                 strict=False)
  if result.missing_keys != ["lm_head.weight"] or result.unexpected_keys:
    raise ValueError(f"unexpected GGUF state dict: missing {result.missing_keys}, "
                     f"unexpected {result.unexpected_keys}")
  model.tie_weights()
  if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
    raise ValueError("the output layer is not tied to the embedding")
  return model.to(dtype), tensors


def generate_compile_kwargs(mode: str) -> dict:
  """generate() arguments that select how transformers compiles the decoding forward."""
  if mode == "eager":
    return {"disable_compile": True}
  if mode == "auto":
    return {}
  from transformers import CompileConfig
  return {"compile_config": CompileConfig(mode=mode)}


def timed_generate(model, ids, n: int, sync=lambda: None, **kwargs) -> float:
  """Seconds `model.generate` takes to add exactly `n` tokens to `ids` (a batch): greedy
  unless kwargs sample (do_sample=True with its parameters)."""
  import torch
  kwargs.setdefault("do_sample", False)
  sync()
  t = time.perf_counter()
  with torch.inference_mode():
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
  sync()
  assert out.shape[1] == ids.shape[1] + n
  return time.perf_counter() - t


def main(argv):
  del argv
  import torch
  from transformers import Gemma3ForCausalLM

  from blink_jax.model.config import get_config
  cfg = get_config(FLAGS.config)
  torch.manual_seed(0)
  model = Gemma3ForCausalLM(hf_config(cfg)).to(FLAGS.device, torch.bfloat16).eval()
  prompt = torch.randint(3, cfg.vocab_size, (1, FLAGS.prompt), device=FLAGS.device)
  sync = torch.cuda.synchronize if FLAGS.device.startswith("cuda") else (lambda: None)
  rows = []
  for mode in FLAGS.compile:
    compile_kwargs = generate_compile_kwargs(mode)

    def gen(n):
      return timed_generate(model, prompt, n, sync, cache_implementation="static",
                            **compile_kwargs)

    try:
      gen(1), gen(FLAGS.tokens)  # warm-up (and compilation) of both lengths timed below:
      # a compiled generate may compile again for another max_new_tokens, and that compile
      # inside gen(1) once made the per-token figure negative
      per_token = []
      for _ in range(FLAGS.repeats):
        first, full = gen(1), gen(FLAGS.tokens)
        per_token.append((full - first) / (FLAGS.tokens - 1) * 1e3)
      rows.append({"impl": "transformers", "compile": mode, "batch": 1,
                   **C.stats(per_token, "ms_per_token"),
                   "tokens_per_s": 1e3 / float(np.median(per_token))})
    except Exception as e:  # a compile mode that fails is reported, not fatal
      rows.append({"impl": "transformers", "compile": mode, "error": repr(e)[:300]})
    print(rows[-1], flush=True)
  import transformers
  print(C.table(rows, ["impl", "compile", "batch", "ms_per_token_median", "ms_per_token_min",
                       "ms_per_token_max", "tokens_per_s"]))
  C.write_result(FLAGS.out, "hf_reference", rows,
                 {"config": FLAGS.config, "prompt": FLAGS.prompt, "tokens": FLAGS.tokens,
                  "torch": torch.__version__, "transformers": transformers.__version__})


if __name__ == "__main__":
  define_flags()
  app.run(main)

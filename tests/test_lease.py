"""bench/lease.sh, the multi-call lease, on a fake tree: one build, the plan's runs in order
with their environments intact, a vLLM run held until the install (our attention kernels
alone not), each run's results brought back by `collect` (docs/PERFORMANCE.md, "Serving at
real scale")."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_GPU_CHECK = r'''#!/usr/bin/env bash
mkdir -p "$OUT"
if [[ $1 == build ]]; then echo built > "$OUT/built"; exit 0; fi
RECIPE_RUN=$1 python3 -c "import json, os; json.dump({k: os.environ.get(k) for k in
  ('RECIPE_RUN', 'MODES', 'TAG', 'SERVE_ARGS', 'BUILD', 'SHAPES', 'MIXED')},
  open(os.environ['OUT'] + '/run.json', 'w'))"
sleep 0.2
'''

FAKE_INSTALL = r'''#!/usr/bin/env bash
set -e
test -f .whl/SHA256SUMS && ls "$WH"/vllm026.tar.xz.part-03 && echo "vllm 0.26.0 imports"
'''

PLAN = """# name | environment
ours | MODES=persistent TAG=s1
mine | RECIPE=attention ATTN_VARIANTS=ours TAG=s1   # our kernels alone: no vLLM to wait for
vllm | MODES=vllm TAG=s1   # waits for the install
f20  | MODES=persistent TAG=s1f20 SERVE_ARGS="--step_interval_factor 2.0 --x 1"
prof | RECIPE=mixed_profile MIXED=1024:8
"""


def _tree(tmp_path: Path) -> Path:
  tree = tmp_path / "src"
  (tree / "bench").mkdir(parents=True)
  shutil.copy(ROOT / "bench" / "lease.sh", tree / "bench" / "lease.sh")
  (tree / "bench" / "gpu_check.sh").write_text(FAKE_GPU_CHECK)
  (tree / "bench" / "vllm_install.sh").write_text(FAKE_INSTALL)
  (tree / "plan.txt").write_text(PLAN)
  (tree / ".whl").mkdir()
  for k in range(4):
    (tree / ".whl" / f"vllm026.tar.xz.part-0{k}").write_bytes(b"part")
  (tree / ".whl" / "SHA256SUMS").write_text("sums")
  return tree


def test_a_plan_runs_in_order_and_each_run_comes_back(tmp_path):
  tree = _tree(tmp_path)
  out = tmp_path / "out"
  out.mkdir()
  env = dict(os.environ, LEASE_TREE=str(tmp_path / "copy"), LEASE_DIR=str(tmp_path / "lease"),
             WH=str(tmp_path / "wh"), OUT=str(out), SHAPES="gemma3-1b")

  def lease(*args, timeout=60):
    r = subprocess.run(["bash", str(tree / "bench" / "lease.sh"), *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout

  assert "started plan.txt" in lease("start", "plan.txt")
  try:
    assert "== ours: done" in lease("collect", "ours", "30")
    assert "== mine: done" in lease("collect", "mine", "30")
    # The vLLM run waits: nothing installed yet.
    assert "start vllm" not in (tmp_path / "lease" / "progress").read_text()
    lease("part")
    assert "vllm 0.26.0 imports" in lease("install")
    lease("collect", "vllm", "30")
    assert "== f20: done" in lease("collect", "f20", "30")
    assert "== prof: done" in lease("collect", "prof", "30")
  finally:
    lease("stop")  # a failed check leaves no plan waiting in the background

  steps = [line.split(" ", 1)[1] for line in
           (tmp_path / "lease" / "progress").read_text().splitlines()]
  assert steps == ["plan plan.txt", "build", "build rc=0", "start ours", "end ours rc=0",
                   "start mine", "end mine rc=0", "install rc=0", "start vllm",
                   "end vllm rc=0", "start f20", "end f20 rc=0", "start prof", "end prof rc=0",
                   "plan done", "stopped"]
  got = {}
  for name in ("ours", "mine", "vllm", "f20", "prof"):
    with tarfile.open(out / f"{name}.tgz") as t:
      got[name] = json.load(t.extractfile(f"out/{name}/run.json"))
  assert got["ours"] == {"RECIPE_RUN": "serving", "MODES": "persistent", "TAG": "s1",
                         "SERVE_ARGS": None, "BUILD": "0", "SHAPES": "gemma3-1b", "MIXED": None}
  assert got["mine"]["RECIPE_RUN"] == "attention"
  assert got["vllm"]["MODES"] == "vllm"
  assert got["f20"]["SERVE_ARGS"] == "--step_interval_factor 2.0 --x 1"
  assert (got["prof"]["RECIPE_RUN"], got["prof"]["MIXED"]) == ("mixed_profile", "1024:8")
  assert (tmp_path / "lease" / "out" / "build" / "built").exists()


def _recipes(out: Path) -> set[str]:
  """The recipes `bash bench/gpu_check.sh list` names, and its A/B (its call folder: out)."""
  listed = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "list"], check=True,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(out)}).stdout
  return {line.split()[0] for line in listed.splitlines() if line.strip()} | {"ab"}


def test_the_committed_plans_name_real_recipes_and_sides(tmp_path):
  """Every line of bench/plans/*.txt, read as lease.sh reads it, is shell assignments that
  name recipes gpu_check.sh has, and an A/B gives each of its sides its own AB_ARGS_<side>
  (gpu_check.sh reads no plain AB_ARGS: such a side would run with no arguments)."""
  recipes = _recipes(tmp_path)
  assert {"serving", "ab", "attention", "tests", "mixed_profile"} <= recipes
  plans = sorted((ROOT / "bench" / "plans").glob("*.txt"))
  assert plans
  for plan in plans:
    runs = 0
    for line in plan.read_text().splitlines():
      line = line.split("#", 1)[0]
      if "|" not in line:
        continue
      name, words = line.split("|", 1)
      env = dict(w.split("=", 1) for w in shlex.split(words))  # a word without = fails here
      runs += 1
      where = f"{plan.name}: {name.strip()}"
      for key in ("RECIPE", "AB_RECIPE"):
        assert env.get(key, "serving") in recipes, where
      if env.get("RECIPE") == "ab":
        sides = [s.split("=", 1)[0] for s in env["AB"].split()]
        assert "AB_ARGS" not in env, where
        if any(k.startswith("AB_ARGS_") for k in env):
          assert {f"AB_ARGS_{s}" for s in sides} <= set(env), where
    assert runs, plan.name

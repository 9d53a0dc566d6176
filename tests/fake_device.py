"""A fake device loop: the real scheduler (C++ through ctypes) and a fake model, in a thread.

It plays the GPU's part of the mailbox protocol without JAX: loop schedule -> model -> commit
over a mailbox region until stopped, exactly what the persistent device program does, so the
frontend can be tested end to end over any transport.

Models (deterministic, so tests know the expected output):
  StoryModel  the k-th generated token of a prompt of L tokens is story[(L + k) % len(story)]
              (a fixed token sequence: text with multi-byte characters, and <eos> at its end);
  HashModel   sched_harness.FakePagedModel (next token = hash of the whole sequence).
Both report logprob(t) = -0.5 - (t % 7) and top alternatives (t + j) % vocab with
logprob(t) - j, like the scheduler tests' model.

Also here: `tiny_tokenizer()` trains a small SentencePiece model shaped like Gemma's (ids 0..3 =
<pad> <eos> <bos> <unk>, <start_of_turn>/<end_of_turn> control pieces, byte fallback, no
normalization), and `FakeEngine`, the engine API the serving supervisor drives, over the fake device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np

from blink_jax.native import batch as B
from blink_jax.client import mailbox as M
from blink_jax.client import protocol as P
from blink_jax.native.ffi import SchedConfig
from tests.host_scheduler import HostScheduler

TOP = 4  # top-logprob alternatives the fake models report (= geometry max_top_logprobs)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A stitch in time saves nine.
Hello world! This is a tiny corpus for a tiny tokenizer used by the frontend tests.
Streaming text arrives token by token, and stop strings must never leak to the client.
Once upon a time there was a server that answered every request with a story.
The engine runs on the device; the frontend parses, validates, tokenizes and streams.
Numbers like 12345 and 3.14159 appear too, as do questions? And exclamations!
user model assistant system: the chat template wraps every turn.
""" * 3

STORY = ("Once upon a time, a café served crème brûlée to 🙂 travellers. The end is near. "
         "日本語 text follows: 東京. STOP here. Then more words arrive, ünïcödé and emoji 🎉🎉. "
         "The quick brown fox jumps over the lazy dog again and again. ")


def tiny_tokenizer(directory: pathlib.Path, vocab_size: int = 320) -> pathlib.Path:
  """Trains (once per directory) and returns the path of a tiny Gemma-shaped SentencePiece
  model."""
  import sentencepiece as spm

  directory = pathlib.Path(directory)
  model = directory / "tiny.model"
  if model.exists():
    return model
  directory.mkdir(parents=True, exist_ok=True)
  corpus = directory / "corpus.txt"
  corpus.write_text(CORPUS)
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(directory / "tiny"), vocab_size=vocab_size,
      model_type="bpe", character_coverage=1.0, byte_fallback=True,
      pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
      bos_piece="<bos>", unk_piece="<unk>",
      control_symbols=["<start_of_turn>", "<end_of_turn>"],
      normalization_rule_name="identity", add_dummy_prefix=False,
      remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
      num_threads=1, minloglevel=2)
  return model


def _top(sampled: np.ndarray, vocab: int):
  lps = (-0.5 - (sampled % 7)).astype(np.float32)
  top_ids = ((sampled[:, None] + np.arange(TOP)[None, :]) % vocab).astype(np.int32)
  top_lps = (lps[:, None] - np.arange(TOP)[None, :]).astype(np.float32)
  return lps, top_ids, top_lps


class StoryModel:
  """Token k of a prompt of L tokens: story[(L + k) % len(story)] (depends on L alone)."""

  def __init__(self, cfg: SchedConfig, story: list[int]):
    self.cfg = cfg
    self.story = np.asarray(story, np.int64)

  def expected(self, prompt_len: int, n: int) -> list[int]:
    return [int(self.story[(prompt_len + k) % len(self.story)]) for k in range(n)]

  def step(self, words: np.ndarray, page_table: np.ndarray):
    cfg = self.cfg
    ns = int(words[B.NUM_SAMPLES])
    sampled = np.zeros(cfg.max_seqs, np.int32)
    if ns:
      b = B.split(words, cfg.token_budget, cfg.max_seqs, int(words[B.BUCKET_SIZE]), ns)
      pos = np.asarray(b.position[:ns], np.int64)  # length of the sequence before the sample
      sampled[:ns] = self.story[pos % len(self.story)]
    lps, top_ids, top_lps = _top(sampled.astype(np.int64), cfg.vocab_size)
    return sampled, lps, top_ids, top_lps


@dataclasses.dataclass
class DeviceConfig:
  num_slots: int = 80
  max_prompt: int = 192
  ring_capacity: int = 32
  vocab_size: int = 320
  max_context: int = 256
  max_seqs: int = 16
  page_size: int = 16
  num_pages: int = 16 * 16
  buckets: tuple[int, ...] = (16, 64, 256)
  eos_ids: tuple[int, ...] = (1,)
  num_workers: int = 1
  idle_poll_us: int = 2000

  @property
  def geometry(self) -> P.Geometry:
    return P.Geometry(self.num_slots, self.max_prompt, self.ring_capacity, TOP)


class FakeDevice:
  """The device loop in a thread, over `region` (anything with a numpy `.buf` or a LocalRegion).

  Writes the header (engine side), sets READY when started (unless ready=False), and records
  every request it sees published (`requests`: slot, seq and the request's fields).
  """

  def __init__(self, region, dc: DeviceConfig, *, model: str = "story",
               story: list[int] | None = None, ready: bool = True):
    self.dc = dc
    self.region = region if isinstance(region, M.LocalRegion) else M.LocalRegion(region.buf)
    geo = dc.geometry
    assert self.region.buf.size >= geo.total_bytes
    M.init_header(self.region, geo, vocab_size=dc.vocab_size, max_context=dc.max_context,
                  num_workers=dc.num_workers, eos_id=dc.eos_ids[0])
    self.cfg = SchedConfig.build(
        mailbox=self.region.address, num_slots=geo.num_slots, max_prompt=geo.max_prompt,
        ring_capacity=geo.ring_capacity, max_top_logprobs=geo.max_top_logprobs,
        vocab_size=dc.vocab_size, max_seqs=dc.max_seqs, max_context=dc.max_context,
        page_size=dc.page_size, num_pages=dc.num_pages, buckets=dc.buckets,
        eos_ids=dc.eos_ids, idle_poll_us=dc.idle_poll_us)
    self.sched = HostScheduler(self.cfg)
    if model == "story":
      self.model = StoryModel(self.cfg, story if story is not None else [5, 6, 7])
    else:
      from tests.sched_harness import FakePagedModel
      self.model = FakePagedModel(self.cfg)
    self.geo = geo
    self.requests: list[dict] = []
    self.steps = 0
    self.step_delay_s = 0.0
    self.error: BaseException | None = None
    self._ready = ready
    self._crash: BaseException | None = None
    self._run = threading.Event()
    self._run.set()
    self._stop = threading.Event()
    self._seen = np.zeros(geo.num_slots, np.int64)
    # every slot's request `seq` as one strided view: a doorbell costs one vector compare,
    # not a Python pass over every slot
    assert geo.slot_bytes % 4 == 0
    words = self.region.buf[:geo.arena_offset].view("<u4")
    self._seqs = words[(geo.request_offset(0) + P.REQUEST_DTYPE.fields["seq"][1]) // 4::
                       geo.slot_bytes // 4][:geo.num_slots]
    self._doorbells = -1
    self._thread = threading.Thread(target=self._loop, name="fake-device", daemon=True)

  # ---- control ----
  def start(self) -> "FakeDevice":
    if self._ready:
      self.set_state(P.EngineState.READY)
    self._thread.start()
    return self

  def set_state(self, state: P.EngineState) -> None:
    off = P.HEADER_DTYPE.fields["engine_state"][1]
    self.region.write(off, int(state).to_bytes(4, "little"))

  def pause(self) -> None:
    """Stops stepping (requests stay where they are) until resume()."""
    self._run.clear()

  def resume(self) -> None:
    self._run.set()

  def crash(self, error: BaseException | None = None) -> None:
    """The loop ends as if the model step had raised `error` (the engine's loop dying)."""
    self._crash = error or RuntimeError("the fake device crashed")
    self._run.set()

  def stop(self, timeout: float = 10.0) -> None:
    self.region.write(P.HEADER_DTYPE.fields["shutdown"][1], (1).to_bytes(4, "little"))
    self._stop.set()
    self._run.set()
    if self._thread.is_alive():
      self._thread.join(timeout)
    self.set_state(P.EngineState.STOPPED)
    if self.error is not None:
      raise self.error

  def header(self) -> np.ndarray:
    return M.read_header(self.region)

  def find_requests(self, **fields) -> list[dict]:
    return [r for r in self.requests if all(r.get(k) == v for k, v in fields.items())]

  # ---- the loop ----
  def _record(self) -> None:
    h = np.frombuffer(self.region.buf[:P.HEADER_BYTES], P.HEADER_DTYPE)[0]
    bells = int(h["doorbell"].sum())
    if bells == self._doorbells:
      return
    self._doorbells = bells
    g = self.geo
    for s in np.flatnonzero(self._seqs != self._seen).tolist():
      off = g.request_offset(s)
      req = np.frombuffer(self.region.buf[off:off + P.REQUEST_FIXED_BYTES], P.REQUEST_DTYPE)[0]
      seq = int(req["seq"])
      if seq == self._seen[s]:
        continue
      self._seen[s] = seq
      n = int(req["prompt_len"])
      rec = {k: req[k].item() for k in P.REQUEST_DTYPE.names if k != "stop_ids"}
      rec["stop_ids"] = [int(x) for x in req["stop_ids"][:int(req["num_stop_ids"])]]
      rec["slot"] = s
      at = min(int(req["prompt_offset"]), g.arena_tokens)
      po = g.arena_offset + 4 * at
      rec["prompt"] = np.frombuffer(
          self.region.buf[po:po + 4 * min(n, g.max_prompt, g.arena_tokens - at)], "<i4").tolist()
      self.requests.append(rec)

  def _loop(self) -> None:
    try:
      while not self._stop.is_set():
        if not self._run.is_set():
          self._run.wait(0.05)
          continue
        if self._crash is not None:
          raise self._crash
        self._record()
        words = self.sched.schedule()
        if int(words[B.SHUTDOWN]):
          break
        self.sched.commit(*self.model.step(np.asarray(words), np.asarray(self.sched.page_table)))
        if int(words[B.NUM_ROWS]):
          self.steps += 1
          if self.step_delay_s:
            time.sleep(self.step_delay_s)
    except BaseException as e:  # surfaced by stop()
      self.error = e
      if self._crash is not None:  # what the engine's loop thread does when it dies
        self.set_state(P.EngineState.STOPPED)


class FakeEngine:
  """What `nic_frontend.supervisor.Serving` uses of blink_jax.engine.Engine, over a
  FakeDevice and shm."""

  def __init__(self, tokenizer_path: pathlib.Path, dc: DeviceConfig | None = None, *,
               model_name: str = "tiny", shm_name: str | None = None, story_text: str = STORY):
    from blink_jax.client.tokenizer import Tokenizer
    from blink_jax.client import shm

    dc = dc or DeviceConfig()
    tok = Tokenizer(str(tokenizer_path))
    dc = dataclasses.replace(dc, vocab_size=tok.vocab_size)
    self.region = shm.create_region(shm_name, dc.geometry.total_bytes)
    self.shm_name = self.region.name
    self.mailbox_workers = dc.num_workers
    self.tokenizer_path = str(tokenizer_path)
    self.model_name = model_name
    self.max_context = dc.max_context
    self.dtype = "float32"
    self.devices = ["fake-cpu"]
    self.loop_on_device = False
    self.device = FakeDevice(self.region, dc,
                             story=tok.encode(story_text) + [tok.eos_id]).start()
    self._shut = False

  def stats(self) -> dict:
    h = self.device.header()
    return {k: int(h[k]) for k in ("steps", "tokens_generated", "requests_finished")}

  @property
  def running(self) -> bool:
    return self.device._thread.is_alive() and not self._shut

  def shutdown(self, timeout: float = 10.0) -> None:
    if self._shut:
      return
    self._shut = True
    try:
      self.device.stop(timeout)
    except BaseException as e:  # a crashed device loop: its error was the point
      if e is not self.device._crash:
        raise
    finally:
      self.region.close()
      self.region.unlink()


REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Running:
  """A started FakeDevice over a fresh shm mailbox, and what its story decodes with."""
  device: "FakeDevice"
  region: object
  tokenizer: object
  story: list[int]


@contextlib.contextmanager
def running_device(tokenizer_path, dc: "DeviceConfig | None" = None, *, eos: bool = True,
                   story: bool = True):
  """A FakeDevice serving the tiny tokenizer's STORY (ending in EOS unless `eos` is False;
  no story at all with story=False) from a new shm mailbox; stopped and unlinked after."""
  from blink_jax.client import shm
  from blink_jax.client.tokenizer import Tokenizer

  tok = Tokenizer(str(tokenizer_path))
  dc = dc or DeviceConfig()
  if story:
    dc = dataclasses.replace(dc, vocab_size=tok.vocab_size)
  ids = tok.encode(STORY) + ([tok.eos_id] if eos else []) if story else None
  region = shm.create_region(None, dc.geometry.total_bytes)
  device = FakeDevice(region, dc, **({"story": ids} if story else {})).start()
  try:
    yield Running(device, region, tok, ids)
  finally:
    device.stop()
    region.close()
    region.unlink()


def wait_until(pred, timeout: float = 20.0, interval: float = 0.01, what: str = "condition"):
  deadline = time.monotonic() + timeout
  while True:
    v = pred()
    if v:
      return v
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    time.sleep(interval)


def check_error(status, headers, body, want_status, *, code=None, param=None,
                param_in_message=False) -> dict:
  """Asserts an OpenAI-style error response (status, JSON body {"error": {message, type,
  param, code}}); returns the error object. param_in_message: the message names the param."""
  assert status == want_status, (status, body)
  assert headers.get("Content-Type", "").startswith("application/json"), headers
  assert isinstance(body, dict) and set(body) == {"error"}, body
  err = body["error"]
  assert set(err) == {"message", "type", "param", "code"}, err
  assert isinstance(err["message"], str) and err["message"]
  assert isinstance(err["type"], str) and err["type"]
  if code is not None:
    assert err["code"] == code, err
  if param is not None:
    assert err["param"] == param, err
    if param_in_message:
      assert param in err["message"], err
  return err


def http_request(port: int, method: str, path: str, body=None, *, headers=None,
                 api_key: str | None = None, timeout: float = 30):
  """(status, headers, parsed JSON or raw bytes) of one request on a fresh connection."""
  import http.client
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
  h = {"Content-Type": "application/json"}
  if api_key:
    h["Authorization"] = f"Bearer {api_key}"
  h.update(headers or {})
  if body is not None and not isinstance(body, (bytes, str)):
    body = json.dumps(body)
  conn.request(method, path, body=body, headers=h)
  r = conn.getresponse()
  raw = r.read()
  conn.close()
  try:
    data = json.loads(raw)
  except ValueError:
    data = raw
  return r.status, dict(r.getheaders()), data


def free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def terminate(proc: subprocess.Popen, timeout: float = 20.0) -> None:
  """SIGTERM, then SIGKILL if `proc` has not exited within `timeout` seconds."""
  proc.terminate()
  try:
    proc.wait(timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()


def process_alive(pid: int) -> bool:
  """The process exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
  except FileNotFoundError:
    return False


def spawn_until_ready(cmd: list[str], ready: pathlib.Path, log: pathlib.Path,
                      env: dict | None = None) -> subprocess.Popen:
  """Starts `cmd` (output to `log`) and waits until it wrote `ready`; raises if it exits first."""
  with open(log, "wb") as f:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
  try:
    wait_until(lambda: ready.exists() or proc.poll() is not None, 60, 0.02, "the worker")
  except AssertionError:
    proc.kill()
    raise
  if proc.poll() is not None:
    raise AssertionError(f"worker exited: {log.read_text()}")
  return proc


def start_worker(tmp: pathlib.Path, tokenizer_path, model_name: str, args: list[str],
                 env: dict | None = None, prefix: list[str] | None = None):
  """(process, port, log path) of a `nic_frontend.worker` that has announced its port.

  `prefix` runs it under another command (e.g. `ip netns exec NS`)."""
  ready, log = tmp / f"{model_name}-ready.json", tmp / f"{model_name}-worker.log"
  cmd = [*(prefix or []), sys.executable, "-m", "nic_frontend.worker", "--tokenizer",
         str(tokenizer_path), "--model-name", model_name, "--port", "0", "--ready-file",
         str(ready), *args]
  full_env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
  full_env.update(env or {})
  proc = spawn_until_ready(cmd, ready, log, full_env)
  return proc, json.loads(ready.read_text())["port"], log


def fake_serve(argv: list[str]) -> None:
  """`scripts/serve.py` itself (flags, supervision, signals, exit status) over a FakeEngine
  instead of a JAX engine: what the serving fault tests run in a process of their own, so that
  they can stop or kill "the engine" (`python -c "import sys; from tests.fake_device import
  fake_serve; fake_serve(sys.argv)" --ckpt fake --tokenizer tiny.model ...`).

  Flags besides serve.py's: --fake_step_delay_s (the fake device's pace) and --fake_info_file
  (written once serving: JSON with pid, shm_name, run_dir and the workers' pids). SIGUSR1 makes
  the fake device loop crash (the engine's loop dying)."""
  import importlib.util
  import signal

  from absl import app, flags

  spec = importlib.util.spec_from_file_location("blink_serve", REPO / "scripts" / "serve.py")
  serve = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(serve)
  flags.DEFINE_float("fake_step_delay_s", 0.0, "Seconds the fake device sleeps per step.")
  flags.DEFINE_string("fake_info_file", None, "Where to write pid, shm name, run dir, workers.")
  fv = flags.FLAGS

  def make_engine(config):
    dc = DeviceConfig(num_slots=config.num_slots, num_workers=config.frontend_workers + 1,
                      max_seqs=config.max_seqs_on("cpu"))  # a CPU stand-in
    # KV pages for every lane at full context, as an engine sized from device memory has:
    # the default 256 pages ran some 18 of bench.frontend's 256 streams at a time
    dc = dataclasses.replace(dc, num_pages=dc.max_seqs * (dc.max_context // dc.page_size))
    engine = FakeEngine(pathlib.Path(fv.tokenizer), dc, model_name="tiny",
                        shm_name=fv.shm_name or None)
    engine.device.step_delay_s = fv.fake_step_delay_s
    signal.signal(signal.SIGUSR1, lambda *_: engine.device.crash())
    return engine

  serve.make_engine = make_engine
  from nic_frontend import supervisor
  start = supervisor.Serving.start

  def start_and_tell(self):
    start(self)
    if fv.fake_info_file:
      tmp = fv.fake_info_file + ".tmp"
      with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "shm_name": self.shm_name, "run_dir": str(self.run_dir),
                   "workers": [p.pid for p in self.procs]}, f)
      os.replace(tmp, fv.fake_info_file)

  supervisor.Serving.start = start_and_tell
  app.run(serve.main, argv=serve._normalize_argv(list(argv)))

"""OpenAI API schema: request validation into an internal request, and response builders.

Validation is strict on the fields we implement (a wrong type or an out-of-range value is a 400
naming the field, in OpenAI's error schema) and explicit about the ones we do not: a field that
would change the output (penalties, logit_bias, echo, tools, ...) is rejected with a 400
instead of being silently ignored. Unknown fields are ignored, as vLLM does.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import threading
import time
import uuid
from typing import Any, Sequence

from blink_jax.client import mailbox
from blink_jax.client import protocol

from blink_jax.client.streaming import token_info

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPTS = 64
MAX_CHOICES = 64      # choices of one request: prompts x n, each a sequence of its own
MAX_SEED = (1 << 64) - 1


class ApiError(Exception):
  """An error answered in OpenAI's schema: {"error": {message, type, param, code}}."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               type: str | None = None, code: str | int | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.type = type or _default_type(status)
    self.code = code
    self.headers = headers or {}

  def body(self) -> dict:
    return error_body(self.message, self.type, self.param, self.code)

  def __reduce__(self):  # picklable: the parser process pool sends these back
    return (_api_error, (self.status, self.message, self.param, self.type, self.code,
                         self.headers))


def _api_error(status, message, param, type, code, headers) -> ApiError:
  return ApiError(status, message, param=param, type=type, code=code, headers=headers)


def _default_type(status: int) -> str:
  if status == 401:
    return "authentication_error"
  if status == 429:
    return "rate_limit_error"
  if status >= 500:
    return "server_error" if status != 503 else "service_unavailable"
  return "invalid_request_error"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
  return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
  return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the engine behind this frontend accepts (from the mailbox header)."""
  model_names: tuple[str, ...]
  vocab_size: int
  max_context: int
  max_prompt: int          # a slot's prompt capacity
  max_top_logprobs: int    # top alternatives the device stores per token


@dataclasses.dataclass
class GenRequest:
  """A validated request: one or more prompts (token ids), n choices of each, and their
  sampling. Choice i is choice i % n of prompt i // n (OpenAI's `index` of a choice)."""
  kind: str                      # "completion" | "chat"
  model: str
  prompts: list[list[int]]
  n: int
  max_tokens: list[int]          # per prompt
  temperature: float
  top_p: float
  top_k: int
  seed: int
  seed_given: bool
  stop: list[str]
  stop_token_ids: list[int]
  ignore_eos: bool
  logprobs: bool                 # return logprobs at all
  top_logprobs: int              # alternatives per token
  stream: bool
  include_usage: bool
  user: str | None = None

  @property
  def num_choices(self) -> int:
    return len(self.prompts) * self.n

  def slot_request(self, i: int, request_id: int = 0) -> mailbox.Request:
    """Choice i's request; its seed is `choice_seed(seed, i % n)`."""
    p = i // self.n
    return mailbox.Request(prompt=self.prompts[p], max_tokens=self.max_tokens[p],
                     temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                     seed=choice_seed(self.seed, i % self.n),
                     stop_ids=tuple(self.stop_token_ids),
                     num_logprobs=self.top_logprobs if self.logprobs else 0,
                     logprobs=self.logprobs, ignore_eos=self.ignore_eos,
                     request_id=request_id)


def choice_seed(seed: int, j: int) -> int:
  """The seed of a prompt's choice j: the request's seed for the first (so choice 0 of n is
  what n = 1 returns with that seed), then steps of the 64-bit golden ratio, so the choices
  sample apart and a seeded request repeats all of them."""
  return (seed + j * 0x9E3779B97F4A7C15) & MAX_SEED


# ---- the request fields ---------------------------------------------------------------------
# The scalar fields the readers below accept and their bounds, declared once: `_common` and the
# parsers read them from here, and nic_frontend.openapi publishes them (with the structured
# fields, whose limits are the constants above) as the request schemas of GET /openapi.json.

@dataclasses.dataclass(frozen=True)
class Field:
  type: str                                # JSON type: "integer", "number", "boolean", "string"
  default: Any = None                      # what an absent or null field means
  minimum: int | float | None = None
  maximum: int | float | None = None
  exclusive_minimum: bool = False          # minimum itself is not allowed
  description: str = ""


COMMON_FIELDS: dict[str, Field] = {
    "model": Field("string", description="one of the served model names (default: the first)"),
    "n": Field("integer", 1, 1, MAX_CHOICES,
               description=f"choices per prompt, each sampled on its own (with a seed, "
                           f"reproducibly); at most {MAX_CHOICES} choices per request in all "
                           f"(prompts x n)"),
    "stream": Field("boolean", False, description="stream the response as server-sent events"),
    "temperature": Field("number", 1.0, 0.0, 2.0),
    "top_p": Field("number", 1.0, 0.0, 1.0, exclusive_minimum=True),
    "top_k": Field("integer", 0, -1, description="0 or -1: no top-k restriction"),
    "seed": Field("integer", None, -(1 << 63), MAX_SEED, description="default: random"),
    "ignore_eos": Field("boolean", False),
    "user": Field("string"),
    "max_tokens": Field("integer", None, 1, description="default: 16 for completions, the "
                                                        "rest of the context for chat"),
    "max_completion_tokens": Field("integer", None, 1, description="overrides max_tokens"),
}
COMPLETION_FIELDS: dict[str, Field] = {
    "logprobs": Field("integer", None, 0, MAX_COMPLETION_LOGPROBS,
                      description="top alternatives per token to return (at most the "
                                  "engine's max_top_logprobs)"),
}
CHAT_FIELDS: dict[str, Field] = {
    "logprobs": Field("boolean", False),
    "top_logprobs": Field("integer", None, 0, MAX_CHAT_TOP_LOGPROBS,
                          description="needs logprobs; at most the engine's max_top_logprobs"),
}


def _read(body: dict, name: str, fields: dict[str, Field] = COMMON_FIELDS):
  """Field `name` of `body` as its entry in `fields` declares it."""
  f = fields[name]
  if f.type == "integer":
    return _int(body, name, f.default, lo=f.minimum, hi=f.maximum)
  if f.type == "number":
    return _float(body, name, f.default, lo=f.minimum, hi=f.maximum,
                  lo_open=f.exclusive_minimum)
  if f.type == "boolean":
    return _bool(body, name, f.default)
  raise TypeError(f"no reader for {f.type} field {name}")


# ---- field readers --------------------------------------------------------------------------

_MISSING = object()


def _type_name(v: Any) -> str:
  if v is None:
    return "null"
  if isinstance(v, bool):
    return "boolean"
  if isinstance(v, int):
    return "integer"
  if isinstance(v, float):
    return "number"
  if isinstance(v, str):
    return "string"
  if isinstance(v, list):
    return "array"
  if isinstance(v, dict):
    return "object"
  return type(v).__name__


def _int(body: dict, name: str, default=None, *, lo: int | None = None,
         hi: int | None = None, allow_null: bool = True):
  v = body.get(name, _MISSING)
  if v is _MISSING or (v is None and allow_null):
    return default
  if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
    v = int(v)
  if isinstance(v, bool) or not isinstance(v, int):
    raise bad(name, f"'{name}' must be an integer, got {_type_name(v)}", "invalid_type")
  if lo is not None and v < lo:
    raise bad(name, f"'{name}' must be >= {lo}, got {v}")
  if hi is not None and v > hi:
    raise bad(name, f"'{name}' must be <= {hi}, got {v}")
  return v


def _float(body: dict, name: str, default: float, *, lo: float | None = None,
           hi: float | None = None, lo_open: bool = False) -> float:
  v = body.get(name, _MISSING)
  if v is _MISSING or v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise bad(name, f"'{name}' must be a number, got {_type_name(v)}", "invalid_type")
  v = float(v)
  if not math.isfinite(v):
    raise bad(name, f"'{name}' must be finite, got {v}")
  if lo is not None and (v <= lo if lo_open else v < lo):
    raise bad(name, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}")
  if hi is not None and v > hi:
    raise bad(name, f"'{name}' must be <= {hi}, got {v}")
  return v


def _bool(body: dict, name: str, default: bool) -> bool:
  v = body.get(name, _MISSING)
  if v is _MISSING or v is None:
    return default
  if not isinstance(v, bool):
    raise bad(name, f"'{name}' must be a boolean, got {_type_name(v)}", "invalid_type")
  return v


def _unsupported(body: dict, name: str, noop: tuple) -> None:
  """Rejects a known field we do not implement unless it has a no-op value."""
  if name in body and not any(_json_equal(body[name], v) for v in noop):
    raise bad(name, f"'{name}' is not supported by this server", "unsupported_parameter")


def _json_equal(a: Any, b: Any) -> bool:
  """Equality as JSON Schema's `enum` has it: numbers by value, booleans apart from numbers."""
  if isinstance(a, bool) or isinstance(b, bool):
    return isinstance(a, bool) and isinstance(b, bool) and a == b
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    return a == b
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
  return type(a) is type(b) and a == b


# Fields of OpenAI's (or vLLM's) API that would change the output and that this server does not
# implement: accepted only with one of these no-op values (published as an enum).
NOOP_FIELDS: dict[str, tuple] = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
}


# ---- the body as a whole --------------------------------------------------------------------

MAX_JSON_DEPTH = 32  # far deeper than any OpenAI request


def load_json(raw: bytes) -> Any:
  """The parsed request body; 400 for invalid JSON, nesting past MAX_JSON_DEPTH (or the JSON
  parser's recursion) and strings that are not valid Unicode."""
  try:
    body = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise ApiError(400, f"the request body is not valid JSON: {_clip(str(e))}",
                   code="invalid_json") from None
  except RecursionError:
    raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
  check_json_values(body)
  return body


def _clip(text: str, most: int = 200) -> str:
  return text if len(text) <= most else text[:most] + "..."


def parse_body(raw: bytes, kind: str, limits: "Limits", tokenizer) -> "GenRequest":
  """A request body as read from the socket to a validated, tokenized request: all the CPU
  work of a request before it reaches the engine (the server runs large bodies in a process
  pool, see `init_parser_process`)."""
  body = load_json(raw)
  return parse_completion(body, limits, tokenizer) if kind == "completion" else \
      parse_chat(body, limits, tokenizer)


_PROCESS_TOKENIZER = None


def init_parser_process(tokenizer_model: bytes, parent: int | None = None) -> None:
  """Initializer of a parser process (nic_frontend.server's pool) of the worker process
  `parent`: its own tokenizer, from the serialized SentencePiece model of the frontend's."""
  import signal

  from blink_jax.client.tokenizer import Tokenizer

  global _PROCESS_TOKENIZER
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when to stop
  try:
    os.nice(5)  # the event loop and the driver thread come first on a busy host
  except OSError:
    pass
  # A pool process holds both ends of its task queue, so it would outlive a worker killed
  # outright (SIGKILL, OOM): it goes when its parent does (or is gone already).
  parent = os.getppid() if parent is None else parent

  def watch_parent() -> None:
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(0)

  threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
  _PROCESS_TOKENIZER = Tokenizer(tokenizer_model)
  _PROCESS_TOKENIZER.warm_up()


def parse_in_process(raw: bytes, kind: str, limits: "Limits") -> "GenRequest":
  """`parse_body` with the parser process's tokenizer."""
  return parse_body(raw, kind, limits, _PROCESS_TOKENIZER)


def parser_process_ready() -> bool:
  return _PROCESS_TOKENIZER is not None


def check_json_values(body: Any) -> None:
  """Rejects (400) a parsed body nested deeper than MAX_JSON_DEPTH or holding a string that is
  not valid Unicode (a lone UTF-16 surrogate such as "\\ud800", which JSON allows and no
  tokenizer encodes), naming the top-level field it is in. Iterative: any depth is safe."""
  stack = [(body, 0, None)]
  while stack:
    v, depth, field = stack.pop()
    if depth > MAX_JSON_DEPTH:
      where = f"'{field}'" if field else "the request body"
      raise ApiError(400, f"{where} is nested deeper than {MAX_JSON_DEPTH} levels",
                     param=field, code="invalid_json")
    if isinstance(v, str):
      try:
        v.encode("utf-8")
      except UnicodeEncodeError:
        where = f"'{field}'" if field else "the request body"
        raise bad(field, f"{where} holds a string that is not valid Unicode (a lone "
                         "surrogate)", "invalid_string") from None
    elif isinstance(v, dict):
      for k, x in v.items():
        f = field if field is not None or depth else k
        stack.append((k, depth + 1, f))
        stack.append((x, depth + 1, f))
    elif isinstance(v, list):
      stack.extend((x, depth + 1, field) for x in v)


# ---- common fields --------------------------------------------------------------------------

def _model(body: dict, limits: Limits) -> str:
  model = body.get("model", _MISSING)
  if model is _MISSING or model is None:
    return limits.model_names[0]
  if not isinstance(model, str):
    raise bad("model", f"'model' must be a string, got {_type_name(model)}", "invalid_type")
  if model not in limits.model_names:
    raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                   code="model_not_found")
  return model


def _stop(body: dict) -> list[str]:
  v = body.get("stop")
  if v is None:
    return []
  if isinstance(v, str):
    v = [v]
  if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
    raise bad("stop", "'stop' must be a string or an array of strings", "invalid_type")
  if len(v) > MAX_STOP_STRINGS:
    raise bad("stop", f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(v)}")
  for s in v:
    if not s:
      raise bad("stop", "'stop' strings must not be empty")
    if len(s) > MAX_STOP_STRING_CHARS:
      raise bad("stop", f"'stop' strings may be at most {MAX_STOP_STRING_CHARS} characters")
  return list(dict.fromkeys(v))


def _token_list(v: Any, param: str, vocab: int) -> list[int]:
  if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in v):
    raise bad(param, f"'{param}' must be an array of token ids (integers)", "invalid_type")
  for t in v:
    if not 0 <= t < vocab:
      raise bad(param, f"'{param}' holds token id {t}, outside the vocabulary [0, {vocab})")
  return list(v)


def _common(body: dict, limits: Limits, kind: str) -> dict:
  if not isinstance(body, dict):
    raise bad(None, "the request body must be a JSON object", "invalid_type")
  for name, noop in NOOP_FIELDS.items():
    _unsupported(body, name, noop)
  model = _model(body, limits)
  nf = COMMON_FIELDS["n"]
  n = _int(body, "n", nf.default)
  if not nf.minimum <= n <= nf.maximum:
    raise bad("n", f"'n' must be between {nf.minimum} and {nf.maximum}, got {n}")
  stream = _read(body, "stream")
  opts = body.get("stream_options")
  include_usage = False
  if opts is not None:
    if not stream:
      raise bad("stream_options",
                "'stream_options' is only allowed when 'stream' is true")
    if not isinstance(opts, dict):
      raise bad("stream_options", "'stream_options' must be an object", "invalid_type")
    include_usage = _bool(opts, "include_usage", False)
  temperature = _read(body, "temperature")
  top_p = _read(body, "top_p")
  top_k = _read(body, "top_k")
  top_k = 0 if top_k == -1 else top_k
  if top_k > limits.vocab_size:
    top_k = 0  # larger than the vocabulary: no restriction
  seed = _read(body, "seed")
  seed_given = seed is not None
  if seed is None:
    seed = random.getrandbits(63)
  stop = _stop(body)
  stop_ids = body.get("stop_token_ids")
  stop_ids = [] if stop_ids is None else _token_list(stop_ids, "stop_token_ids",
                                                      limits.vocab_size)
  stop_ids = list(dict.fromkeys(stop_ids))
  if len(stop_ids) > protocol.MAX_STOP_IDS:
    raise bad("stop_token_ids", f"'stop_token_ids' may hold at most {protocol.MAX_STOP_IDS} ids, "
                                f"got {len(stop_ids)}")
  ignore_eos = _read(body, "ignore_eos")
  user = body.get("user")
  if user is not None and not isinstance(user, str):
    raise bad("user", f"'user' must be a string, got {_type_name(user)}", "invalid_type")
  max_tokens = _read(body, "max_tokens")
  mct = _read(body, "max_completion_tokens")
  if mct is not None:
    max_tokens = mct
  return dict(kind=kind, model=model, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
              seed=seed & MAX_SEED, seed_given=seed_given, stop=stop, stop_token_ids=stop_ids,
              ignore_eos=ignore_eos, stream=stream, include_usage=include_usage, user=user,
              max_tokens=max_tokens)


def prompt_cap(limits: Limits) -> int:
  """The most tokens a prompt may have (a slot's capacity, and room for one token)."""
  return min(limits.max_prompt, limits.max_context - 1)


def _too_long(param: str, limits: Limits, n: int, at_least: bool = False) -> ApiError:
  return bad(param, f"This model's maximum prompt length is {prompt_cap(limits)} tokens "
                    f"(context {limits.max_context}); the prompt has {'at least ' * at_least}"
                    f"{n} tokens.", "context_length_exceeded")


def _min_tokens(tokenizer, text: str) -> int:
  """A lower bound on the tokens of `text` from its size alone (0 if the tokenizer has none)."""
  bound = getattr(tokenizer, "min_tokens", None)
  return bound(text) if bound is not None else 0


def _max_tokens(prompts: list[list[int]], requested: int | None, default: int | None,
                limits: Limits, prompt_param: str) -> list[int]:
  out = []
  for p in prompts:
    n = len(p)
    if n == 0:
      raise bad(prompt_param, f"'{prompt_param}' is empty")
    if n > prompt_cap(limits):
      raise _too_long(prompt_param, limits, n)
    room = limits.max_context - n
    if requested is None:
      out.append(room if default is None else min(default, room))
      continue
    if requested > room:
      raise bad("max_tokens", f"This model's maximum context length is {limits.max_context} "
                              f"tokens. However, you requested {n + requested} tokens ({n} in "
                              f"the prompt, {requested} for the completion). Please reduce the "
                              f"prompt or max_tokens.", "context_length_exceeded")
    out.append(requested)
  return out


# ---- /v1/completions ------------------------------------------------------------------------

def parse_completion(body: Any, limits: Limits, tokenizer) -> GenRequest:
  c = _common(body, limits, "completion")
  if "prompt" not in body or body["prompt"] is None:
    raise bad("prompt", "'prompt' is required", "missing_required_parameter")
  prompts = _prompts(body["prompt"], limits, tokenizer)
  if len(prompts) * c["n"] > MAX_CHOICES:
    raise bad("n", f"{len(prompts)} prompts x n = {c['n']} is {len(prompts) * c['n']} choices; "
                   f"at most {MAX_CHOICES} per request")
  lp = body.get("logprobs")
  if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int)):
    raise bad("logprobs", f"'logprobs' must be an integer, got {_type_name(lp)}",
              "invalid_type")
  top = 0
  if lp is not None:
    cap = min(COMPLETION_FIELDS["logprobs"].maximum, limits.max_top_logprobs)
    if not 0 <= lp <= cap:
      raise bad("logprobs", f"'logprobs' must be between 0 and {cap}, got {lp}")
    top = lp
  c["max_tokens"] = _max_tokens(prompts, c["max_tokens"], 16, limits, "prompt")
  return GenRequest(prompts=prompts, logprobs=lp is not None, top_logprobs=top, **c)


def _prompts(v: Any, limits: Limits, tokenizer) -> list[list[int]]:
  cap = prompt_cap(limits)

  def encode(text: str) -> list[int]:
    # A text whose size alone shows it cannot fit is rejected before it is tokenized.
    least = _min_tokens(tokenizer, text) + 1  # + <bos>
    if least > cap:
      raise _too_long("prompt", limits, least, at_least=True)
    # A raw prompt's "<start_of_turn>" is that token, as vLLM reads it (Tokenizer's docstring).
    return tokenizer.encode(text, add_bos=True, parse_special=True)

  def ids(x: list) -> list[int]:
    if len(x) > cap:
      raise _too_long("prompt", limits, len(x))
    return _token_list(x, "prompt", limits.vocab_size)

  if isinstance(v, str):
    return [encode(v)]
  if not isinstance(v, list):
    raise bad("prompt", "'prompt' must be a string, an array of strings, an array of token ids "
                        f"or an array of token-id arrays, got {_type_name(v)}", "invalid_type")
  if not v:
    raise bad("prompt", "'prompt' must not be an empty array")
  if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
    return [ids(v)]
  if len(v) > MAX_PROMPTS:
    raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
  if all(isinstance(x, str) for x in v):
    return [encode(x) for x in v]
  if all(isinstance(x, list) for x in v):
    return [ids(x) for x in v]
  raise bad("prompt", "'prompt' must be a string, an array of strings, an array of token ids "
                      "or an array of token-id arrays (not a mix)", "invalid_type")


# ---- /v1/chat/completions -------------------------------------------------------------------

def parse_chat(body: Any, limits: Limits, tokenizer) -> GenRequest:
  c = _common(body, limits, "chat")
  msgs = body.get("messages")
  if msgs is None:
    raise bad("messages", "'messages' is required", "missing_required_parameter")
  if not isinstance(msgs, list) or not msgs:
    raise bad("messages", "'messages' must be a non-empty array of messages", "invalid_type")
  norm = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict):
      raise bad("messages", f"messages[{i}] must be an object", "invalid_type")
    role = m.get("role")
    if not isinstance(role, str):
      raise bad("messages", f"messages[{i}].role must be a string", "invalid_type")
    content = m.get("content")
    if not isinstance(content, (str, list)):
      raise bad("messages", f"messages[{i}].content must be a string or an array of text "
                            "parts", "invalid_type")
    if isinstance(content, list):
      for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
          raise bad("messages", f"messages[{i}].content: only text parts "
                                "({\"type\": \"text\", \"text\": ...}) are supported")
    norm.append({"role": "system" if role == "developer" else role, "content": content})
  bound = getattr(tokenizer, "min_chat_tokens", None)
  try:
    # Messages whose size alone shows they cannot fit are rejected before they are tokenized.
    least = bound(norm, add_generation_prompt=True) if bound is not None else 0
    if least > prompt_cap(limits):
      raise _too_long("messages", limits, least, at_least=True)
    ids = tokenizer.apply_chat_template(norm, add_generation_prompt=True)
  except ValueError as e:
    raise bad("messages", f"'messages': {e}") from None
  lp = _read(body, "logprobs", CHAT_FIELDS)
  top = _read(body, "top_logprobs", CHAT_FIELDS)
  if top is not None and not lp:
    raise bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
  if top is not None and top > limits.max_top_logprobs:
    raise bad("top_logprobs", f"'top_logprobs' must be <= {limits.max_top_logprobs} on this "
                              f"server, got {top}")
  c["max_tokens"] = _max_tokens([ids], c["max_tokens"], None, limits, "messages")
  # The model's turn ends with <end_of_turn>: stop there even if the engine's EOS list only
  # has <eos> (a base checkpoint's generation config).
  eot = getattr(tokenizer, "end_of_turn_id", None)
  if (eot is not None and not c["ignore_eos"] and eot not in c["stop_token_ids"]
      and len(c["stop_token_ids"]) < protocol.MAX_STOP_IDS):
    c["stop_token_ids"] = [*c["stop_token_ids"], eot]
  return GenRequest(prompts=[ids], logprobs=lp, top_logprobs=top or 0, **c)


# ---- responses ------------------------------------------------------------------------------

def new_id(kind: str) -> str:
  return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
  """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache."""
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens,
          "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class LogprobsBuilder:
  """Accumulates the logprobs of one choice in the completions or the chat format."""

  def __init__(self, kind: str, tokenizer, top_n: int):
    self.kind, self.tok, self.top_n = kind, tokenizer, top_n
    self.tokens: list[str] = []
    self.token_logprobs: list[float] = []
    self.top_logprobs: list[dict] = []
    self.text_offset: list[int] = []
    self.content: list[dict] = []
    self._offset = 0

  def add(self, tokens: Sequence[int], logprobs: Sequence[float], top: Sequence) -> dict | None:
    """Adds entries; returns the logprobs object of just these (for a stream chunk)."""
    if not tokens:
      return None
    start_c, start_t = len(self.content), len(self.tokens)
    for i, t in enumerate(tokens):
      text, raw = token_info(self.tok, t)
      lp = float(logprobs[i]) if i < len(logprobs) else 0.0
      alts = list(top[i])[:self.top_n] if i < len(top) else []
      if self.kind == "chat":
        self.content.append({
            "token": text, "logprob": lp, "bytes": raw,
            "top_logprobs": [{"token": token_info(self.tok, a)[0], "logprob": float(b),
                              "bytes": token_info(self.tok, a)[1]} for a, b in alts]})
      else:
        self.tokens.append(text)
        self.token_logprobs.append(lp)
        self.top_logprobs.append({token_info(self.tok, a)[0]: float(b) for a, b in alts})
        self.text_offset.append(self._offset)
        self._offset += len(text)
    if self.kind == "chat":
      return {"content": self.content[start_c:], "refusal": None}
    return {"tokens": self.tokens[start_t:], "token_logprobs": self.token_logprobs[start_t:],
            "top_logprobs": self.top_logprobs[start_t:],
            "text_offset": self.text_offset[start_t:]}

  def result(self) -> dict:
    if self.kind == "chat":
      return {"content": self.content, "refusal": None}
    return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def completion_response(rid: str, created: int, model: str, choices: list[dict],
                        usage_: dict) -> dict:
  return {"id": rid, "object": "text_completion", "created": created, "model": model,
          "system_fingerprint": None, "choices": choices, "usage": usage_}


def completion_choice(index: int, text: str, logprobs: dict | None,
                      finish_reason: str | None) -> dict:
  return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(rid: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
  return {"id": rid, "object": "chat.completion", "created": created, "model": model,
          "system_fingerprint": None, "choices": choices, "usage": usage_}


def chat_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
  return {"index": index,
          "message": {"role": "assistant", "content": text, "refusal": None},
          "logprobs": logprobs, "finish_reason": finish_reason}


def chunk(kind: str, rid: str, created: int, model: str, choices: list[dict],
          include_usage: bool, usage_: dict | None = None) -> dict:
  out = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
         "created": created, "model": model, "system_fingerprint": None, "choices": choices}
  if include_usage:
    out["usage"] = usage_
  return out


def chat_delta_choice(index: int, delta: dict, logprobs: dict | None,
                      finish_reason: str | None) -> dict:
  return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def models_list(names: Sequence[str], max_context: int, created: int | None = None) -> dict:
  created = int(time.time()) if created is None else created
  return {"object": "list", "data": [model_card(n, max_context, created) for n in names]}


def model_card(name: str, max_context: int, created: int) -> dict:
  return {"id": name, "object": "model", "created": created, "owned_by": "blink-jax",
          "root": name, "parent": None, "max_model_len": max_context}

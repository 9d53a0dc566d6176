"""The frontend's API as an OpenAPI 3.1 document (served at GET /openapi.json).

The request schemas are built from what the parser (`nic_frontend.openai_api`) validates: its
field table (COMMON_FIELDS, COMPLETION_FIELDS, CHAT_FIELDS), its unsupported fields and their
no-op values (NOOP_FIELDS), its limits (MAX_STOP_STRINGS, MAX_PROMPTS, ...) and the engine's
(`Limits`: vocabulary, context, prompt capacity, top logprobs), so the document cannot drift
from the validation. A body the schema accepts may still get a 400 the schema cannot express
(a prompt plus max_tokens past the context, chat roles out of order, stream_options without
stream); one it rejects always gets a 4xx. Every error is in OpenAI's schema (`Error`).
"""
from __future__ import annotations

from typing import Any, Sequence

from blink_jax.client import protocol

from nic_frontend import openai_api as api

ERROR_STATUSES = {
    "400": "invalid request (the message and `param` say what)",
    "401": "missing or wrong API key",
    "404": "no such model",
    "408": "the request did not arrive in time",
    "413": "request body too large",
    "503": "the engine is not ready, the server is shutting down, has too many connections, "
           "or its queue of requests waiting for a slot is full; retry after Retry-After "
           "seconds",
}


def _ref(name: str) -> dict:
  return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict) -> dict:
  t = schema.get("type")
  if isinstance(t, str):
    return {**schema, "type": [t, "null"]}
  return {"anyOf": [schema, {"type": "null"}]}


def field_schema(f: api.Field, *, maximum: float | None = None) -> dict:
  """The JSON schema of a scalar field of the parser's field table (null means the default)."""
  s: dict[str, Any] = {"type": f.type}
  if f.minimum is not None:
    s["exclusiveMinimum" if f.exclusive_minimum else "minimum"] = f.minimum
  top = f.maximum if maximum is None else (maximum if f.maximum is None
                                           else min(maximum, f.maximum))
  if top is not None:
    s["maximum"] = top
  if f.default is not None:
    s["default"] = f.default
  if f.description:
    s["description"] = f.description
  return _nullable(s)


def _noop_schema(name: str, values: tuple) -> dict:
  return {"enum": list(values),
          "description": f"`{name}` is not supported: only a no-op value is accepted"}


def _token_id(limits: api.Limits | None) -> dict:
  s: dict[str, Any] = {"type": "integer", "minimum": 0}
  if limits is not None:
    s["maximum"] = limits.vocab_size - 1
  return s


def _token_ids(limits: api.Limits | None) -> dict:
  s = {"type": "array", "items": _token_id(limits), "minItems": 1}
  if limits is not None:
    s["maxItems"] = api.prompt_cap(limits)
  return s


def _common_properties(names: Sequence[str], limits: api.Limits | None) -> dict:
  props: dict[str, Any] = {}
  for name, f in api.COMMON_FIELDS.items():
    top = None
    if limits is not None and name in ("max_tokens", "max_completion_tokens"):
      top = limits.max_context - 1  # the prompt has a token at least
    props[name] = field_schema(f, maximum=top)
  props["model"] = {"enum": [*names, None],
                    "description": api.COMMON_FIELDS["model"].description}
  props["stop"] = {
      "anyOf": [
          {"type": "string", "minLength": 1, "maxLength": api.MAX_STOP_STRING_CHARS},
          {"type": "array", "maxItems": api.MAX_STOP_STRINGS,
           "items": {"type": "string", "minLength": 1, "maxLength": api.MAX_STOP_STRING_CHARS}},
          {"type": "null"}],
      "description": "the text ends before the first of these strings"}
  props["stop_token_ids"] = {
      "type": ["array", "null"], "items": _token_id(limits),
      "maxItems": protocol.MAX_STOP_IDS,
      "description": f"at most {protocol.MAX_STOP_IDS} distinct ids"}
  props["stream_options"] = {
      "type": ["object", "null"],
      "properties": {"include_usage": {"type": ["boolean", "null"]}},
      "description": "only with stream: true"}
  for name, values in api.NOOP_FIELDS.items():
    props[name] = _noop_schema(name, values)
  return props


def completion_request(names: Sequence[str], limits: api.Limits | None) -> dict:
  props = _common_properties(names, limits)
  lp = api.COMPLETION_FIELDS["logprobs"]
  props["logprobs"] = field_schema(lp, maximum=None if limits is None
                                   else limits.max_top_logprobs)
  props["prompt"] = {
      "anyOf": [
          {"type": "string"},
          {"type": "array", "items": {"type": "string"}, "minItems": 1,
           "maxItems": api.MAX_PROMPTS},
          _token_ids(limits),
          {"type": "array", "items": _token_ids(limits), "minItems": 1,
           "maxItems": api.MAX_PROMPTS}],
      "description": "a text, texts, token ids or arrays of token ids (one choice each)"}
  return {"type": "object", "required": ["prompt"], "properties": props}


def chat_request(names: Sequence[str], limits: api.Limits | None) -> dict:
  props = _common_properties(names, limits)
  for name, f in api.CHAT_FIELDS.items():
    top = None
    if limits is not None and name == "top_logprobs":
      top = limits.max_top_logprobs
    props[name] = field_schema(f, maximum=top)
  text_part = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
  message = {"type": "object", "required": ["role", "content"],
             "properties": {
                 "role": {"enum": ["system", "developer", "user", "assistant", "model"]},
                 "content": {"anyOf": [{"type": "string"},
                                       {"type": "array", "items": text_part}]}}}
  props["messages"] = {"type": "array", "items": message, "minItems": 1,
                       "description": "an optional system (or developer) message first, then "
                                      "user and assistant turns alternating, user first"}
  return {"type": "object", "required": ["messages"], "properties": props}


def _schemas(names: Sequence[str], limits: api.Limits | None) -> dict:
  nullable_str = {"type": ["string", "null"]}
  usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
           "properties": {**{k: {"type": "integer", "minimum": 0}
                             for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                          "prompt_tokens_details": {
                              "type": "object", "required": ["cached_tokens"],
                              "properties": {"cached_tokens": {"type": "integer",
                                                               "minimum": 0}}}}}
  finish = {"enum": ["stop", "length", None]}
  logprobs = {"type": ["object", "null"]}

  def response(obj: str, choice: dict) -> dict:
    return {"type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "system_fingerprint": nullable_str,
                           "choices": {"type": "array", "items": choice},
                           "usage": _ref("Usage")}}

  completion_choice = {"type": "object", "required": ["index", "text", "finish_reason"],
                       "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                      "logprobs": logprobs, "finish_reason": finish}}
  chat_choice = {"type": "object", "required": ["index", "message", "finish_reason"],
                 "properties": {
                     "index": {"type": "integer"}, "logprobs": logprobs,
                     "finish_reason": finish,
                     "message": {"type": "object", "required": ["role", "content"],
                                 "properties": {"role": {"const": "assistant"},
                                                "content": {"type": "string"},
                                                "refusal": nullable_str}}}}
  card = {"type": "object", "required": ["id", "object", "created", "owned_by"],
          "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                         "created": {"type": "integer"}, "owned_by": {"type": "string"},
                         "root": {"type": "string"}, "parent": nullable_str,
                         "max_model_len": {"type": ["integer", "null"]}}}
  return {
      "Error": {
          "type": "object", "required": ["error"], "additionalProperties": False,
          "properties": {"error": {
              "type": "object", "required": ["message", "type", "param", "code"],
              "additionalProperties": False,
              "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                             "param": nullable_str,
                             "code": {"type": ["string", "integer", "null"]}}}}},
      "CompletionRequest": completion_request(names, limits),
      "ChatCompletionRequest": chat_request(names, limits),
      "Usage": usage,
      "Completion": response("text_completion", completion_choice),
      "ChatCompletion": response("chat.completion", chat_choice),
      "Model": card,
      "ModelList": {"type": "object", "required": ["object", "data"],
                    "properties": {"object": {"const": "list"},
                                   "data": {"type": "array", "items": _ref("Model")}}},
      # One server-sent event (OpenAPI 3.1: the schema of a text/event-stream is each event's).
      "Event": {"type": "object", "required": ["data"],
                "properties": {"data": {
                    "type": "string",
                    "description": "a chunk (JSON, the response's fields with `choices` of "
                                   "deltas), an error in OpenAI's schema, or [DONE] last"},
                    "event": {"type": "string"}}},
      "Health": {"type": "object", "required": ["status"],
                 "properties": {"status": {"enum": ["ok", "unavailable"]},
                                "engine_state": {"type": "string"},
                                "error": {"type": "object"}}},
  }


def _errors(*statuses: str) -> dict:
  return {s: {"description": ERROR_STATUSES[s],
              "content": {"application/json": {"schema": _ref("Error")}}} for s in statuses}


def document(names: Sequence[str], limits: api.Limits | None = None, *, api_key: bool = False,
             metrics_require_key: bool = False) -> dict:
  """The OpenAPI document of a frontend serving model `names` over an engine with `limits`
  (None before the engine is attached: no engine-dependent bounds); `api_key`: /v1 (and
  /metrics with `metrics_require_key`) need a bearer key."""
  secured = {"security": [{"bearer": []}]} if api_key else {}
  auth = ("401",) if api_key else ()
  everywhere = ("400", "408", "503")  # malformed HTTP, header timeout, connection cap

  def generate(summary: str, request: str, response: str) -> dict:
    return {
        "summary": summary, **secured,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the result, or its server-sent events with stream: true",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": _ref("Event")}}},
            **_errors(*everywhere, *auth, "404", "413")}}

  def get(summary: str, schema: dict, *errors: str, media: str = "application/json",
          extra: dict | None = None) -> dict:
    return {"get": {"summary": summary, **(extra or {}),
                    "responses": {"200": {"description": "OK",
                                          "content": {media: {"schema": schema}}},
                                  **_errors(*everywhere, *errors)}}}

  health = get("readiness of this worker and its engine", _ref("Health"))
  health["get"]["responses"]["503"] = {
      "description": "not ready (engine_state says why), or too many connections",
      "content": {"application/json": {"schema": {"anyOf": [_ref("Health"), _ref("Error")]}}}}
  model = get("one model", _ref("Model"), *auth, "404", extra=secured)
  model["get"]["parameters"] = [{"name": "model", "in": "path", "required": True,
                                 "schema": {"type": "string"}, "examples": {
                                     n: {"value": n} for n in names}}]
  doc = {
      "openapi": "3.1.0",
      "info": {"title": "blink-jax OpenAI-compatible API", "version": "1"},
      "paths": {
          "/v1/completions": {"post": generate("text completion", "CompletionRequest",
                                               "Completion")},
          "/v1/chat/completions": {"post": generate("chat completion",
                                                    "ChatCompletionRequest",
                                                    "ChatCompletion")},
          "/v1/models": get("the served models", _ref("ModelList"), *auth, extra=secured),
          "/v1/models/{model}": model,
          "/health": health,
          "/metrics": get("Prometheus metrics", {"type": "string"},
                          *(auth if metrics_require_key else ()), media="text/plain",
                          extra=secured if metrics_require_key else None),
          "/openapi.json": get("this document", {"type": "object"}),
      },
      "components": {"schemas": _schemas(names, limits)},
  }
  if api_key:
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
  return doc

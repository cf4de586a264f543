"""The edge's HTTP API as OpenAPI 3.1, served at `/openapi.json`.

Written by hand next to the handlers it describes; a test checks that every
route the app serves is here and nothing else is, and the fuzz tests read it
to generate requests.
"""
from __future__ import annotations

_ERROR = {"$ref": "#/components/schemas/Error"}


def _errors(*codes: int) -> dict:
    return {str(c): {"description": _REASONS[c],
                     "content": {"application/json": {"schema": _ERROR}}} for c in codes}


_REASONS = {400: "invalid request", 401: "missing or wrong API key", 404: "not found",
            410: "the events asked for are no longer kept", 413: "request body too large",
            429: "rate limit (Retry-After, x-ratelimit-* headers)",
            503: "no room (queue full, wait over, draining) or no worker (Retry-After)",
            504: "the request's budget (x-pdserve-timeout-ms) ran out"}

_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"]},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 16},
    "seed": {"type": ["integer", "null"]},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                             "maxItems": 4}, {"type": "null"}]},
    "ignore_eos": {"type": ["boolean", "null"]},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 2},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"],
                       "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": ["string", "null"]},
    "session_id": {"type": ["string", "null"], "minLength": 1},
    # The rest of OpenAI's and vLLM's parameters: docs/openai-parameters.md.
    "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "min_tokens": {"type": ["integer", "null"], "minimum": 0},
    "logit_bias": {"type": ["object", "null"],
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
    "include_stop_str_in_output": {"type": ["boolean", "null"]},
    "truncate_prompt_tokens": {"type": ["integer", "null"], "minimum": -1},
    "response_format": {"type": ["object", "null"]},
    "structured_outputs": {"type": ["object", "null"]},
    "add_special_tokens": {"type": ["boolean", "null"]},
}

_GENERATION = {
    "200": {"description": "the completion (JSON), or its events (SSE: `id:` = event "
            "number, headers x-pdserve-stream-id and, with keys, x-pdserve-stream-token)",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}}}},
    **_errors(400, 401, 404, 413, 429, 503, 504)}

# Headers a generation request may carry.
_GENERATION_HEADERS = [
    {"name": "x-session-id", "in": "header", "required": False,
     "description": "keeps a conversation's turns on the decode worker holding its KV",
     "schema": {"type": "string", "maxLength": 256}},
    {"name": "x-pdserve-sse", "in": "header", "required": False,
     "description": "SSE framing: plain (OpenAI's, the default) or resumable (`id:`, "
                    "`retry:`, keepalive comments)",
     "schema": {"enum": ["plain", "resumable"]}},
    {"name": "x-pdserve-timeout-ms", "in": "header", "required": False,
     "description": "the request's budget (at most the edge's 600 s): every hop's deadline "
                    "comes from it; past it, 504 deadline_exceeded (or an error event)",
     "schema": {"type": "string", "pattern": "^[0-9]{1,9}$"}},
]

_STREAM_ID = {"name": "stream_id", "in": "path", "required": True,
              "schema": {"type": "string", "maxLength": 128}}

_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True,
                "schema": {"type": "string", "maxLength": 128}}
_RESPONSE_FIELDS = {
    "model": {"type": "string"},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                             "items": {"type": "object"}}]},
    "instructions": {"type": ["string", "null"]},
    "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"],
    "top_k": _SAMPLING["top_k"], "seed": _SAMPLING["seed"], "stop": _SAMPLING["stop"],
    "text": {"type": ["object", "null"], "properties": {"format": {"type": "object"}}},
    "tools": {"type": ["array", "null"], "items": {"type": "object"}},
    "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"},
                              {"type": "null"}]},
    "parallel_tool_calls": {"type": ["boolean", "null"]},
    "stream": {"type": ["boolean", "null"]}, "background": {"type": ["boolean", "null"]},
    "store": {"type": ["boolean", "null"]},
    "previous_response_id": {"type": ["string", "null"]},
    "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
    "user": {"type": ["string", "null"]}, "safety_identifier": {"type": ["string", "null"]},
    "prompt_cache_key": {"type": ["string", "null"]},
    "truncation": {"enum": ["disabled", None]}, "service_tier": {"enum": ["auto", None]},
    "include": {"type": ["array", "null"], "maxItems": 0},
}

SPEC = {
    "openapi": "3.1.0",
    "info": {"title": "pdserve edge", "version": "1",
             "description": "OpenAI-compatible chat/completions with resumable streams."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {"Error": {"type": "object", "required": ["error"], "properties": {
            "error": {"type": "object", "required": ["message", "type"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}},
    },
    "security": [{"bearer": []}],
    "paths": {
        "/v1/chat/completions": {"post": {
            "operationId": "chat", "parameters": _GENERATION_HEADERS,
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["model", "messages"],
                "properties": {**_SAMPLING, "max_completion_tokens": _SAMPLING["max_tokens"],
                               "logprobs": {"type": ["boolean", "null"]},
                               "top_logprobs": {"type": ["integer", "null"], "minimum": 0,
                                                "maximum": 20},
                               "tools": {"type": ["array", "null"], "minItems": 1,
                                         "items": {"type": "object"}},
                               "tool_choice": {"oneOf": [
                                   {"enum": ["none", "auto", "required"]},
                                   {"type": "object"}, {"type": "null"}]},
                               "parallel_tool_calls": {"type": ["boolean", "null"]},
                               "messages": {"type": "array", "minItems": 1, "maxItems": 1024,
                                            "items": {"type": "object",
                                                      "required": ["role", "content"],
                                                      "properties": {
                                                          "role": {"enum": ["system", "user",
                                                                            "assistant"]},
                                                          "content": {"type": "string"}}}}}}}}},
            "responses": _GENERATION}},
        "/v1/completions": {"post": {
            "operationId": "completion", "parameters": _GENERATION_HEADERS,
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["model", "prompt"],
                "properties": {**_SAMPLING,
                               "logprobs": {"type": ["integer", "null"], "minimum": 0,
                                            "maximum": 5},
                               "echo": {"type": ["boolean", "null"]},
                               "prompt": {"oneOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "integer",
                                                               "minimum": 0}}]}}}}}},
            "responses": _GENERATION}},
        "/tokenize": {"post": {
            "operationId": "tokenize",
            "description": "vLLM's: a prompt or chat messages as the token ids the edge sends",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "properties": {
                    "model": {"type": ["string", "null"]},
                    "prompt": {"type": "string"},
                    "messages": {"type": "array", "items": {"type": "object"}},
                    "add_special_tokens": {"type": ["boolean", "null"]},
                    "add_generation_prompt": {"type": ["boolean", "null"]},
                    "return_token_strs": {"type": ["boolean", "null"]}}}}}},
            "responses": {"200": {"description": "count, max_model_len, tokens, token_strs",
                                  "content": {"application/json": {"schema": {
                                      "type": "object"}}}},
                          **_errors(400, 401, 404, 413)}}},
        "/detokenize": {"post": {
            "operationId": "detokenize",
            "description": "vLLM's: token ids as text",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["tokens"], "properties": {
                    "model": {"type": ["string", "null"]},
                    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}}}},
            "responses": {"200": {"description": "prompt: the text",
                                  "content": {"application/json": {"schema": {
                                      "type": "object"}}}},
                          **_errors(400, 401, 404, 413)}}},
        "/v1/models": {"get": {"operationId": "models", "responses": {
            "200": {"description": "the served model",
                    "content": {"application/json": {"schema": {"type": "object"}}}},
            **_errors(401)}}},
        "/v1/streams/{stream_id}": {
            "get": {"operationId": "follow_stream", "parameters": [
                _STREAM_ID, {"name": "Last-Event-ID", "in": "header", "required": False,
                             "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}},
                {"name": "last_event_id", "in": "query", "required": False,
                 "description": "as Last-Event-ID, for a client that cannot send it",
                 "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}},
                {"name": "token", "in": "query", "required": False,
                 "description": "the stream's read token (header x-pdserve-stream-token of "
                 "the response that created it), instead of the key",
                 "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the stream's events after Last-Event-ID, "
                                      "then live", "content": {"text/event-stream": {
                                          "schema": {"type": "string"}}}},
                              "204": {"description": "the stream is over; nothing after "
                                      "Last-Event-ID"},
                              **_errors(400, 401, 404, 410)}},
            "delete": {"operationId": "cancel_stream", "parameters": [_STREAM_ID],
                       "responses": {"200": {"description": "cancelled (or already over)",
                                             "content": {"application/json": {
                                                 "schema": {"type": "object"}}}},
                                     **_errors(401, 404)}}},
        "/v1/responses": {"post": {
            "operationId": "create_response", "parameters": _GENERATION_HEADERS[:1] + [
                _GENERATION_HEADERS[2]],
            "description": "OpenAI's Responses API (docs/responses.md); stream=true: typed "
                           "events, each with sequence_number",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["model", "input"],
                "properties": _RESPONSE_FIELDS}}}},
            "responses": {"200": {"description": "the Response (JSON), or its events (SSE)",
                                  "content": {"application/json": {"schema": {
                                      "type": "object"}},
                                      "text/event-stream": {"schema": {"type": "string"}}}},
                          **_errors(400, 401, 404, 413, 429, 503, 504)}}},
        "/v1/responses/{response_id}": {
            "get": {"operationId": "retrieve_response", "parameters": [
                _RESPONSE_ID, {"name": "stream", "in": "query", "required": False,
                               "schema": {"enum": ["true", "false"]}},
                {"name": "starting_after", "in": "query", "required": False,
                 "description": "with stream=true: the events after this sequence_number",
                 "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}}],
                "responses": {"200": {"description": "the Response, or (stream=true) its "
                                      "events", "content": {
                                          "application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {
                                              "type": "string"}}}},
                              **_errors(400, 401, 404)}},
            "delete": {"operationId": "delete_response", "parameters": [_RESPONSE_ID],
                       "responses": {"200": {"description": "deleted (a running one is "
                                             "cancelled first)", "content": {
                                                 "application/json": {"schema": {
                                                     "type": "object"}}}},
                                     **_errors(401, 404)}}},
        "/v1/responses/{response_id}/cancel": {"post": {
            "operationId": "cancel_response", "parameters": [_RESPONSE_ID],
            "responses": {"200": {"description": "the Response, cancelled (or already over)",
                                  "content": {"application/json": {"schema": {
                                      "type": "object"}}}},
                          **_errors(400, 401, 404)}}},
        "/v1/ws": {"get": {"operationId": "websocket", "description": "WebSocket: see the "
                           "README (first message: an OpenAI request or a resume)",
                           "responses": {"101": {"description": "switching protocols"},
                                         **_errors(400, 401)}}},
        "/health": {"get": {"operationId": "health", "security": [], "responses": {
            "200": {"description": "ready", "content": {"application/json": {
                "schema": {"type": "object"}}}},
            "503": {"description": "not ready, or draining", "content": {
                "application/json": {"schema": {"type": "object"}}}}}}},
        "/metrics": {"get": {"operationId": "metrics", "security": [], "responses": {
            "200": {"description": "Prometheus text", "content": {
                "text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"operationId": "openapi", "security": [], "responses": {
            "200": {"description": "this document", "content": {
                "application/json": {"schema": {"type": "object"}}}}}}},
    },
}

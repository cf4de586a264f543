"""Tracing and structured logs, shared by every pdserve process.

One request is one trace: the edge accepts a client's W3C `traceparent` (the
aiohttp instrumentation's server span), and every internal gRPC call carries
the context in its metadata (the gRPC instrumentation's client and server
interceptors, installed in `pdserve.rpc`; token streams carry their caller's span
in metadata instead, see `metadata()`). pdserve adds the spans those cannot
know: the generation ("chat {model}", with the GenAI attributes of `pdserve/genai.py`)
and its steps — admit, route, prefill, decode, stream at the edge, kv_transfer
on the decode worker.

Export is OTLP, configured by the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_PROTOCOL`: http/protobuf unless grpc, `OTEL_TRACES_EXPORTER`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_*`, `OTEL_TRACES_SAMPLER`). It is off
unless one of them asks for traces, and free when off: no interceptor, no
middleware, and `span()` hands out one shared no-op span.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode

_tracer: trace.Tracer | None = None          # set by setup() when tracing is on


def wanted() -> bool:
    """Whether the OTEL_* environment asks for traces."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or
                env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def enabled() -> bool:
    return _tracer is not None


def setup(service: str) -> bool:
    """Install the tracer provider for this process (service.name = `service` unless
    OTEL_SERVICE_NAME says otherwise) when the environment asks for traces."""
    global _tracer
    if _tracer is not None or not wanted():
        return _tracer is not None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service)})
    provider = TracerProvider(resource=resource)      # sampler: OTEL_TRACES_SAMPLER
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
        exporter = ConsoleSpanExporter()
    # The specification's default protocol, http/protobuf; grpc when asked. The gRPC
    # exporter's sync calls from its thread cost the edge's token tails more
    # (docs/design/2026-12-01-tracing-over-otlp-http.md).
    elif os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)               # flush what is still queued
    _tracer = trace.get_tracer("pdserve")
    logging.getLogger(__name__).info("tracing on: %s spans as service %s",
                                     type(exporter).__name__, resource.attributes[SERVICE_NAME])
    return True


def span(name: str, parent: Span | None = None, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
         attributes: dict | None = None) -> Span:
    """A started span (end it yourself), child of `parent` or of the current span; the
    shared no-op span when tracing is off."""
    if _tracer is None:
        return INVALID_SPAN
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    return _tracer.start_span(name, context=ctx, kind=kind, attributes=attributes)


@contextlib.contextmanager
def current(s: Span):
    """Make `s` the current span inside the block (calls and tasks started there are
    its children); does not end it."""
    if s is INVALID_SPAN:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(s))
    try:
        yield
    finally:
        otel_context.detach(token)


def end(s: Span, error: BaseException | str | None = None, attributes: dict | None = None,
        **named) -> None:
    """End `s` with `attributes` and `named` ones (`a__b=1` sets "a.b"), and an error
    status when `error` is given."""
    if s is INVALID_SPAN:
        return
    if attributes:
        s.set_attributes(attributes)
    if named:
        s.set_attributes({k.replace("__", "."): v for k, v in named.items()})
    if error is not None:
        s.set_status(Status(StatusCode.ERROR, str(error)[:200] or type(error).__name__))
    s.end()


# The calls that belong to a request; heartbeats, load polls, KV-event feeds and
# health checks would each start a trace of their own, every second.
_REQUEST_METHODS = ("Route", "Generate", "Abort", "Claim", "Release")


# Token streams are traced by the caller's own span (prefill, decode) with the context
# in `metadata()`: the client interceptor would put a generator hop on every token.
_STREAMS = ("Generate",)


# A shared call of many generations (services/worker/batched.py) is no request of its
# own: each generation gets its span there, from its own metadata.
_SHARED_CALLS = "pdserve.v1.BatchedGenerate"


def _request_calls(client: bool = False):
    from opentelemetry.instrumentation.grpc import filters
    methods = [m for m in _REQUEST_METHODS if not (client and m in _STREAMS)]
    return filters.all_of(filters.any_of(*(filters.method_name(m) for m in methods)),
                          filters.negate(filters.service_name(_SHARED_CALLS)))


def metadata() -> tuple | None:
    """gRPC metadata carrying the current span's context (W3C traceparent), for calls
    made without the client interceptor; None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import propagate
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def server_interceptors() -> list:
    """gRPC aio server interceptors that continue the caller's trace (none when off)."""
    if _tracer is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor
    return [aio_server_interceptor(filter_=_request_calls())]


def client_interceptors() -> list:
    """gRPC aio client interceptors that carry the current trace (none when off)."""
    if _tracer is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors
    return list(aio_client_interceptors(filter_=_request_calls(client=True)))


def instrument_http() -> None:
    """aiohttp applications made from now on start each request's server span from its
    `traceparent` (the instrumentation adds its middleware); nothing when off."""
    if _tracer is None:
        return
    # Probes and scrapes are not requests: no trace of their own.
    os.environ.setdefault("OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS", "/health,/metrics")
    from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor
    instrumentor = AioHttpServerInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()


class JSONFormatter(logging.Formatter):
    """One JSON object a line, with the trace and span ids of the request whose span
    is current (with tracing on, every line logged while serving a request)."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z", "level": record.levelname,
                "process": self.process, "logger": record.name, "msg": record.getMessage()}
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            line["trace_id"] = format(ctx.trace_id, "032x")
            line["span_id"] = format(ctx.span_id, "016x")
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(process: str, level: str, fmt: str) -> None:
    """Root logging for one pdserve process: `text` (human) or `json` (one object a line)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JSONFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s {process:>7} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])

"""A local OTLP/gRPC trace collector: processes export to it over the real
exporter, and the caller reads the spans it kept in memory (the trace tests;
`pdserve bench edge`'s traced path)."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class CollectedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    status: int                         # 0 unset, 1 ok, 2 error
    attributes: dict = field(default_factory=dict)
    start_ns: int = 0                   # the span's start and end (Unix epoch, ns)
    end_ns: int = 0


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Serves OTLP TraceService/Export on 127.0.0.1 and keeps every span."""

    def __init__(self):
        self.spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        # OTLP/HTTP (protobuf) too: POST /v1/traces on http_port.
        collector = self

        class _HTTP(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                collector.Export(request, None)
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _HTTP)
        self.http_port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        """OTLP/gRPC (OTEL_EXPORTER_OTLP_ENDPOINT with the default protocol)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def http_endpoint(self) -> str:
        """OTLP/HTTP (with OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf)."""
        return f"http://127.0.0.1:{self.http_port}"

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(CollectedSpan(
                        service=service, name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        kind=s.kind, status=s.status.code,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano))
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[CollectedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set, timeout: float = 20.0
                 ) -> list[CollectedSpan]:
        """The trace's spans once every one of `names` arrived (exporters batch): a span
        name, or (service, name) for the same name in several processes."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            seen = {s.name for s in spans} | {(s.service, s.name) for s in spans}
            if names <= seen or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.stop(0)
        self.http.shutdown()
        self.http.server_close()

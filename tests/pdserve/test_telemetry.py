"""Tracing is off unless the OTEL_* environment asks, free when off; JSON log lines
carry the trace id of the request being served."""
from __future__ import annotations

import json
import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from pdserve import telemetry


@pytest.mark.parametrize("env, wanted", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, False),
])
def test_tracing_is_wanted_only_when_the_environment_asks(monkeypatch, env, wanted):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert telemetry.wanted() is wanted


def test_off_costs_no_interceptor_and_hands_out_the_no_op_span():
    assert not telemetry.enabled()              # this test process never called setup()
    assert telemetry.server_interceptors() == [] and telemetry.client_interceptors() == []
    s = telemetry.span("decode", attributes={"a": 1})
    assert s is trace.INVALID_SPAN
    with telemetry.current(s):
        assert trace.get_current_span() is trace.INVALID_SPAN
    telemetry.end(s, "ignored", pdserve__x=1)   # no error, nothing recorded


def _line(formatter: logging.Formatter, msg: str) -> dict:
    record = logging.LogRecord("pdserve.edge", logging.INFO, __file__, 1, msg, (), None)
    return json.loads(formatter.format(record))


def test_json_log_lines_carry_the_current_trace_and_span_ids():
    fmt = telemetry.JSONFormatter("edge")
    plain = _line(fmt, "starting")
    assert plain["msg"] == "starting" and plain["process"] == "edge"
    assert plain["level"] == "INFO" and "trace_id" not in plain
    tracer = TracerProvider().get_tracer("test")        # local: the global one stays unset
    with tracer.start_as_current_span("chat m") as span:
        line = _line(fmt, "request r1 done: path=disaggregated")
    ctx = span.get_span_context()
    assert line["trace_id"] == format(ctx.trace_id, "032x")
    assert line["span_id"] == format(ctx.span_id, "016x")
    assert line["msg"] == "request r1 done: path=disaggregated"

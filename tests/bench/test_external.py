"""`pdserve bench external`'s parts that need no engine: each tool's result-file parser
over a trimmed copy of a report the tool itself wrote against pdserve's edge
(tests/bench/external_samples/), the command lines and config it builds, and the
comparison with pdserve's runner."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pdserve.bench import external
from pdserve.bench.third_party import Shape, aiperf, guidellm, inference_perf

SAMPLES = Path(__file__).parent / "external_samples"


@pytest.fixture
def samples(tmp_path: Path) -> Path:
    """The samples laid out as each tool leaves them (aiperf and inference-perf nest
    their reports in a run directory)."""
    (tmp_path / "guidellm").mkdir()
    (tmp_path / "guidellm" / guidellm.REPORT).write_bytes((SAMPLES / guidellm.REPORT).read_bytes())
    for tool in (aiperf, inference_perf):
        nested = tmp_path / tool.NAME / "run-20261206"
        nested.mkdir(parents=True)
        (nested / tool.REPORT).write_bytes((SAMPLES / tool.REPORT).read_bytes())
    return tmp_path


def raw(name: str) -> dict:
    return json.loads((SAMPLES / name).read_text())


def test_guidellm_report_reads_its_ttft_and_per_request_itl_as_tpot(samples):
    f = guidellm.parse(samples / "guidellm")
    (bench,) = raw(guidellm.REPORT)["benchmarks"]
    itl = bench["metrics"]["inter_token_latency_ms"]["successful"]["percentiles"]
    assert (f.completed, f.failed) == (6, 0)
    assert (f.tpot_p50_ms, f.tpot_p99_ms) == (itl["p50"], itl["p99"])
    assert f.itl_p50_ms is None and f.itl_p99_ms is None, "guidellm has no per-chunk gap"
    assert f.request_throughput == pytest.approx(6 / bench["duration"])
    # 6 requests x 16 tokens over its duration
    assert f.output_token_throughput == pytest.approx(96 / bench["duration"])
    assert 0 < f.ttft_p50_ms <= f.ttft_p99_ms


def test_aiperf_report_reads_inter_chunk_as_itl_and_inter_token_as_tpot(samples):
    f = aiperf.parse(samples / "aiperf")
    r = raw(aiperf.REPORT)
    assert (f.completed, f.failed) == (6, 0)
    assert (f.itl_p50_ms, f.tpot_p50_ms) == (r["inter_chunk_latency"]["p50"],
                                             r["inter_token_latency"]["p50"])
    assert r["time_to_first_token"]["unit"] == "ms"
    assert 0 < f.ttft_p50_ms <= f.ttft_p99_ms


def test_inference_perf_report_converts_its_seconds_to_ms(samples):
    f = inference_perf.parse(samples / "inference-perf")
    lat = raw(inference_perf.REPORT)["successes"]["latency"]
    assert (f.completed, f.failed) == (6, 0)
    assert f.ttft_p50_ms == pytest.approx(1000 * lat["time_to_first_token"]["median"], abs=1e-3)
    assert f.itl_p99_ms == pytest.approx(1000 * lat["inter_token_latency"]["p99"], abs=1e-3)
    assert f.tpot_p50_ms == pytest.approx(1000 * lat["time_per_output_token"]["median"], abs=1e-3)


def test_a_missing_report_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="summary_lifecycle_metrics.json"):
        inference_perf.parse(tmp_path)
    with pytest.raises(FileNotFoundError, match="profile_export_aiperf.json"):
        aiperf.parse(tmp_path)


def test_every_tool_is_given_the_same_shape():
    shape = Shape(prompt_tokens=300, output_tokens=20, requests=12, rate=3.0, seed=7)
    url, model, tok = "http://127.0.0.1:1", "served-name", "/models/tiny"
    g = " ".join(guidellm.command(shape, url, model, tok, Path("/o")))
    assert "prompt_tokens=300,output_tokens=20" in g and "count=12" in g \
        and "kind=poisson,rate=3.0" in g and f"model={model}," in g and f"model={tok}" in g
    a = aiperf.command(shape, url, model, tok, Path("/o"))
    for flag, value in (("--prompt-input-tokens-mean", "300"), ("--request-count", "12"),
                        ("--prompt-output-tokens-mean", "20"), ("--request-rate", "3.0"),
                        ("--tokenizer", tok), ("--model", model), ("--arrival-pattern", "poisson")):
        assert a[a.index(flag) + 1] == value, f"aiperf {flag}: {a}"
    c = inference_perf.config(shape, url, model, tok, Path("/o"))
    assert c["data"]["input_distribution"]["mean"] == 300
    assert c["data"]["output_distribution"]["max"] == 20
    assert c["load"]["stages"] == [{"rate": 3.0, "duration": 4}]       # 12 requests at 3/s
    assert (c["server"]["model_name"], c["tokenizer"]["pretrained_model_name_or_path"]) \
        == (model, tok)


def test_agreement_divides_only_what_both_report():
    runner = {"ttft_p50_ms": 40.0, "ttft_p99_ms": 80.0, "itl_p50_ms": 5.0, "itl_p99_ms": 20.0,
              "tpot_p50_ms": 6.0, "tpot_p99_ms": 9.0, "request_throughput": 2.0,
              "output_token_throughput": 0.0}
    tool = {**runner, "ttft_p50_ms": 44.0, "itl_p50_ms": None, "itl_p99_ms": None,
            "tpot_p50_ms": 3.0}
    got = external.agreement(tool, runner)
    assert got["ttft_p50_ms"] == 1.1 and got["tpot_p50_ms"] == 0.5
    assert "itl_p50_ms" not in got and "output_token_throughput" not in got


def test_a_tool_that_fails_raises_with_its_output(tmp_path, monkeypatch):
    class Failing:
        NAME = "failing"

        @staticmethod
        def command(*_args):
            return [sys.executable, "-c", "import sys; print('no server here'); sys.exit(3)"]

        @staticmethod
        def env():
            return {}

    monkeypatch.setitem(external.TOOLS, "failing", Failing)
    with pytest.raises(RuntimeError, match="(?s)failing exited 3.*no server here"):
        external.run_tool("failing", Shape(), "http://127.0.0.1:1", "m", "/t", tmp_path)


def test_bad_arguments_exit_2(capsys):
    assert external.main(["--tools", "guidellm,vllm"]) == 2
    assert "--tools is a subset" in capsys.readouterr().err
    assert external.main(["--output-tokens", "1"]) == 2


def test_shared_prefix_replaces_only_the_data_of_inference_perfs_config():
    shape = Shape(output_tokens=24, requests=30, rate=2.0, seed=3)
    c = inference_perf.config(shape, "http://127.0.0.1:1", "m", "/t", Path("/o"),
                              data=inference_perf.shared_prefix(shape, 4, 3, 512, 64))
    sp = c["data"]["shared_prefix"]
    assert c["data"]["type"] == "shared_prefix" and "input_distribution" not in c["data"]
    assert (sp["output_len"], sp["seed"], sp["num_groups"], sp["num_prompts_per_group"],
            sp["system_prompt_len"], sp["question_len"]) == (24, 3, 4, 3, 512, 64)
    assert c["load"]["stages"] == [{"rate": 2.0, "duration": 15}]


def test_constant_arrivals_reach_every_tool():
    shape = Shape(arrival="constant", rate=4.0)
    args = ("http://127.0.0.1:1", "m", "/t", Path("/o"))
    assert "kind=constant,rate=4.0" in guidellm.command(shape, *args)
    a = aiperf.command(shape, *args)
    assert a[a.index("--arrival-pattern") + 1] == "constant"
    assert inference_perf.config(shape, *args)["load"]["type"] == "constant"
    with pytest.raises(ValueError, match="arrival"):
        Shape(arrival="bursty")


def test_each_run_carries_the_edges_own_mean_ttft_over_it():
    """The server's view beside the client's: the edge histogram's sum and count, before and
    after the run, give the mean TTFT the edge saw for that run's requests alone."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    pages = iter([(1.0, 10), (3.5, 15)])              # 5 requests in 2.5 s: 500 ms each

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            s, n = next(pages)
            body = (f"pdserve:time_to_first_token_seconds_sum {s}\n"
                    f"pdserve:time_to_first_token_seconds_count {n}\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = external._timed(lambda: {"completed": 5}, [],
                              f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert got["completed"] == 5 and got["edge_ttft_mean_ms"] == 500.0

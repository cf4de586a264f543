"""The ecosystem's gateway in front of pdserve's workers: the Shepherd Model Gateway
(`smg launch --pd-disaggregation`, Rust) drives pdserve's prefill and decode workers
over vLLM's engine protocol; its completions equal a single stock vLLM engine's and
the KV travels from prefill to decode."""
from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cases import CASES
from support import Proc, free_port
from test_engine_protocol import external_kv_tokens


def _decode_log(stack, request_id: str) -> str | None:
    """The decode worker's log line for `request_id`, once it is there."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for line in stack.proc.lines:
            if f"generate {request_id} on decode" in line:
                return line
        time.sleep(0.1)
    return None


@pytest.fixture(scope="module")
def smg(stack, model_dir):
    exe = Path(sys.executable).with_name("smg")
    if not exe.exists():
        exe = Path(shutil.which("smg") or "smg")
    port = free_port()
    proc = Proc([str(exe), "launch", "--pd-disaggregation",
                 "--prefill", f"grpc://{stack.prefill}", "--decode", f"grpc://{stack.decode}",
                 "--host", "127.0.0.1", "--port", str(port), "--model-path", str(model_dir),
                 # its metrics server binds 0.0.0.0:29000 unless told otherwise
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                 "--log-level", "warn"], name="smg")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                    if r.status == 200 and json.loads(r.read())["data"]:
                        break
            except OSError:
                pass
            assert proc.popen.poll() is None, "\n".join(proc.lines[-40:])
            time.sleep(0.5)
        else:
            raise AssertionError("smg not ready:\n" + "\n".join(proc.lines[-40:]))
        yield url
    finally:
        proc.stop(timeout=30)


@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "completion"],
                         ids=lambda c: c.name)
def test_smg_over_pdserve_workers_equals_single_engine(smg, stack, reference, case):
    before = external_kv_tokens(stack)
    req = urllib.request.Request(f"{smg}/v1/completions",
                                 data=json.dumps(case.body(stack.model, False)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        body = json.loads(r.read())
    # SMG encodes completion prompts without the tokenizer's special tokens (no BOS),
    # so its reference is the stock engine's answer to exactly those ids.
    ref = reference[f"{case.name}/no-special-tokens"]
    assert body["choices"][0]["text"] == ref["text"]
    prompt_tokens = ref["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    # The decode worker took the prompt's KV from the prefill worker: it computed
    # only the last prompt token itself (vLLM's own counter, on the worker's /metrics).
    line = _decode_log(stack, body["id"])
    assert line and "(KV pulled from a prefill worker)" in line, line
    pulled = external_kv_tokens(stack) - before
    assert prompt_tokens - 1 <= pulled <= prompt_tokens

"""Real streaming clients against the edge: the OpenAI SDK (sync and async), `curl -N`,
and a browser's EventSource (Debian's chromium, driven by Playwright) that resumes by
itself when the connection drops. The synthetic decode worker paces the tokens."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time

import openai
import pytest

from pdserve.bench.synthetic import read_stamps
from support import parse_sse
from synthetic_stack import edge_stack


@pytest.fixture
async def stack(model_dir):
    async with edge_stack(model_dir, rate=100.0, stream_resume_seconds=10.0) as s:
        yield s


async def test_openai_sdk_sync_and_async_stream(stack):
    def sync_text() -> tuple[str, str]:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
        raw = client.completions.with_raw_response.create(
            model=stack.model, prompt="hello", max_tokens=12, stream=True)
        text = "".join(c.choices[0].text for c in raw.parse() if c.choices)
        return raw.headers["x-pdserve-stream-id"], text

    sid, text = await asyncio.to_thread(sync_text)
    assert sid.startswith("str_") and len(read_stamps(text)) == 12
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    parts = []
    async for chunk in await client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
            stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        else:
            assert chunk.usage.completion_tokens > 0
    assert len(read_stamps("".join(parts))) == 12
    await client.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_n_gets_events_as_they_come(stack):
    body = json.dumps(stack.body(40))
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sN", "-D", "-", f"{stack.url}/v1/completions", "-H",
        "Content-Type: application/json", "-d", body, stdout=subprocess.PIPE)
    arrivals, lines = [], []
    while line := await proc.stdout.readline():
        lines.append(line.decode())
        if line.startswith(b"data: {"):
            arrivals.append(time.monotonic())
    assert await proc.wait() == 0
    assert any(line.lower().startswith("x-pdserve-stream-id: str_") for line in lines)
    assert lines[-2].strip() == "data: [DONE]"
    # 40 tokens at 100/s: the events arrived spread over ~0.4 s, not at once.
    assert arrivals[-1] - arrivals[0] > 0.25


PAGE = """<!doctype html><script>
window.events = []; window.errors = 0;
const es = new EventSource("/v1/streams/SID?token=TOKEN");
es.onmessage = (e) => {
  window.events.push([e.lastEventId, e.data]);
  if (e.data === "[DONE]") { es.close(); window.done = true; }
};
es.onerror = () => { window.errors += 1; };
</script>"""


async def _cutting_proxy(target_port: int, cut_after: int, seen: list[bytes]):
    """A TCP proxy that drops the first stream read at the first HTTP chunk boundary
    past `cut_after` response bytes (the first stream read, not the first connection:
    the browser may ask for its favicon first). At a boundary, not inside a chunk:
    a reader that arrives late gets the events so far as one chunk, and chromium,
    cut inside it, was seen to dispatch none of it and so had no event id to come
    back with (it replayed from the start: no gap, no duplicate, but no
    Last-Event-ID to test)."""
    async def handle(reader, writer):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", target_port)
        head = await reader.readuntil(b"\r\n\r\n")
        first = b"GET /v1/streams/" in head and not any(b"GET /v1/streams/" in h for h in seen)
        seen.append(head)
        up_w.write(head)

        async def pipe(src, dst):
            try:
                while data := await src.read(4096):
                    dst.write(data)
            finally:
                dst.close()

        async def cut(src, dst):
            try:
                dst.write(await src.readuntil(b"\r\n\r\n"))     # the response's head
                sent = 0
                while sent < cut_after:
                    size = await src.readuntil(b"\r\n")
                    chunk = await src.readexactly(int(size, 16) + 2)
                    dst.write(size + chunk)
                    sent += len(size) + len(chunk)
                    if size.strip() == b"0":
                        return                              # the body ended first
            finally:
                dst.close()
        await asyncio.gather(pipe(reader, up_w), cut(up_r, writer) if first else pipe(up_r, writer),
                             return_exceptions=True)
        up_w.close()
        writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (make test installs it as root)")
async def test_browser_eventsource_resumes_by_itself_after_a_drop(model_dir, tmp_path):
    """With API keys on: a server creates the stream with its key and hands the page
    the stream's read token; the browser's EventSource (which cannot send headers)
    follows with `?token=`, and its own reconnects keep it."""
    import aiohttp
    key = "sk-page-" + "p" * 32
    (tmp_path / "keys").write_text(f"{key} web normal\n")
    async with edge_stack(model_dir, rate=100.0, stream_resume_seconds=10.0,
                          api_keys_file=str(tmp_path / "keys")) as stack:
        async def start() -> tuple[str, str]:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{stack.url}/v1/completions", json=stack.body(120),
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                    return r.headers["x-pdserve-stream-id"], r.headers["x-pdserve-stream-token"]
        events, errors, seen = await _follow_in_a_browser(stack, start)
    ids = [int(i) for i, _ in events]
    assert ids == list(range(1, len(ids) + 1)), "a gap or a duplicate"
    text = "".join(json.loads(d)["choices"][0]["text"] for _, d in events if d != "[DONE]")
    assert len(read_stamps(text)) == 120
    assert errors >= 1                           # the drop happened...
    resumes = [h for h in seen if b"GET /v1/streams/" in h and b"last-event-id" in h.lower()]
    lines = [h.splitlines()[0] for h in seen]
    assert resumes, f"the browser never came back with Last-Event-ID: {lines}, {errors} errors"
    assert all(b"token=" in h and b"authorization" not in h.lower() for h in seen)


async def _follow_in_a_browser(stack, start):
    """The page's events and errors, and every request head the browser sent. The
    stream is started (`start()` -> its id and read token) once the browser is up,
    so that the page follows it live and the cut comes mid-stream."""
    from playwright.async_api import async_playwright
    seen: list[bytes] = []
    edge_port = int(stack.url.rsplit(":", 1)[1])
    proxy = await _cutting_proxy(edge_port, 3000, seen)
    origin = f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=shutil.which("chromium"),
                                               args=["--no-sandbox"])
            page = await browser.new_page()
            sid, token = await start()
            await page.route(f"{origin}/page", lambda route: route.fulfill(
                body=PAGE.replace("SID", sid).replace("TOKEN", token), content_type="text/html"))
            await page.goto(f"{origin}/page")
            await page.wait_for_function("window.done === true", timeout=20_000)
            events = await page.evaluate("window.events")
            errors = await page.evaluate("window.errors")
            await browser.close()
    finally:
        proxy.close()
    return events, errors, seen


async def test_vllm_benchmark_client_reads_the_default_framing(stack):
    """vLLM's benchmark request functions read `data:` lines only: with no header a POST
    gets OpenAI's framing (no `id:`/`retry:`), and the stream still has its id."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (RequestFuncInput,
                                                             async_request_openai_completions)
    req = RequestFuncInput(prompt="hello", api_url=f"{stack.url}/v1/completions", prompt_len=1,
                           output_len=20, model=stack.model, ignore_eos=True)
    async with aiohttp.ClientSession() as http:
        out = await async_request_openai_completions(req, http)
        assert out.success, out.error
        assert len(read_stamps(out.generated_text)) == 20
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(3)) as r:
            raw = await r.text()
            assert r.headers["x-pdserve-stream-id"]
    assert "id:" not in raw and "retry:" not in raw and raw.endswith("data: [DONE]\n\n")


async def test_resumable_framing_on_request_and_bad_framing_refused(stack):
    """`x-pdserve-sse: resumable` numbers the events (and hints `retry:`); any other
    value is a 400 naming the header, before anything is generated."""
    import aiohttp
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(3),
                             headers={"x-pdserve-sse": "resumable"}) as r:
            raw = await r.text()
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(3),
                             headers={"x-pdserve-sse": "numbered"}) as bad:
            error = await bad.json()
    assert raw.startswith("retry: ") and "id: 1\ndata: {" in raw
    assert raw.endswith("data: [DONE]\n\n")
    assert bad.status == 400 and error["error"]["param"] == "x-pdserve-sse"


async def test_a_plain_client_resumes_after_the_data_lines_it_counted(stack):
    """A client that read n `data:` lines of the default framing and lost its
    connection resumes with `Last-Event-ID: n`: the rest, no gap, no duplicate."""
    import aiohttp
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(30)) as r:
            sid, seen = r.headers["x-pdserve-stream-id"], []
            async for line in r.content:
                if line.startswith(b"data: "):
                    seen.append(line[6:].strip().decode())
                if len(seen) == 7:
                    break                   # the connection drops here
        async with http.get(f"{stack.url}/v1/streams/{sid}",
                            headers={"Last-Event-ID": str(len(seen))}) as r:
            rest = [d for _, d in parse_sse(await r.text())]
    assert rest[-1] == "[DONE]"
    events = seen + rest[:-1]
    text = "".join(json.loads(d)["choices"][0]["text"] for d in events if json.loads(d)["choices"])
    stamps = read_stamps(text)
    assert len(stamps) == 30 and stamps == sorted(set(stamps)), stamps

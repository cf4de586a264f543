"""One streamed chat turn against an edge, timed: what session measurements send."""
from __future__ import annotations

import json
import time
import urllib.request


def chat_turn(url: str, model: str, messages: list[dict], session: str,
              max_tokens: int = 16) -> tuple[dict, str, float]:
    """(response headers, lower-cased; the reply; ms to its first token) of one greedy
    streamed turn sent with `x-session-id: session`."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "x-session-id": session})
    started, first, text = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=300) as r:
        headers = {k.lower(): v for k, v in r.headers.items()}
        for line in r:
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
    return headers, "".join(text), 1000 * (first - started)

"""Turn 1 vs turn 2 of chat sessions on a decode pool: where each lands, and its TTFT.

Starts `pdserve up --decode-workers 2` (or uses --url of a running stack), warms
it up, then for each of N sessions sends turn 1 (a long history: ~`--history`
tokens) and, once it is answered, turn 2 (that history + the reply + a short new
message), both with the same `x-session-id`. Prints, per turn, the median TTFT,
the paths and placements the router chose, and whether turn 2 landed on turn 1's
decode worker; then the ratio turn 2 / turn 1.

    .venv/bin/python scripts/session_turns.py --sessions 8 --history 900
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path

from pdserve.bench.chat_turn import chat_turn
from pdserve.bench.deployments import Hardware, PdserveStack
from pdserve.tiny_model import ensure_tiny_model, synthetic_corpus


def _history(seed: int, tokens: int) -> list[dict]:
    words = " ".join(synthetic_corpus(seed, tokens // 10))
    return [{"role": "system", "content": "You are a careful storyteller."},
            {"role": "user", "content": words}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="", help="a running stack (default: start one)")
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--history", type=int, default=900, help="turn 1 prompt, ~tokens")
    a = p.parse_args()
    model = str(ensure_tiny_model(Path(a.model)).resolve())
    stack = None
    url = a.url
    if not url:
        hw = Hardware(device="cpu", units=tuple(sorted(os.sched_getaffinity(0))))
        stack = PdserveStack("session-turns", model, local_prefill_below=32, hw=hw,
                             decode_workers=2)
        url = stack.start()[0]
    try:
        for i in range(2):                      # NIXL handshakes, first-call costs
            chat_turn(url, model, _history(10_000 + i, a.history), f"warm-{i}")
        rows = []
        run = random.Random(time.time_ns()).randrange(1 << 30)   # fresh prompts every run
        for s in range(a.sessions):
            history = _history(run + s, a.history)
            h1, reply, t1 = chat_turn(url, model, history, f"s{run}-{s}")
            time.sleep(0.3)                     # the turn's stored-block events reach the router
            turn2 = history + [{"role": "assistant", "content": reply},
                               {"role": "user", "content": "And what happened next?"}]
            h2, _, t2 = chat_turn(url, model, turn2, f"s{run}-{s}")
            rows.append((h1, t1, h2, t2))
            print(f"session {s}: turn 1 {t1:7.1f} ms {h1['x-pdserve-path']:>13} on "
                  f"{h1['x-pdserve-worker']} | turn 2 {t2:7.1f} ms {h2['x-pdserve-path']:>13}"
                  f" ({h2['x-pdserve-placement']}) on {h2['x-pdserve-worker']}", flush=True)
        t1 = statistics.median(r[1] for r in rows)
        t2 = statistics.median(r[3] for r in rows)
        same = sum(r[0]["x-pdserve-worker"] == r[2]["x-pdserve-worker"] for r in rows)
        workers = Counter(r[0]["x-pdserve-worker"] for r in rows)
        print(f"turn 1 TTFT p50 {t1:.1f} ms, turn 2 TTFT p50 {t2:.1f} ms: ratio {t2 / t1:.2f}x; "
              f"turn 2 on turn 1's worker {same}/{len(rows)}; sessions per worker "
              f"{dict(workers)}; turn 2 placements "
              f"{dict(Counter(r[2]['x-pdserve-placement'] for r in rows))}")
    finally:
        if stack is not None:
            stack.stop()


if __name__ == "__main__":
    main()

"""The bench client against a paced fake endpoint: vLLM's timings come out right,
round-robin spreads requests, and sessions carry the conversation forward."""
from __future__ import annotations

import pytest
from vllm.benchmarks.datasets import SampleRequest

from fake_openai import FakeCompletions
from pdserve.bench.load import metrics, run
from pdserve.bench.slo import SLO, goodput
from pdserve.bench.workloads import Session, Workload


@pytest.fixture
async def servers():
    fakes = [FakeCompletions(gap_s=0.02, first_s=0.1), FakeCompletions(gap_s=0.02, first_s=0.1)]
    for f in fakes:
        await f.start()
    yield fakes
    for f in fakes:
        await f.stop()


def _requests(n: int, out: int) -> list[SampleRequest]:
    return [SampleRequest(prompt=f"p{i} hello world", prompt_len=3, expected_output_len=out)
            for i in range(n)]


async def test_timings_follow_the_servers_pace(servers):
    result = await run(Workload("w", "", requests=_requests(4, 6)), [servers[0].url], "m",
                       rate=float("inf"))
    assert [o.success for o in result.outputs] == [True] * 4
    assert [o.output_tokens for o in result.outputs] == [6] * 4
    for o in result.outputs:
        assert 0.1 <= o.ttft < 0.5
        assert len(o.itl) == 5 and all(0.015 <= x < 0.3 for x in o.itl)
    m = metrics(result, tokenizer=None)
    assert m.completed == 4 and m.failed == 0 and m.total_output == 24
    assert 20 <= m.median_itl_ms < 300 and 100 <= m.median_ttft_ms < 500


async def test_requests_alternate_between_endpoints(servers):
    await run(Workload("w", "", requests=_requests(6, 2)), [s.url for s in servers], "m",
              rate=float("inf"))
    assert len(servers[0].prompts) == len(servers[1].prompts) == 3


async def test_sessions_send_each_turn_with_the_conversation_so_far(servers):
    turns = [SampleRequest(prompt=f" turn{t}", prompt_len=1, expected_output_len=3)
             for t in range(3)]
    result = await run(Workload("s", "", sessions=[Session(turns)]), [servers[0].url], "m",
                       rate=float("inf"))
    assert servers[0].prompts == [" turn0", " turn0aba turn1", " turn0aba turn1aba turn2"]
    assert len(result.outputs) == 3 and all(o.success for o in result.outputs)


async def test_goodput_counts_requests_within_both_limits(servers):
    result = await run(Workload("w", "", requests=_requests(4, 4)), [servers[0].url], "m",
                       rate=float("inf"))
    d = result.duration_s
    assert goodput(result.outputs, d, SLO(ttft_ms=5000, itl_ms=5000)) == pytest.approx(4 / d)
    assert goodput(result.outputs, d, SLO(ttft_ms=50, itl_ms=5000)) == 0  # first token at 100 ms
    assert goodput(result.outputs, d, SLO(ttft_ms=5000, itl_ms=5)) == 0   # tokens 20 ms apart


async def test_a_dead_endpoint_is_a_failed_request_not_a_crash():
    from support import free_port
    result = await run(Workload("w", "", requests=_requests(2, 2)),
                       [f"http://127.0.0.1:{free_port()}"], "m", rate=float("inf"))
    assert [o.success for o in result.outputs] == [False, False]
    assert goodput(result.outputs, result.duration_s, SLO(1e9, 1e9)) == 0

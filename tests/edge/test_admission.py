"""Admission: room in the pool as the workers report it, a bounded priority queue with
tenants taking turns, quick 503s when it is full, and drain."""
from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest

from pdserve.config import EdgeConfig
from pdserve.services.edge.admission import Admission, pool_capacity
from pdserve.services.edge.app import METRICS
from pdserve.services.edge.keys import PRIORITIES, APIKey
from pdserve.services.edge.openai_protocol import APIError
from pdserve.v1 import common_pb2, router_pb2
from support import parse_sse
from synthetic_stack import edge_stack


def key(tenant: str, priority: str = "normal") -> APIKey:
    return APIKey(key_id=tenant, tenant=tenant, priority=PRIORITIES[priority])


def _cfg(queue: int, wait: float) -> EdgeConfig:
    """An edge whose admission queues up to `queue` requests, each for up to `wait` s."""
    return EdgeConfig(model="-", admission_queue=queue, admission_wait_seconds=wait)


async def test_queued_requests_go_by_class_then_tenants_in_turn():
    adm = Admission(_cfg(100, 5))
    adm.observe(1)                               # room for one request at a time
    first = await adm.admit(key("x"))
    order = []

    async def ask(k: APIKey, label: str):
        ticket = await adm.admit(k)
        order.append(label)
        ticket.release()                            # done: the next one goes

    # A burst from tenant a, then one each from b and c, then a high-priority one.
    tasks = [asyncio.create_task(ask(key("a"), f"a{i}")) for i in range(4)]
    tasks += [asyncio.create_task(ask(key("b"), "b0")), asyncio.create_task(ask(key("c"), "c0"))]
    tasks.append(asyncio.create_task(ask(key("vip", "high"), "vip")))
    await asyncio.sleep(0)
    assert adm.queued == 7 and adm.in_flight == 1
    first.release()
    await asyncio.gather(*tasks)
    assert order == ["vip", "a0", "b0", "c0", "a1", "a2", "a3"]
    assert adm.in_flight == 0


async def test_the_tenant_holding_fewer_slots_goes_first():
    adm = Admission(_cfg(10, 5))
    adm.observe(2)
    held = [await adm.admit(key("a")) for _ in range(2)]         # a holds the pool
    order = []

    async def ask(tenant: str):
        ticket = await adm.admit(key(tenant))
        order.append(tenant)
        return ticket
    queued = [asyncio.create_task(ask(t)) for t in ("a", "a", "b")]
    await asyncio.sleep(0)
    assert adm.queued == 3
    adm.observe(5)                      # room for 3: b (holding none) first, then a
    await asyncio.sleep(0)
    assert order == ["b", "a"]          # in turn it would have been a first
    for t in held:
        t.release()
    tickets = await asyncio.gather(*queued)
    for t in tickets:
        t.release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_an_active_tenant_keeps_its_share_free_from_another_tenants_burst():
    adm = Admission(_cfg(10, 5))
    adm.observe(4)
    (await adm.admit(key("b"))).release()          # b is active (asked just now)
    a = [await adm.admit(key("a")) for _ in range(2)]     # a's share: 2 of 4
    third = asyncio.create_task(adm.admit(key("a")))
    await asyncio.sleep(0)
    assert adm.room == 2 and not third.done()       # b's share stays free for b
    b = [await adm.admit(key("b")) for _ in range(2)]     # at once, no wait
    assert adm.room == 0 and not third.done()
    b[0].release()                                  # b at 1 of its 2: still owed one
    await asyncio.sleep(0)
    assert not third.done()
    a[0].release()                                  # a below its share: its turn
    await asyncio.sleep(0)
    assert third.done()
    for t in [a[1], b[1], third.result()]:
        t.release()
    assert adm.in_flight == 0


async def test_a_tenant_below_its_share_on_average_takes_the_next_slot_for_a_peak(monkeypatch):
    import pdserve.services.edge.admission as admission
    clock = [1000.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    adm = Admission(_cfg(10, 60))       # holds of 10 s: waits are long
    adm.observe(4)
    light = await adm.admit(key("steady"))          # steady: 1 slot for 10 s ...
    clock[0] += 5
    (await adm.admit(key("steady"))).release()      # (asking at least every 5 s: active)
    clock[0] += 5
    light.release()
    burst = [await adm.admit(key("burst")) for _ in range(2)]   # ... burst: 2 for 10 s
    for _ in range(2):
        clock[0] += 5
        (await adm.admit(key("steady"))).release()  # steady keeps asking (stays active)
    steady = [await adm.admit(key("steady")) for _ in range(2)]  # steady at its share
    queued_burst = asyncio.create_task(adm.admit(key("burst")))
    peak = asyncio.create_task(adm.admit(key("steady")))        # steady's peak: a third
    await asyncio.sleep(0)
    assert adm.room == 0 and not queued_burst.done() and not peak.done()
    assert adm.use("steady", clock[0]) < 0.2 < 1.5 < adm.use("burst", clock[0])
    # Burst's slot ends: burst holds 1 of its 2 and is owed it, but steady has used
    # far less than its share: its peak takes the slot (at each instant's shares it
    # would wait for one of its own to end).
    burst[0].release()
    await asyncio.sleep(0)
    assert peak.done() and not queued_burst.done()
    for t in [burst[1], *steady, peak.result()]:
        t.release()
    await asyncio.wait_for(queued_burst, 1)
    queued_burst.result().release()
    assert adm.in_flight == 0


def preemptible(ticket, answer: bool = True) -> list:
    """Give `ticket` a stream's preemption hook; the list records each call."""
    calls = []
    ticket.on_preempt = lambda: calls.append(ticket.slot) or answer
    return calls


async def test_a_light_tenants_peak_takes_a_slot_back_from_a_heavy_tenant(monkeypatch):
    import pdserve.services.edge.admission as admission
    from pdserve.services.edge.metrics import EdgeMetrics
    clock = [1000.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    adm = Admission(_cfg(10, 60), metrics=EdgeMetrics())
    adm.observe(4)
    # As in the test above: for 20 s steady held 1 slot at most, burst 2 (its share).
    light = await adm.admit(key("steady"))
    clock[0] += 5
    (await adm.admit(key("steady"))).release()
    clock[0] += 5
    light.release()
    burst = [await adm.admit(key("burst")) for _ in range(2)]
    for _ in range(2):
        clock[0] += 5
        (await adm.admit(key("steady"))).release()
    steady = [await adm.admit(key("steady")) for _ in range(2)]
    hooks = [preemptible(t) for t in burst + steady]
    assert adm.room == 0
    # Steady's peak past its share: it preempts burst's newest request at once
    # (instead of waiting for one to end), and burst never takes one back from steady.
    assert adm.expected_wait(key("steady")) == 0.0
    peak = await asyncio.wait_for(adm.admit(key("steady")), 1)
    assert len(hooks[1]) == 1 and hooks[0] == [] and burst[1].slot == -1
    assert burst[1].preempted == 1
    assert adm.metrics.preemptions._value.get() == 1
    assert adm.in_flight == 4 and adm.shares.holding == {"steady": 3, "burst": 1}
    # The preempted request waits first in its tenant's line, ahead of a newer one.
    resumed = asyncio.create_task(burst[1].resume())
    queued_burst = asyncio.create_task(adm.admit(key("burst")))
    await asyncio.sleep(0)
    assert adm.queued == 2 and not resumed.done() and all(h == [] for h in hooks[2:])
    peak.release()                                  # a slot ends: the preempted one's
    await asyncio.wait_for(resumed, 1)
    assert burst[1].slot >= 0 and not queued_burst.done()
    for t in [burst[0], burst[1], *steady]:
        t.release()
    (await asyncio.wait_for(queued_burst, 1)).release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_burst_fills_a_share_its_owner_could_take_back(monkeypatch):
    import pdserve.services.edge.admission as admission
    clock = [1000.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    adm = Admission(_cfg(10, 60))
    adm.observe(4)
    (await adm.admit(key("steady"))).release()          # steady: active, using nothing
    burst = [await adm.admit(key("burst")) for _ in range(2)]
    third = asyncio.create_task(adm.admit(key("burst")))
    await asyncio.sleep(0)
    assert not third.done()             # alike so far: steady's share stays free
    third.cancel()
    for _ in range(2):                  # 10 s on: burst has used ~1.7 slots, steady ~0
        clock[0] += 5
        (await adm.admit(key("steady"))).release()
    # Now steady could take a slot back from burst: burst fills steady's share too.
    burst += [await asyncio.wait_for(adm.admit(key("burst")), 1) for _ in range(2)]
    assert adm.room == 0
    hooks = [preemptible(t) for t in burst]
    mine = await asyncio.wait_for(adm.admit(key("steady")), 1)     # and it does
    assert [len(h) for h in hooks] == [0, 0, 0, 1] and burst[3].slot == -1
    for t in [*burst[:3], mine]:
        t.release()
    assert adm.in_flight == 0


async def test_no_slot_is_taken_back_from_a_tenant_alone_alike_or_ending(monkeypatch):
    import pdserve.services.edge.admission as admission
    clock = [1000.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    adm = Admission(_cfg(10, 60))
    adm.observe(2)
    # One tenant: its own queued request never preempts its running ones.
    alone = [await adm.admit(key("a")) for _ in range(2)]
    hooks = [preemptible(t) for t in alone]
    waiting = asyncio.create_task(adm.admit(key("a")))
    await asyncio.sleep(0)
    assert not waiting.done() and hooks == [[], []]
    alone[0].release()
    (await asyncio.wait_for(waiting, 1)).release()
    alone[1].release()
    # Two tenants that used the pool alike (one slot each for 10 s): neither preempts.
    a, b = await adm.admit(key("a")), await adm.admit(key("b"))
    clock[0] += 10
    hooks = [preemptible(a), preemptible(b)]
    waiting = asyncio.create_task(adm.admit(key("a")))
    await asyncio.sleep(0)
    assert not waiting.done() and hooks == [[], []]
    waiting.cancel()
    # A heavy tenant's requests that cannot give their slots up now (their last
    # outputs came) are skipped: the light one waits for the next slot to end.
    a.release()
    clock[0] += 6                                           # a is gone quiet
    heavy = [b, await asyncio.wait_for(adm.admit(key("b")), 1)]
    clock[0] += 10
    declined = [preemptible(t, answer=False) for t in heavy]
    light = asyncio.create_task(adm.admit(key("c")))        # holds none of its share
    await asyncio.sleep(0)
    assert declined == [[heavy[0].slot], [heavy[1].slot]] and not light.done()
    assert [t.preempted for t in heavy] == [0, 0]
    heavy[0].release()
    (await asyncio.wait_for(light, 1)).release()
    heavy[1].release()
    assert adm.in_flight == 0


async def test_drain_lets_a_preempted_request_finish():
    adm = Admission(_cfg(1, 5))
    adm.observe(1)
    ticket = await adm.admit(key("a"))
    adm._free(ticket.tenant, ticket.slot, held=False)       # as a preemption leaves it
    ticket.slot = -1
    other = await adm.admit(key("b"))
    resumed = asyncio.create_task(ticket.resume())
    await asyncio.sleep(0)
    assert not resumed.done()
    adm.drain()
    await asyncio.wait_for(resumed, 1)              # admitted, room or not
    assert ticket.slot >= 0
    ticket.release()
    other.release()
    assert adm.in_flight == 0


async def _sse(resp) -> list[dict]:
    """The JSON events of an SSE response, until [DONE] (which must come)."""
    body = (await resp.read()).decode()
    data = [d for _, d in parse_sse(body)]
    assert data[-1] == "[DONE]", body[-200:]
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("decode_calls", ["per-request", "batched"])
async def test_a_tenant_owed_its_share_preempts_and_the_preempted_stream_goes_on(
        model_dir, tmp_path, decode_calls, monkeypatch):
    """Real HTTP streams through the edge to a synthetic engine of 2 slots: heavy holds
    both while light is quiet; light's request takes one back at once, and heavy's
    preempted stream pauses, is admitted again and ends with every token, its new leg
    asking for the rest only."""
    import pdserve.services.edge.shares as shares
    # Use averaged over 0.05 s, not 5: heavy is heavy at once. (The synthetic engine's
    # chunks are 4 token ids each, and a stream past its max_tokens in ids is never
    # preempted, so light must come early.)
    monkeypatch.setattr(shares, "USE_SECONDS", 0.05)
    keys = tmp_path / "keys"
    keys.write_text("sk-heavy-0123456789 heavy normal\nsk-light-0123456789 light normal\n")
    heavy = {"Authorization": "Bearer sk-heavy-0123456789"}
    light = {"Authorization": "Bearer sk-light-0123456789"}
    async with edge_stack(model_dir, rate=50.0, capacity=2, api_keys_file=str(keys),
                          decode_calls=decode_calls, admission_wait_seconds=10.0) as stack:
        await stack.until(lambda: stack.admission.capacity == 2)
        async with aiohttp.ClientSession() as http:
            running = [await http.post(f"{stack.url}/v1/completions", headers=heavy,
                                       json=stack.body(100)) for _ in range(2)]
            assert [r.status for r in running] == [200, 200]
            readers = [asyncio.create_task(_sse(r)) for r in running]
            await asyncio.sleep(0.1)                # heavy has used the pool a while
            started = time.perf_counter()
            async with http.post(f"{stack.url}/v1/completions", headers=light,
                                 json=stack.body(5)) as r:
                assert r.status == 200
                assert float(r.headers["x-pdserve-queue-ms"]) < 50     # no wait for a slot
                events = await _sse(r)
            light_took = time.perf_counter() - started
            heavy_events = await asyncio.gather(*readers)
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events) >= 1
    print(f"\nlight's request took {light_took * 1000:.0f} ms beside heavy's two")
    assert light_took < 1.0                          # not the ~1 s a heavy stream has left
    assert stack.metrics.preemptions._value.get() == 1
    for events, resp in zip(heavy_events, running):
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    # The preempted leg's engine request, and the one that went on: the same prompt
    # plus what had been sent, asking only for the tokens still owed.
    legs = {rid: req for rid, req in stack.engine.requests.items() if "-p" in rid}
    assert len(legs) == 1
    [(rid, (prompt, owed))] = legs.items()
    first_prompt, first_owed = stack.engine.requests[rid.rsplit("-p", 1)[0]]
    sent = prompt[len(first_prompt):]
    assert prompt[:len(first_prompt)] == first_prompt and first_owed == 100
    assert 0 < len(sent) < 100 and owed == 100 - len(sent)
    assert not stack.engine.running


async def test_room_is_the_capacity_less_our_requests_in_flight():
    adm = Admission(_cfg(10, 5))
    adm.observe(4)
    mine = [await adm.admit(key("a")) for _ in range(3)]
    assert adm.room == 1
    adm.observe(2)                      # a worker left: room below zero, nothing admitted
    assert adm.room == -1
    for t in mine:
        t.release()
        t.release()                     # twice is once
    assert adm.in_flight == 0 and adm.room == 2


async def test_full_queue_and_long_wait_answer_503_quickly():
    adm = Admission(_cfg(2, 0.2))
    adm.observe(0)
    waiting = [asyncio.create_task(adm.admit(key("a"))) for _ in range(2)]
    await asyncio.sleep(0)
    started = time.perf_counter()
    with pytest.raises(APIError) as e:
        await adm.admit(key("a"))          # its own tenant fills the queue: nothing to push out
    assert e.value.status == 503 and e.value.code == "queue_full"
    assert time.perf_counter() - started < 0.01
    for t in waiting:
        with pytest.raises(APIError) as e:
            await t
        assert e.value.code == "wait"
    assert adm.queued == 0


async def test_a_newcomer_expected_to_wait_too_long_is_refused_on_arrival():
    adm = Admission(_cfg(10, 0.7))
    adm.observe(2)
    held = [await adm.admit(key("a")) for _ in range(2)]
    await asyncio.sleep(0.2)
    for t in held:
        t.release()                     # each held ~0.2 s (deviation ~0.1 s)
    assert 0.2 <= adm.hold < 0.25 and 0.08 <= adm.hold_dev <= 0.11
    held = [await adm.admit(key("a")) for _ in range(2)]     # the pool is full again
    # Each expected in ~0.2 s (when the running two should end) + 4 deviations: ~0.6 s.
    queued = [asyncio.create_task(adm.admit(key("a"))) for _ in range(2)]
    await asyncio.sleep(0)
    assert adm.queued == 2
    started = time.perf_counter()
    with pytest.raises(APIError) as e:
        await adm.admit(key("a"))       # after a slot's second hold: ~0.8 s, past 0.7 s
    assert e.value.status == 503 and e.value.code == "wait"
    assert float(re.search(r"room expected in ([0-9.]+) s", e.value.message)[1]) > 0.7
    assert time.perf_counter() - started < 0.01
    # Another tenant's request is served after none of a's (it holds fewer): ~0.6 s.
    other = asyncio.create_task(adm.admit(key("b")))
    await asyncio.sleep(0)
    assert adm.queued == 3 and not other.done()
    for t in held:
        t.release()
    admitted = await asyncio.gather(queued[0], other)
    assert [t.tenant for t in admitted] == ["a", "b"]
    for t in admitted:
        t.release()
    (await queued[1]).release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_tenant_past_its_share_expects_to_wait_for_its_own_slots():
    adm = Admission(_cfg(10, 0.5))
    adm.observe(4)
    first = await adm.admit(key("a"))
    await asyncio.sleep(0.2)
    first.release()                     # holds last ~0.2 s (deviation ~0.1 s)
    held = [await adm.admit(key("a")) for _ in range(2)]     # a at its share (2 of 4)...
    b = await adm.admit(key("b"))       # ...b active and owed one more: the free slot is b's
    assert adm.room == 1
    started = time.perf_counter()
    with pytest.raises(APIError) as e:
        # Not 0 s (a slot is free, but owed to b): a waits for one of its own to end,
        # ~0.2 s + 4 deviations, past the 0.5 s allowance.
        await adm.admit(key("a"))
    assert e.value.code == "wait" and time.perf_counter() - started < 0.01
    for t in [*held, b]:
        t.release()
    assert adm.in_flight == 0


async def test_a_request_admitted_as_its_wait_runs_out_keeps_its_slot():
    adm = Admission(_cfg(10, 0.05))
    adm.observe(1)
    held = await adm.admit(key("a"))
    loop = asyncio.get_running_loop()
    queued = asyncio.create_task(adm.admit(key("b")))
    await asyncio.sleep(0)                          # queued; its 50 ms timeout is armed
    loop.call_at(loop.time() + 0.04, held.release)  # b gets the slot just before it...
    time.sleep(0.1)                                 # ...in the loop step its timeout fires
    ticket = await queued                           # admitted, not refused with a slot held
    assert adm.in_flight == 1
    ticket.release()
    assert adm.in_flight == 0 and adm.room == 1


async def test_drain_refuses_the_queued_and_the_new_and_a_gone_caller_leaves_the_queue():
    adm = Admission(_cfg(10, 5))
    adm.observe(0)
    gone = asyncio.create_task(adm.admit(key("a")))
    queued = asyncio.create_task(adm.admit(key("b")))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert adm.queued == 1
    adm.drain()
    with pytest.raises(APIError) as e:
        await queued
    assert e.value.code == "draining"
    with pytest.raises(APIError):
        await adm.admit(key("c"))


def test_pool_capacity_counts_serving_decode_workers_with_kv_room():
    D, P = common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_PREFILL

    def w(role=D, serving=True, capacity=4, kv=0.1):
        return router_pb2.WorkerInfo(role=role, serving=serving, capacity=capacity, kv_usage=kv)
    assert pool_capacity([w(), w(), w(role=P, capacity=100)], D) == 8
    assert pool_capacity([w(), w(serving=False)], D) == 4
    assert pool_capacity([w(kv=0.97), w()], D) == 4              # a full KV cache counts none
    assert pool_capacity([w(kv=0.99)], D) == 0
    assert pool_capacity([w(capacity=0)], D) == float("inf")     # no bound reported
    assert pool_capacity([], D) == float("inf")                  # no worker: the router says so


async def test_the_edge_queues_past_the_engines_capacity_and_sheds_past_the_queue(model_dir):
    async with edge_stack(model_dir, rate=100.0, capacity=2, admission_queue=2,
                          admission_wait_seconds=10.0) as stack:
        await stack.until(lambda: stack.admission.capacity == 2)   # read from the router
        async with aiohttp.ClientSession() as http:
            running = [await http.post(f"{stack.url}/v1/completions", json=stack.body(2000))
                       for _ in range(2)]
            await asyncio.sleep(0.6)
            queued = [asyncio.create_task(http.post(f"{stack.url}/v1/completions",
                                                    json=stack.body(5))) for _ in range(2)]
            await stack.until(lambda: stack.metrics.queue_length._value.get() == 2)
            started = time.perf_counter()
            async with http.post(f"{stack.url}/v1/completions", json=stack.body(5)) as r:
                took = time.perf_counter() - started
                assert r.status == 503 and r.headers["Retry-After"]
                assert (await r.json())["error"]["code"] == "queue_full"
            print(f"\nrejection answered in {took * 1000:.1f} ms")
            assert took < 0.1
            assert all(not t.done() for t in queued)
            # Room opens when a running stream ends: the queued ones go through.
            for r in running:
                await http.delete(f"{stack.url}/v1/streams/{r.headers['x-pdserve-stream-id']}")
                r.close()
            for t in queued:
                resp = await asyncio.wait_for(t, 5)
                assert resp.status == 200
                # the response says how long admission held it back (the running ones: ~0)
                assert float(resp.headers["x-pdserve-queue-ms"]) >= 1.0
                await resp.read()
            assert all(float(r.headers["x-pdserve-queue-ms"]) < 50 for r in running)
        assert stack.metrics.rejections.labels("queue_full")._value.get() == 1


async def test_inference_grpc_gets_resource_exhausted_when_shed(model_dir):
    import grpc
    from pdserve.v1 import inference_pb2, inference_pb2_grpc
    async with edge_stack(model_dir, rate=100.0, capacity=1, admission_queue=1,
                          admission_wait_seconds=10.0) as stack:
        await stack.until(lambda: stack.admission.capacity == 1)
        async with grpc.aio.insecure_channel(stack.inference) as ch:
            api = inference_pb2_grpc.InferenceStub(ch)
            req = inference_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(
                max_tokens=1000))
            running = api.Generate(req)
            await running.read()
            await asyncio.sleep(0.6)
            queued = api.Generate(req)
            waiting = asyncio.ensure_future(queued.read())
            await asyncio.sleep(0.2)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.Generate(req).read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            running.cancel()
            queued.cancel()
            waiting.cancel()


async def test_a_full_queue_makes_room_for_other_tenants_and_higher_classes():
    adm = Admission(_cfg(4, 5))
    adm.observe(0)
    burst = [asyncio.create_task(adm.admit(key("burst"))) for _ in range(4)]
    await asyncio.sleep(0)
    steady = asyncio.create_task(adm.admit(key("steady")))      # pushes out burst's newest
    await asyncio.sleep(0)
    with pytest.raises(APIError) as e:
        await burst[-1]
    assert e.value.code == "queue_full" and not steady.done()
    vip = asyncio.create_task(adm.admit(key("vip", "high")))    # a higher class: in too
    await asyncio.sleep(0)
    with pytest.raises(APIError):
        await burst[-2]
    low = asyncio.create_task(adm.admit(key("late", "low")))    # a lower class: refused
    await asyncio.sleep(0)
    with pytest.raises(APIError):
        await low
    adm.observe(5)                      # 4 waiting; the last slot stays for a 5th tenant
    await asyncio.gather(burst[0], burst[1], steady, vip)
    assert adm.queued == 0


async def test_a_tenant_filling_the_pool_leaves_the_last_slot_to_another():
    adm = Admission(_cfg(10, 5))
    adm.observe(4)
    await adm.admit(key("steady"))              # steady has been seen: two tenants share
    burst = [await adm.admit(key("burst")) for _ in range(2)]
    queued = asyncio.create_task(adm.admit(key("burst")))   # its 3rd: the last slot
    await asyncio.sleep(0)
    assert not queued.done() and adm.room == 1
    steady = await asyncio.wait_for(adm.admit(key("steady")), 1)   # at once, no wait
    assert steady.waited < 0.01 and not queued.done()
    burst[0].release()                          # a slot ends: burst's turn again
    await asyncio.wait_for(queued, 1)


def test_shares_summed_once_equal_each_tenants_own_sum():
    """`_share` (from one sum over the active tenants) equals its definition: the share
    of the pool, and what every other active tenant is still owed of it."""
    import random
    rng = random.Random(7)
    for _ in range(300):
        adm = Admission(_cfg(10, 1))
        adm.observe(rng.choice([1, 2, 4, 7, 16]))
        tenants = [f"t{i}" for i in range(rng.randint(1, 6))]
        now = time.monotonic()
        for t in tenants:
            adm.shares.seen[t] = now
            adm.shares.holding[t] = rng.randint(0, 8)
        for t in tenants + ["stranger"]:
            share = adm.capacity / len(tenants) if len(tenants) > 1 else adm.capacity
            owed = sum(max(0.0, share - adm.shares.holding[o]) for o in tenants if o != t)
            got_share, got_owed = adm._share(t)
            assert got_share == pytest.approx(share)
            assert got_owed == pytest.approx(owed if len(tenants) > 1 else 0.0)


async def test_other_edges_admitted_requests_take_room_here():
    adm = Admission(_cfg(10, 5))
    adm.observe(4, elsewhere=3)                  # another replica holds 3 of 4
    mine = await adm.admit(key("a"))
    waiting = asyncio.create_task(adm.admit(key("a")))
    await asyncio.sleep(0)
    assert adm.room == 0 and adm.queued == 1 and not waiting.done()
    adm.observe(4, elsewhere=2)                  # one of theirs ended
    ticket = await asyncio.wait_for(waiting, 1)
    mine.release(), ticket.release()


def test_the_router_sums_the_other_edges_reports_and_forgets_a_silent_one(monkeypatch):
    from pdserve.services.router import edges
    now = [100.0]
    monkeypatch.setattr(edges.time, "monotonic", lambda: now[0])
    reports = edges.EdgeReports()
    assert reports.report("a", 3) == edges.Elsewhere(0, 1)
    assert reports.report("b", 2) == edges.Elsewhere(3, 2)
    assert reports.report("a", 4) == edges.Elsewhere(2, 2)      # a's own count replaced
    assert reports.report("", 0) == edges.Elsewhere(6, 2)       # a plain read counts all
    now[0] += edges.REPORT_SECONDS - 0.5
    assert reports.report("b", 1) == edges.Elsewhere(4, 2)
    now[0] += 1.0                                               # a silent past the bound
    assert reports.report("b", 1) == edges.Elsewhere(0, 1)


async def test_two_edge_replicas_share_the_pool_instead_of_each_filling_it(model_dir):
    """Capacity 2, two edges on one router: what one edge runs is no room at the
    other, which queues until one ends, and hears of it within a few readings
    (without the reports, each admitted 2)."""
    async with edge_stack(model_dir, rate=100.0, capacity=2, replicas=2,
                          admission_wait_seconds=10.0) as stack:
        (url_a, _), (url_b, app_b) = stack.replicas
        b_queue = app_b[METRICS].queue_length
        await asyncio.sleep(1.2)                      # the router read the capacity; edges reported
        async with aiohttp.ClientSession() as http:
            running = [await http.post(f"{url_a}/v1/completions", json=stack.body(2000))
                       for _ in range(2)]
            await asyncio.sleep(1.2)                  # edge A's count reached the router and B
            queued = asyncio.create_task(http.post(f"{url_b}/v1/completions",
                                                   json=stack.body(5)))
            await asyncio.sleep(0.5)
            assert b_queue._value.get() == 1 and not queued.done()
            assert app_b[METRICS].admitted_elsewhere._value.get() == 2
            assert len(stack.engine.running) == 2
            await http.delete(f"{url_a}/v1/streams/{running[0].headers['x-pdserve-stream-id']}")
            started = time.perf_counter()
            resp = await asyncio.wait_for(queued, 5)
            took = time.perf_counter() - started
            print(f"\nroom freed at edge A seen by edge B in {took * 1000:.0f} ms")
            assert resp.status == 200 and "[DONE]" in await resp.text()
            assert took < 0.6                # edges sharing a pool read it 10 times a second
            for r in running:
                await http.delete(f"{url_a}/v1/streams/{r.headers['x-pdserve-stream-id']}")
                r.close()


async def test_two_edges_under_staggered_load_keep_the_pool_within_its_capacity(model_dir):
    """Requests every 0.15 s, alternating edges, each held ~1 s on a pool of 2: the
    engine runs at most capacity + 1 at once (two edges may take one free slot within
    a reading); each edge alone would admit 2, 4 in all."""
    async with edge_stack(model_dir, rate=100.0, capacity=2, replicas=2,
                          admission_wait_seconds=20.0) as stack:
        urls = [url for url, _ in stack.replicas]
        await asyncio.sleep(1.2)                  # both edges read 10 times a second now
        peak, done = 0, asyncio.Event()

        async def sample():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, len(stack.engine.running))
                await asyncio.sleep(0.01)

        async with aiohttp.ClientSession() as http:
            async def one(i: int) -> str:
                await asyncio.sleep(0.15 * i)
                async with http.post(f"{urls[i % 2]}/v1/completions",
                                     json=stack.body(100)) as r:
                    assert r.status == 200
                    return await r.text()

            sampler = asyncio.create_task(sample())
            texts = await asyncio.gather(*(one(i) for i in range(8)))
            done.set()
            await sampler
        assert all("[DONE]" in t for t in texts)         # every request served, in turn
        print(f"\npeak running on a pool of 2 behind two edges: {peak}")
        assert 2 <= peak <= 3

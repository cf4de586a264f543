"""A cache salt per tenant: derived from the tenant under the deployment's secret, on
every worker call (HTTP and Inference gRPC, moved legs too), combined with a client's
own `cache_salt`, and an edge with keys and no secret does not start."""
from __future__ import annotations

import json
from dataclasses import replace

import aiohttp
import grpc
import pytest

from pdserve.cache_salt import plan
from pdserve.config import EdgeConfig
from pdserve.services.edge.prompts import PromptEncoder
from pdserve.services.edge.tenant_salt import (SaltConfigError, TenantSalts, load_secret,
                                               load_shared)
from pdserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from synthetic_stack import edge_stack

ALICE, ALICE2, BOB = "sk-alice-" + "a" * 40, "sk-alice2-" + "d" * 40, "sk-bob-" + "b" * 40
SECRET = b"s" * 32


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{ALICE} alice normal\n{ALICE2} alice normal\n{BOB} bob normal\n")
    return path


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def _complete(http, stack, key: str, **extra) -> tuple[int, dict]:
    body = {"model": stack.model, "prompt": "the same prompt", "max_tokens": 2, **extra}
    async with http.post(f"{stack.url}/v1/completions", json=body, headers=auth(key)) as r:
        return r.status, await r.json()


def _last_salt(stack) -> str:
    return list(stack.engine.salts.values())[-1]


async def test_each_tenant_reaches_the_engines_with_its_own_salt(model_dir, keys_file):
    async with edge_stack(model_dir, api_keys_file=str(keys_file)) as stack:
        async with aiohttp.ClientSession() as http:
            salts = {}
            for name, key, extra in (("alice", ALICE, {}), ("alice2", ALICE2, {}),
                                     ("bob", BOB, {}), ("alice+x", ALICE, {"cache_salt": "x"}),
                                     ("bob+x", BOB, {"cache_salt": "x"})):
                status, body = await _complete(http, stack, key, **extra)
                assert status == 200, body
                salts[name] = _last_salt(stack)
        # Two keys of one tenant share; tenants, and a client's salt, keep apart.
        assert salts["alice"] == salts["alice2"]
        assert len({salts[n] for n in ("alice", "bob", "alice+x", "bob+x")}) == 4
        for salt in salts.values():
            assert salt and not {"alice", "bob", ALICE, BOB, "x"} & set(salt.split(":"))
        async with grpc.aio.insecure_channel(stack.inference) as ch:
            api = inference_pb2_grpc.InferenceStub(ch)
            for key, extra, want in ((ALICE, {}, "alice"), (BOB, {"cache_salt": "x"}, "bob+x")):
                req = inference_pb2.GenerateRequest(
                    prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=2), **extra)
                [c async for c in api.Generate(req, metadata=[("authorization",
                                                               f"Bearer {key}")])]
                assert _last_salt(stack) == salts[want]


@pytest.mark.parametrize("salt", [7, "", "x" * 257, ["a"]])
async def test_a_bad_cache_salt_is_a_400_naming_it(model_dir, keys_file, salt):
    async with edge_stack(model_dir, api_keys_file=str(keys_file)) as stack:
        async with aiohttp.ClientSession() as http:
            status, body = await _complete(http, stack, ALICE, cache_salt=salt)
        assert status == 400 and body["error"]["param"] == "cache_salt", body
        assert not stack.engine.requests


async def test_without_keys_a_client_salt_goes_through_as_it_came(model_dir):
    async with edge_stack(model_dir) as stack:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.url}/v1/completions",
                                 json=stack.body(2, stream=False, cache_salt="mine")) as r:
                assert r.status == 200
            assert _last_salt(stack) == "mine"
            async with http.post(f"{stack.url}/v1/completions", json=stack.body(2)) as r:
                await r.read()
            assert _last_salt(stack) == ""


async def test_a_moved_leg_keeps_its_salt(model_dir, keys_file):
    async with edge_stack(model_dir, api_keys_file=str(keys_file), rate=50.0, engines=2,
                          decode_stall_seconds=0.5) as stack:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.url}/v1/completions", json=stack.body(40),
                                 headers=auth(BOB)) as r:
                text = ""
                async for raw in r.content.iter_any():
                    text += raw.decode()
                    if text.count("data:") == 5:
                        [frozen] = [i for i, (e, _) in enumerate(stack.engines) if e.running]
                        stack.engines[frozen][0].freeze()
        assert text.rstrip().endswith("[DONE]") and '"error"' not in text
        [first] = stack.engines[frozen][0].salts.values()
        [moved] = stack.engines[1 - frozen][0].salts.values()
        assert first == moved != ""


def test_salts_are_keyed_by_the_secret_and_the_same_on_every_edge():
    a, b = TenantSalts(SECRET), TenantSalts(SECRET)
    assert a.salt("alice", "", [1, 2]) == b.salt("alice", "", [3])
    assert a.salt("alice", "", []) != TenantSalts(b"t" * 32).salt("alice", "", [])
    assert TenantSalts(None).salt("alice", "mine", []) == "mine"


def test_an_edge_with_keys_needs_the_secret(tmp_path):
    with pytest.raises(ValueError, match="tenant_salt_file"):
        EdgeConfig(model="m", api_keys_file="/run/keys")
    short = tmp_path / "short"
    short.write_text("too short")
    with pytest.raises(SaltConfigError, match="at least 16 bytes"):
        load_secret(str(short))
    with pytest.raises(SaltConfigError, match="No such file"):
        load_secret(str(tmp_path / "absent"))
    assert replace(EdgeConfig(model="m"), api_keys_file="k", tenant_salt_file="s")


def test_a_shared_prefix_is_shared_by_its_tenants_only(model_dir, tmp_path):
    encoder = PromptEncoder(str(model_dir))
    system = "You are the support assistant of Example Corp. " * 4
    path = tmp_path / "shared.json"
    path.write_text(json.dumps([{"text": system, "tenants": ["alice", "bob"]}]))
    salts = TenantSalts(SECRET, load_shared(str(path), encoder))
    prefix = encoder.encode_text(system)
    prompt = encoder.encode_text(system + "What is my balance?")
    common = next(i for i, (a, b) in enumerate(zip(prefix, prompt)) if a != b) \
        if prompt[:len(prefix)] != prefix else len(prefix)
    alice, bob = (plan(salts.salt(t, "", prompt)) for t in ("alice", "bob"))
    assert alice.at == bob.at == common > 16
    assert alice.first == bob.first and alice.rest != bob.rest
    carol = plan(salts.salt("carol", "", prompt))          # not in the group: all her own
    assert carol.at == 0 and carol.first not in (alice.first, alice.rest)
    other = plan(salts.salt("alice", "", encoder.encode_text("Something else entirely")))
    assert other.rest == "" or other.at < 16


@pytest.mark.parametrize("entries", ['{"text": "x"}', '[{"prompt": "x"}]',
                                     '[{"text": "x", "tenants": []}]', '[{"text": ""}]'])
def test_a_malformed_shared_prefix_file_is_refused(model_dir, tmp_path, entries):
    path = tmp_path / "shared.json"
    path.write_text(entries)
    with pytest.raises(SaltConfigError, match="shared-prefixes-file"):
        load_shared(str(path), PromptEncoder(str(model_dir)))


def test_a_prefix_for_every_tenant_is_still_salted_apart_from_unkeyed_traffic(model_dir,
                                                                               tmp_path):
    encoder = PromptEncoder(str(model_dir))
    system = "House rules: be brief, be kind, cite the manual. " * 6
    path = tmp_path / "shared.json"
    path.write_text(json.dumps([{"text": system}]))
    salts = TenantSalts(SECRET, load_shared(str(path), encoder))
    prompt = encoder.encode_text(system + "Hello?")
    a, z = (plan(salts.salt(t, "", prompt)) for t in ("alice", "zed"))
    assert a.first == z.first != "" and a.at == z.at > 16 and a.rest != z.rest

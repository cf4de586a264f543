"""The `kv_transfer_params` contract: the bytes each leg carries, the round trip, and
which prefill answers are refused, with an error that names the key."""
from __future__ import annotations

import pytest

from pdserve.transfer.params import (CONTINUES_PREFILL, FRESH_LEASE, LEASE_SECONDS, PREFILL_ADDRESS,
                             MalformedParams, check_prefill_answer, computed_tokens, decode,
                             encode, keeps_blocks, lease_id, lease_is_fresh, pulls_blocks,
                             request_params_for_decode, request_params_for_prefill,
                             with_lease_seconds)

# What vLLM 0.32's pull connector answers a prefill with (its request_finished).
ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]],
          "remote_engine_id": "e-1", "remote_request_id": "r-1-0a1b2c3d",
          "remote_host": "::1", "remote_port": 5600, "tp_size": 1, "dcp_size": 1,
          "pp_size": 1, "remote_num_tokens": 21, "remote_blocks_expiry_time": None,
          "transfer_mode": "pull", "remote_prefill_cached_tokens": 16}


def test_the_prefill_request_carries_the_same_bytes_as_before():
    assert encode(request_params_for_prefill()) == (
        '{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, '
        '"remote_block_ids": null, "remote_host": null, "remote_port": null}')
    assert keeps_blocks(request_params_for_prefill())
    assert not pulls_blocks(request_params_for_prefill())


def test_a_prefill_answer_goes_round_trip_into_the_decode_request_keeping_vllms_keys():
    answer = decode(encode(with_lease_seconds(ANSWER, 6.0)))
    assert check_prefill_answer(answer) is answer
    assert list(answer) == [*ANSWER, LEASE_SECONDS] and answer[LEASE_SECONDS] == 6.0
    sent = request_params_for_decode(answer, "[::1]:50061", fresh=True)
    assert decode(encode(sent)) == sent
    expected = {k: v for k, v in answer.items() if k != "remote_prefill_cached_tokens"}
    assert list(sent) == [*expected, PREFILL_ADDRESS, FRESH_LEASE]
    assert sent == {**expected, PREFILL_ADDRESS: "[::1]:50061", FRESH_LEASE: True}
    assert answer["remote_prefill_cached_tokens"] == 16           # the answer is not changed
    assert pulls_blocks(sent) and lease_id(sent) == "r-1-0a1b2c3d"
    assert computed_tokens(sent) == 21
    assert request_params_for_decode(answer) == expected           # no address, no mark


def test_the_decode_request_carries_the_same_bytes_as_before():
    answer = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_request_id": "r",
              "remote_prefill_cached_tokens": 0, LEASE_SECONDS: 6}
    assert encode(request_params_for_decode(answer, "127.0.0.1:1", fresh=True)) == (
        '{"do_remote_prefill": true, "remote_block_ids": [1], "remote_request_id": "r", '
        '"pdserve_lease_seconds": 6, "pdserve_prefill_address": "127.0.0.1:1", '
        '"pdserve_lease_fresh": true}')


def test_the_readers_answer_none_for_what_the_params_do_not_say():
    assert lease_id({}) is None and lease_id({"remote_request_id": ""}) is None
    assert lease_id({"remote_request_id": 7}) is None
    for computed in (None, 0, -1, True, "21", 2.0):
        assert computed_tokens({"remote_num_tokens": computed}) is None
    assert not pulls_blocks({}) and not keeps_blocks({})
    assert not lease_is_fresh({}, 0.0)
    assert CONTINUES_PREFILL == "pdserve.v1.ContinuesPrefill"


@pytest.mark.parametrize("text, says", [
    ("{not json", "not JSON"),
    ('["remote_block_ids"]', "must be a JSON object, got list"),
    ("null", "must be a JSON object, got NoneType"),
])
def test_params_that_are_no_json_object_are_refused(text, says):
    with pytest.raises(MalformedParams, match=says):
        decode(text)


@pytest.mark.parametrize("change, key", [
    ({"remote_block_ids": None}, "remote_block_ids"),
    ({"remote_block_ids": []}, "remote_block_ids"),
    ({"remote_block_ids": "3,4"}, "remote_block_ids"),
    ({"remote_request_id": 5}, "remote_request_id"),
    ({"remote_request_id": ""}, "remote_request_id"),
    ({"remote_num_tokens": "21"}, "remote_num_tokens"),
    ({"remote_num_tokens": True}, "remote_num_tokens"),
    ({"remote_num_tokens": -1}, "remote_num_tokens"),
    ({LEASE_SECONDS: "6"}, LEASE_SECONDS),
    ({LEASE_SECONDS: 0}, LEASE_SECONDS),
])
def test_a_prefill_answer_that_hands_nothing_over_is_refused_naming_the_key(change, key):
    with pytest.raises(MalformedParams, match=key) as refused:
        check_prefill_answer({**ANSWER, **change})
    assert isinstance(refused.value, ValueError)     # the edge's prefill leg catches these


def test_a_prefill_answer_without_pdserves_keys_is_a_stock_engines_and_taken():
    stock = {k: v for k, v in ANSWER.items() if k not in ("remote_num_tokens",)}
    assert check_prefill_answer(stock) is stock
    assert check_prefill_answer({"remote_block_ids": [1]}) == {"remote_block_ids": [1]}
    with pytest.raises(MalformedParams, match="remote_block_ids"):
        check_prefill_answer({})

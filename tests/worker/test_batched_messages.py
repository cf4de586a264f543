"""A worker's batched outputs are cut into messages gRPC accepts (a reader that fell
behind finds many waiting: one message of them all once went over the 4 MiB limit)."""
from __future__ import annotations

from pdserve.v1 import batched_pb2
from pdserve.services.worker.batched import MESSAGE_BYTES, _messages


def test_outputs_are_cut_into_bounded_messages_in_order():
    outputs = [batched_pb2.BatchedOutput(request_id=f"r{i % 7}", response=bytes(300 + i % 50))
               for i in range(12_000)]
    messages = _messages(outputs)
    assert [o for m in messages for o in m] == outputs           # all, in order
    assert len(messages) > 1
    for m in messages:
        assert batched_pb2.BatchedOutputs(outputs=m).ByteSize() <= MESSAGE_BYTES + 4096


def test_an_output_larger_than_a_message_goes_alone_and_nothing_is_empty():
    big = batched_pb2.BatchedOutput(request_id="big", response=bytes(MESSAGE_BYTES + 1))
    small = batched_pb2.BatchedOutput(request_id="s", response=b"x")
    assert _messages([small, big, small]) == [[small], [big], [small]]
    assert _messages([]) == []

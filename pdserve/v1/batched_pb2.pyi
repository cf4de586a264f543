from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BatchedRequest(_message.Message):
    __slots__ = ("request_id", "generate", "abort", "timeout_seconds", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generate: bytes
    abort: bool
    timeout_seconds: float
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., generate: _Optional[bytes] = ..., abort: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class BatchedOutput(_message.Message):
    __slots__ = ("request_id", "response", "ended", "status_code", "status_details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: bytes
    ended: bool
    status_code: int
    status_details: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[bytes] = ..., ended: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ...) -> None: ...

class BatchedOutputs(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[BatchedOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[BatchedOutput, _Mapping]]] = ...) -> None: ...

from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "model", "serving", "last_seen_unix_ms", "load", "capacity", "kv_usage", "continues_prefill")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_PREFILL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    address: str
    model: str
    serving: bool
    last_seen_unix_ms: int
    load: int
    capacity: int
    kv_usage: float
    continues_prefill: bool
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., serving: _Optional[bool] = ..., last_seen_unix_ms: _Optional[int] = ..., load: _Optional[int] = ..., capacity: _Optional[int] = ..., kv_usage: _Optional[float] = ..., continues_prefill: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms",)
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "model", "prompt_tokens", "exclude_workers", "prompt_token_ids", "prompt_token_ids_packed", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    model: str
    prompt_tokens: int
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids_packed: bytes
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., exclude_workers: _Optional[_Iterable[str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids_packed: _Optional[bytes] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class RouteDecision(_message.Message):
    __slots__ = ("decode", "prefill", "local_prefill", "reason", "cached_tokens")
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    decode: WorkerInfo
    prefill: WorkerInfo
    local_prefill: bool
    reason: str
    cached_tokens: int
    def __init__(self, decode: _Optional[_Union[WorkerInfo, _Mapping]] = ..., prefill: _Optional[_Union[WorkerInfo, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class RouteRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RouteRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[RouteRequest, _Mapping]]] = ...) -> None: ...

class RouteAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[RouteAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[RouteAnswer, _Mapping]]] = ...) -> None: ...

class RouteAnswer(_message.Message):
    __slots__ = ("request_id", "decision", "status_code", "status_details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decision: RouteDecision
    status_code: int
    status_details: str
    def __init__(self, request_id: _Optional[str] = ..., decision: _Optional[_Union[RouteDecision, _Mapping]] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("edge_id", "admitted")
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    admitted: int
    def __init__(self, edge_id: _Optional[str] = ..., admitted: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "admitted_elsewhere", "edges")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_ELSEWHERE_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    admitted_elsewhere: int
    edges: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., admitted_elsewhere: _Optional[int] = ..., edges: _Optional[int] = ...) -> None: ...

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("engine_id", "agent_metadata")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    agent_metadata: bytes
    def __init__(self, engine_id: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("engine_id", "agent_metadata", "block_size", "num_blocks")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    agent_metadata: bytes
    block_size: int
    num_blocks: int
    def __init__(self, engine_id: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

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

class LeaseStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaseStats(_message.Message):
    __slots__ = ("open", "opened", "released", "aborted", "expired")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    open: int
    opened: int
    released: int
    aborted: int
    expired: int
    def __init__(self, open: _Optional[int] = ..., opened: _Optional[int] = ..., released: _Optional[int] = ..., aborted: _Optional[int] = ..., expired: _Optional[int] = ...) -> None: ...

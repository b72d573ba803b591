from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftMessage(_message.Message):
    __slots__ = ("open", "draft", "close", "batch")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    open: OpenRequest
    draft: DraftTokens
    close: CloseRequest
    batch: DraftBatch
    def __init__(self, open: _Optional[_Union[OpenRequest, _Mapping]] = ..., draft: _Optional[_Union[DraftTokens, _Mapping]] = ..., close: _Optional[_Union[CloseRequest, _Mapping]] = ..., batch: _Optional[_Union[DraftBatch, _Mapping]] = ...) -> None: ...

class DraftBatch(_message.Message):
    __slots__ = ("request_ids", "positions", "counts", "token_ids", "branch_of", "fork_positions", "branch_counts", "branch_token_ids", "done")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_OF_FIELD_NUMBER: _ClassVar[int]
    FORK_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    positions: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    branch_of: _containers.RepeatedScalarFieldContainer[int]
    fork_positions: _containers.RepeatedScalarFieldContainer[int]
    branch_counts: _containers.RepeatedScalarFieldContainer[int]
    branch_token_ids: _containers.RepeatedScalarFieldContainer[int]
    done: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., positions: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., branch_of: _Optional[_Iterable[int]] = ..., fork_positions: _Optional[_Iterable[int]] = ..., branch_counts: _Optional[_Iterable[int]] = ..., branch_token_ids: _Optional[_Iterable[int]] = ..., done: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("request_id", "ticket", "verified_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ticket: str
    verified_position: int
    def __init__(self, request_id: _Optional[str] = ..., ticket: _Optional[str] = ..., verified_position: _Optional[int] = ...) -> None: ...

class DraftTokens(_message.Message):
    __slots__ = ("request_id", "position", "token_ids", "branches")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    def __init__(self, request_id: _Optional[str] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("fork_position", "token_ids")
    FORK_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    fork_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, fork_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SinkMessage(_message.Message):
    __slots__ = ("verified", "error", "release")
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    verified: VerifiedBatch
    error: RequestError
    release: Release
    def __init__(self, verified: _Optional[_Union[VerifiedBatch, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("request_id", "uncovered_steps")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    UNCOVERED_STEPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    uncovered_steps: int
    def __init__(self, request_id: _Optional[str] = ..., uncovered_steps: _Optional[int] = ...) -> None: ...

class VerifiedBatch(_message.Message):
    __slots__ = ("request_ids", "positions", "counts", "token_ids", "held")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    positions: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    held: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., positions: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., held: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SinkStats(_message.Message):
    __slots__ = ("drafts", "step_cost")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftFigures]
    step_cost: StepCostFit
    def __init__(self, drafts: _Optional[_Iterable[_Union[DraftFigures, _Mapping]]] = ..., step_cost: _Optional[_Union[StepCostFit, _Mapping]] = ...) -> None: ...

class StepCostFit(_message.Message):
    __slots__ = ("fixed_s", "per_token_s", "steps")
    FIXED_S_FIELD_NUMBER: _ClassVar[int]
    PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    fixed_s: float
    per_token_s: float
    steps: int
    def __init__(self, fixed_s: _Optional[float] = ..., per_token_s: _Optional[float] = ..., steps: _Optional[int] = ...) -> None: ...

class DraftFigures(_message.Message):
    __slots__ = ("draft", "counters", "waits", "wait_seconds", "steps")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    draft: str
    counters: _containers.ScalarMap[str, int]
    waits: int
    wait_seconds: float
    steps: int
    def __init__(self, draft: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ..., waits: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., steps: _Optional[int] = ...) -> None: ...

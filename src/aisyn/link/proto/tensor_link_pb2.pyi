# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Frame(_message.Message):
    __slots__ = ("hello", "tensor", "scalar", "error", "bye")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    tensor: TensorChunk
    scalar: Scalar
    error: Error
    bye: Bye
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., tensor: _Optional[_Union[TensorChunk, _Mapping]] = ..., scalar: _Optional[_Union[Scalar, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., bye: _Optional[_Union[Bye, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("role", "protocol_version", "session", "data_port", "data_secret")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_SECRET_FIELD_NUMBER: _ClassVar[int]
    role: str
    protocol_version: int
    session: str
    data_port: int
    data_secret: bytes
    def __init__(self, role: _Optional[str] = ..., protocol_version: _Optional[int] = ..., session: _Optional[str] = ..., data_port: _Optional[int] = ..., data_secret: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("tag", "step", "micro", "dtype", "shape", "codec", "chunk_index", "num_chunks", "total_bytes", "side_bytes", "data")
    TAG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tag: str
    step: int
    micro: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    chunk_index: int
    num_chunks: int
    total_bytes: int
    side_bytes: int
    data: bytes
    def __init__(self, tag: _Optional[str] = ..., step: _Optional[int] = ..., micro: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., side_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Scalar(_message.Message):
    __slots__ = ("tag", "step", "value")
    TAG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    tag: str
    step: int
    value: float
    def __init__(self, tag: _Optional[str] = ..., step: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class Bye(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

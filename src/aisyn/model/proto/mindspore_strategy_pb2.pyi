# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DevMatrix(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorMap(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[_Iterable[int]] = ...) -> None: ...

class ParallelLayouts(_message.Message):
    __slots__ = ("dev_matrix", "tensor_map", "field", "opt_weight_shard_step", "opt_weight_shard_size")
    DEV_MATRIX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_MAP_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    OPT_WEIGHT_SHARD_STEP_FIELD_NUMBER: _ClassVar[int]
    OPT_WEIGHT_SHARD_SIZE_FIELD_NUMBER: _ClassVar[int]
    dev_matrix: _containers.RepeatedCompositeFieldContainer[DevMatrix]
    tensor_map: _containers.RepeatedCompositeFieldContainer[TensorMap]
    field: int
    opt_weight_shard_step: int
    opt_weight_shard_size: int
    def __init__(self, dev_matrix: _Optional[_Iterable[_Union[DevMatrix, _Mapping]]] = ..., tensor_map: _Optional[_Iterable[_Union[TensorMap, _Mapping]]] = ..., field: _Optional[int] = ..., opt_weight_shard_step: _Optional[int] = ..., opt_weight_shard_size: _Optional[int] = ...) -> None: ...

class ParallelLayoutItem(_message.Message):
    __slots__ = ("param_name", "parallel_layouts")
    PARAM_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    param_name: str
    parallel_layouts: ParallelLayouts
    def __init__(self, param_name: _Optional[str] = ..., parallel_layouts: _Optional[_Union[ParallelLayouts, _Mapping]] = ...) -> None: ...

class ParallelStrategyMap(_message.Message):
    __slots__ = ("current_stage", "parallel_layout_item")
    CURRENT_STAGE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_LAYOUT_ITEM_FIELD_NUMBER: _ClassVar[int]
    current_stage: int
    parallel_layout_item: _containers.RepeatedCompositeFieldContainer[ParallelLayoutItem]
    def __init__(self, current_stage: _Optional[int] = ..., parallel_layout_item: _Optional[_Iterable[_Union[ParallelLayoutItem, _Mapping]]] = ...) -> None: ...

"""MindSpore checkpoints (``.ckpt``) read and written without MindSpore.

Every detail below is MindSpore's own, checked against the source of MindSpore
2.10.0 (``mindspore/train/serialization.py``: ``_exec_save``,
``_write_parameter_data``, ``_write_parameter_bytes_data``,
``_parse_ckpt_proto``, ``_load_ckpt_into_param_dict``; the messages of
``checkpoint.proto``, mirrored in ``mindspore_checkpoint.proto`` here; the
cipher framing of ``mindspore/core/utils/crypto.{h,cc}``):

* A file is a protobuf ``Checkpoint``: a sequence of ``Value {tag, tensor}``.
  MindSpore writes each value as its own serialized one-value ``Checkpoint``,
  one after another, which on the wire is the same thing as one message.
* A tensor larger than ``SLICE_SIZE`` (512 * 1024 KiB = 512 MiB) is cut along
  its first axis (``np.array_split`` into ``ceil(bytes / 512 MiB)`` pieces, or
  into 512 MiB byte runs for device tensors); the pieces are consecutive values
  with the same tag and the whole tensor's ``dims``, and the loader joins the
  contents of consecutive values with equal tags.
* ``save_checkpoint(..., crc_check=True)`` appends ``b"crc_num"`` and the CRC-32
  of every byte before it as a 10-byte big-endian integer. MindSpore strips a
  trailer whenever it sees one and checks it only when asked; here it is
  always checked: a mismatch is a damaged file.
* ``save_checkpoint(..., enc_key=...)`` writes blocks that each start with a
  4-byte little-endian magic (0x7F3A5ED8 AES-GCM, 0x7F3A5ED9 AES-CBC,
  0x7F3A5EDA SM4-CBC). Such files are refused: decrypting needs the key and
  MindSpore; a plain checkpoint starts with byte 0x0A instead.
* Scalars are stored with ``dims`` ``[]`` or ``[0]`` (MindSpore reads ``[0]`` as
  a scalar); strings (``append_info`` entries) have type ``"str"`` and hold
  NumPy UTF-32 text.

The file is walked value by value over a memory map rather than parsed as one
message: protobuf refuses messages over 2 GiB, and a PanGu-α 2.6B checkpoint
with its optimizer state is about 30 GiB. Nothing here unpickles anything.
"""

from __future__ import annotations

import math
import mmap
import os
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from aisyn.model.proto.mindspore_checkpoint_pb2 import Checkpoint

#: MindSpore's SLICE_SIZE (512 * 1024 KiB): tensors above it are written in pieces
SLICE_BYTES = 512 * 1024 * 1024
#: ``b"crc_num"`` + a 10-byte big-endian CRC-32 end a file saved with crc_check
CRC_MARK = b"crc_num"
CRC_TRAILER = len(CRC_MARK) + 10
#: first 4 bytes (little-endian) of a file saved with enc_key, by cipher
CIPHER_MAGICS = {0x7F3A5ED8: "AES-GCM", 0x7F3A5ED9: "AES-CBC", 0x7F3A5EDA: "SM4-CBC"}
#: the key of field 1 (``value``), length-delimited: what every value starts with
_VALUE_KEY = (1 << 3) | 2

#: MindSpore's tensor_type names (serialization.tensor_to_ms_type) -> torch
TORCH_DTYPES: dict[str, torch.dtype] = {
    "Float16": torch.float16,
    "Float32": torch.float32,
    "Float64": torch.float64,
    "BFloat16": torch.bfloat16,
    "Int8": torch.int8,
    "UInt8": torch.uint8,
    "Int16": torch.int16,
    "UInt16": torch.uint16,
    "Int32": torch.int32,
    "UInt32": torch.uint32,
    "Int64": torch.int64,
    "UInt64": torch.uint64,
    "Bool": torch.bool,
}
MINDSPORE_TYPES = {v: k for k, v in TORCH_DTYPES.items()}


class MindSporeCheckpointError(ValueError):
    """A file that is not a readable MindSpore checkpoint, or a tensor that
    cannot be written as one."""


def read_checkpoint(
    path: str | Path, keep: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor | str]:
    """Every tensor (and ``str`` entry) of a MindSpore ``.ckpt`` file, by tag.

    ``keep(tag)`` False skips decoding that entry (an optimizer's moments need
    not be held in memory to be ignored); it is still parsed and checked.
    Raises ``MindSporeCheckpointError`` with one line naming the problem.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if size == 0:
                raise MindSporeCheckpointError(
                    f"{path}: empty file, not a MindSpore checkpoint"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    return _read(view, str(path), keep)
                finally:
                    view.release()
    except FileNotFoundError:
        raise MindSporeCheckpointError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise MindSporeCheckpointError(f"{path}: a folder, not a .ckpt file") from None


def _read(
    data: memoryview, source: str, keep: Callable[[str], bool] | None
) -> dict[str, torch.Tensor | str]:
    end = _payload_end(data, source)
    out: dict[str, torch.Tensor | str] = {}
    tag: str | None = None  # the tensor being assembled from its slices
    head = None  # its first slice's TensorProto (dims, type)
    parts: list[bytes] = []
    pos = 0
    while pos < end:
        start = pos
        key, pos = _varint(data, pos, end, source)
        if key != _VALUE_KEY:
            what = "not a MindSpore checkpoint" if start == 0 else "damaged"
            raise MindSporeCheckpointError(
                f"{source}: {what} (byte {start}: no checkpoint value starts there)"
            )
        length, pos = _varint(data, pos, end, source)
        if pos + length > end:
            raise MindSporeCheckpointError(
                f"{source}: truncated (the value at byte {start} runs past the end "
                "of the file)"
            )
        value = Checkpoint.Value()
        try:
            value.ParseFromString(data[pos : pos + length])
        except Exception:  # protobuf's DecodeError, or upb's RuntimeError
            value.Clear()
        pos += length
        if not value.IsInitialized() or value.WhichOneof("value") is None:
            what = "not a MindSpore checkpoint" if start == 0 else "damaged"
            raise MindSporeCheckpointError(
                f"{source}: {what} (the value at byte {start} does not parse)"
            )
        if value.WhichOneof("value") == "maptensor":
            raise MindSporeCheckpointError(
                f"{source}: {value.tag} is a MapParameter (a hash-map embedding), "
                "which this reader does not support"
            )
        if value.tag != tag:
            if tag is not None:
                _finish(out, tag, head, parts, source, keep)
            if value.tag in out:
                raise MindSporeCheckpointError(
                    f"{source}: {value.tag} appears twice, apart; the file is damaged"
                )
            tag, head, parts = value.tag, value.tensor, []
        elif list(value.tensor.dims) != list(head.dims) or (
            value.tensor.tensor_type != head.tensor_type
        ):
            raise MindSporeCheckpointError(
                f"{source}: the slices of {tag} disagree on its shape or type; the "
                "file is damaged"
            )
        if keep is None or keep(value.tag):
            parts.append(value.tensor.tensor_content)
    if tag is None:
        raise MindSporeCheckpointError(f"{source}: holds no tensors")
    _finish(out, tag, head, parts, source, keep)
    return out


def _payload_end(data: memoryview, source: str) -> int:
    """Where the values end: refuses encrypted files, checks and strips a CRC."""
    end = len(data)
    if end >= 4 and int.from_bytes(data[:4], "little") in CIPHER_MAGICS:
        cipher = CIPHER_MAGICS[int.from_bytes(data[:4], "little")]
        raise MindSporeCheckpointError(
            f"{source}: encrypted ({cipher}); decrypt it with MindSpore first "
            "(load_checkpoint with dec_key, then save_checkpoint without enc_key)"
        )
    if end >= CRC_TRAILER and bytes(data[end - CRC_TRAILER : end - 10]) == CRC_MARK:
        stored = int.from_bytes(data[end - 10 : end], "big")
        end -= CRC_TRAILER
        crc = 0
        step = 64 << 20  # in pieces: a 30 GiB file never needs a second copy
        for i in range(0, end, step):
            crc = zlib.crc32(data[i : min(i + step, end)], crc)
        if crc != stored:
            raise MindSporeCheckpointError(
                f"{source}: CRC mismatch (the file says {stored:#010x}, its bytes "
                f"give {crc:#010x}); the file is damaged"
            )
    return end


def _varint(data: memoryview, pos: int, end: int, source: str) -> tuple[int, int]:
    """A protobuf varint at ``pos`` (at most 10 bytes) and the position after it."""
    result = shift = 0
    for i in range(pos, min(pos + 10, end)):
        byte = data[i]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i + 1
        shift += 7
    raise MindSporeCheckpointError(
        f"{source}: truncated or damaged (no complete length at byte {pos})"
    )


def _finish(
    out: dict,
    tag: str,
    head,
    parts: list[bytes],
    source: str,
    keep: Callable[[str], bool] | None,
) -> None:
    """Decode one tensor from its slices' contents into ``out[tag]``."""
    if keep is not None and not keep(tag):
        return
    kind = head.tensor_type
    content = b"".join(parts)
    if kind == "str":
        # np.array(str).tobytes(): UTF-32 code units, native (little-endian)
        # NumPy's str(np.array(text)) drops trailing NULs; so does this
        out[tag] = content.decode("utf-32-le", errors="replace").rstrip("\0")
        return
    dtype = TORCH_DTYPES.get(kind)
    if dtype is None:
        raise MindSporeCheckpointError(
            f"{source}: {tag} has tensor type {kind!r}, which this reader does not "
            f"support ({', '.join(TORCH_DTYPES)})"
        )
    dims = list(head.dims)
    shape = [] if dims == [0] else dims  # MindSpore's scalar convention
    if any(d < 0 for d in shape):
        raise MindSporeCheckpointError(
            f"{source}: {tag} declares the negative shape {tuple(shape)}; the file "
            "is damaged"
        )
    # Python's integers: NumPy's int64 product wraps around, and a wrapped
    # product that matched the content would let a huge shape through
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(d for d in shape if d) * itemsize >= 2**63:
        # even an empty tensor of such a shape overflows torch's size arithmetic
        raise MindSporeCheckpointError(
            f"{source}: {tag} declares the shape {tuple(shape)}, whose size "
            "overflows 64 bits; the file is damaged"
        )
    if numel * itemsize != len(content):
        raise MindSporeCheckpointError(
            f"{source}: {tag} holds {len(content)} bytes, but its shape "
            f"{tuple(shape)} of {kind} needs {numel * itemsize}; the file is damaged "
            "or truncated"
        )
    flat = torch.frombuffer(bytearray(content), dtype=dtype) if numel else None
    out[tag] = (
        flat.reshape(shape) if flat is not None else torch.empty(shape, dtype=dtype)
    )


def write_checkpoint(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    crc: bool = False,
    slice_bytes: int = SLICE_BYTES,
) -> None:
    """Write ``tensors`` as a MindSpore ``.ckpt`` file, as ``save_checkpoint`` does.

    Tensors over ``slice_bytes`` are cut along their first axis into
    consecutive values (MindSpore's own split, ``np.array_split``); ``crc``
    appends the trailer of ``save_checkpoint(..., crc_check=True)``. Written
    beside ``path`` and renamed, so a failure leaves no partial file.
    """
    path = Path(path)
    for name, t in tensors.items():
        if t.dtype not in MINDSPORE_TYPES:
            raise MindSporeCheckpointError(
                f"{name}: dtype {t.dtype} has no MindSpore tensor type"
            )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            running = 0
            for name, t in tensors.items():
                t = t.detach().cpu().contiguous()
                pieces = max(1, -(-t.numel() * t.element_size() // slice_bytes))
                slices = torch.tensor_split(t, pieces) if t.dim() else (t,)
                for piece in slices:
                    msg = Checkpoint()
                    value = msg.value.add()
                    value.tag = name
                    value.tensor.dims.extend(t.shape)
                    value.tensor.tensor_type = MINDSPORE_TYPES[t.dtype]
                    value.tensor.tensor_content = _raw_bytes(piece)
                    blob = msg.SerializeToString()
                    running = zlib.crc32(blob, running)
                    f.write(blob)
            if crc:
                f.write(CRC_MARK + running.to_bytes(10, "big"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, row-major; through uint8 so bfloat16 needs no NumPy type."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

"""How one queued tensor becomes the frames a transport writes.

The tensor is encoded on its own device and staged to the host a chunk at a
time (a GPU tensor: :mod:`.staging`), or encoded on the host. The last frame
is held back until every read of the tensor's memory is done, and the
tensor's version counter is checked before it is written: a caller that
modified the tensor in place after ``send()`` ends the session instead of
handing the peer a torn tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import torch

from .codec import CodecOverflowError, Encoded, encode
from .errors import SessionAbortedError
from .frames import ChunkData, FrameKey, Wire
from .staging import CudaCopier, HostStaging, device_parts

#: a transport's frames for one tensor (``LinkCore._tensor_wire``)
TensorWire = Callable[[FrameKey, Encoded, ChunkData | None], Iterator[bytes | Wire]]


class TensorWriter:
    """One link's sender side of tensors: its per-GPU staging and the reused
    buffer its held-back last chunks are copied into (one sender thread)."""

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk_bytes = chunk_bytes
        self._tail = bytearray()  # the sender's copy of a tensor's last chunk
        self._staging: dict[torch.device, HostStaging] = {}  # per GPU, on first use

    def write(
        self,
        key: FrameKey,
        tensor: torch.Tensor,
        *,
        codec: str,
        version: int | None,
        ready: torch.cuda.Event | None,
        tensor_wire: TensorWire,
        write_frame: Callable[[bytes | Wire], None],
    ) -> None:
        """Encode ``tensor`` and write its frames; ``version``: its
        ``_version`` at ``send()`` (None: it has none), ``ready``: a GPU
        tensor's event recorded on the caller's stream at ``send()``."""
        data: ChunkData | None = None
        try:
            staging = self._host_staging(tensor)
            if staging is not None:
                # Encoded on the device; its wire bytes staged to the host a
                # chunk at a time, each copy overlapping the previous write.
                with staging.copier.ordered_after(ready):
                    enc = encode(tensor, codec, to_host=False)
                parts = device_parts(enc.side, enc.payload)
                data = functools.partial(staging.chunks, parts)
            else:
                enc = encode(tensor, codec)
        except CodecOverflowError as e:
            # Ends the session, telling the peer why (as abort() does).
            raise SessionAbortedError(f"cannot send {key}: {e}") from None
        frames = tensor_wire(key, enc, data)
        # Write each frame only once the next one is built, so the last frame is
        # still held back when all reads of the tensor's memory are done: if the
        # caller modified it meanwhile, the peer never completes a torn tensor.
        last = next(frames)
        for frame in frames:
            write_frame(last)
            last = frame
        if isinstance(last, Wire) and data is None:
            # Views of the tensor: read them now. Staged data is already the
            # link's own copy, landed before the chunk was handed out.
            last = Wire(last.header, [self._copy_tail(last.data)])
        if version is not None and tensor._version != version:
            # Ends the session telling the peer why, as a codec overflow does.
            raise SessionAbortedError(
                f"{key} was modified in place after send() and before it was "
                "transmitted; clone it before sending or send it later"
            )
        write_frame(last)

    def _host_staging(self, tensor: torch.Tensor) -> HostStaging | None:
        """How a tensor outside host memory reaches it (None: it is there)."""
        if not tensor.is_cuda:
            return None
        if tensor.device not in self._staging:
            copier = CudaCopier(tensor.device)
            self._staging[tensor.device] = HostStaging(self._chunk_bytes, copier)
        return self._staging[tensor.device]

    def _copy_tail(self, views: Sequence[memoryview | bytes]) -> memoryview:
        """The views' bytes in the sender's reused buffer (written before the
        next tensor is encoded, so one buffer does)."""
        size = sum(len(v) for v in views)
        if len(self._tail) < size:
            self._tail = bytearray(size)
        out = memoryview(self._tail)
        offset = 0
        for view in views:
            out[offset : offset + len(view)] = view
            offset += len(view)
        return out[:size]

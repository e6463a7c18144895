"""Transport-independent half of a link endpoint.

:class:`LinkCore` owns the send queue and its thread, the receive mailbox,
the ordering rules and the failure state. A transport subclass supplies the
hooks below and feeds every inbound frame to :meth:`LinkCore._on_frame` from
a single receiving thread.

Protocol rules enforced here (the frame layer checks each frame in isolation):

* steps never decrease on a direction of the link, and a (kind, tag, step,
  micro) key is used once -- this is what lets ``recv`` match by key while
  still catching a desynchronised or replaying peer;
* frames of a step the receiver has already left can never be received; they
  are dropped with a warning whether they arrived before or after the
  receiver moved on (an error only in one case would depend on thread
  timing), or, with ``LinkOptions.drop_unread=False``, end the session in both;
* a receiver waiting for a key of a step the peer has already left behind
  fails at once: since steps never decrease, that key can no longer arrive;
* unconsumed data is bounded by ``max_pending_bytes`` so a runaway peer
  cannot exhaust memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from .assembly import ReceivePool, TensorAssembler
from .base import Link, LinkOptions, PeerHello
from .codec import Encoded, dtype_name, effective_codec
from .errors import (
    FrameError,
    FrameMismatchError,
    FrameOrderError,
    FrameTooLargeError,
    LinkClosedError,
    LinkError,
    LinkTimeoutError,
    MalformedFrameError,
    PeerClosedError,
    PeerLostError,
    SessionAbortedError,
)
from .frames import (
    BYE_FRAME,
    MAX_DIMS,
    SCALAR,
    TENSOR,
    ChunkData,
    FrameKey,
    Inbound,
    Wire,
    check_scalar,
    frame_kind,
    key_problem,
    scalar_frame,
    tensor_frames,
)
from .tensor_writer import TensorWriter

log = logging.getLogger(__name__)

#: Bookkeeping cost charged per buffered entry on top of its bytes, so a
#: flood of empty tensors or scalars is bounded by max_pending_bytes too.
_ENTRY_COST = 256


class _Job(NamedTuple):
    key: FrameKey | None  # None: say goodbye
    tensor: torch.Tensor | None = None
    value: float = 0.0
    codec: str = "none"
    version: int | None = None
    #: a GPU tensor's: recorded on the caller's stream at send(), so the
    #: sender reads the tensor as the caller's queued work leaves it
    ready: torch.cuda.Event | None = None


#: tensors up to this size may be written from the caller's thread
_INLINE_BYTES = 64 * 1024


def _small(job: _Job) -> bool:
    if job.key is None or job.key.kind == SCALAR:
        return job.key is not None
    assert job.tensor is not None
    return job.tensor.numel() * job.tensor.element_size() <= _INLINE_BYTES


class LinkCore(Link):
    """Common machinery of all link endpoints; see the module docstring."""

    #: write scalars and small tensors from the caller's thread when nothing
    #: else is queued (a transport whose writes do not block for long)
    _inline_small = False

    def __init__(self, options: LinkOptions, name: str, peer: PeerHello) -> None:
        self.peer = peer
        self._opts = options
        self._name = name
        #: how loudly a failure is logged (a connect attempt's: quietly, the
        #: caller reports each kind of failure once)
        self._fail_level = logging.WARNING
        self._lock = threading.RLock()  # a transport may add conditions on it
        self._cond = threading.Condition(self._lock)
        # Receive side; guarded by _cond.
        self._pending: dict[FrameKey, tuple[torch.Tensor | float, int]] = {}
        self._pending_bytes = 0
        self._in_step = -1
        self._in_keys: set[FrameKey] = set()
        self._recv_step = -1
        self._peer_gone: str | None = None
        self._error: LinkError | None = None
        self._torn_down = threading.Event()  # set once _fail() stopped the transport
        # Send side; guarded by _cond except the counters, which have one writer.
        self._out_step = -1
        self._out_keys: set[FrameKey] = set()
        self._queued = 0
        self._closing = False
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._sent = 0
        self._received = 0
        self._assembler = TensorAssembler(
            options.max_tensor_bytes, self._admit, ReceivePool(options.recv_pool_bytes)
        )
        self._tensors = TensorWriter(options.chunk_bytes)
        self._sender = threading.Thread(
            target=self._send_loop, name=f"{name}-send", daemon=True
        )
        self._write_lock = threading.Lock()  # one writer: the sender or inline

    def _start(self) -> None:
        self._sender.start()

    # ----------------------------------------------------------- transport hooks

    @abstractmethod
    def _write(self, frame: bytes | Wire) -> int:
        """Hand one serialised frame (or one item of ``_tensor_wire``) to the
        wire and return its size on the wire; may block; raises LinkError if
        the transport is gone."""

    def _tensor_wire(
        self, key: FrameKey, enc: Encoded, data: ChunkData | None
    ) -> Iterator[bytes | Wire]:
        """The frames carrying one tensor, in the form ``_write`` takes;
        ``data`` supplies the chunks' bytes of a tensor left on its device."""
        return tensor_frames(key, enc, self._opts.chunk_bytes, data)

    @abstractmethod
    def _end_writes(self) -> None:
        """Called after BYE was written: no more frames follow."""

    @abstractmethod
    def _teardown(self, exc: LinkError, notify_peer: bool) -> None:
        """The link failed: stop the transport, telling the peer why if asked."""

    @abstractmethod
    def _shutdown(self, graceful: bool, timeout: float) -> None:
        """Local close: after a graceful goodbye wait for the peer to finish,
        then release transport resources."""

    def _peer_said_bye(self) -> None:
        """The peer sent BYE; the transport may stop writing."""

    # ------------------------------------------------------------------ sending

    def send(
        self,
        tag: str,
        tensor: torch.Tensor,
        *,
        step: int,
        micro: int = 0,
        codec: str | None = None,
    ) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"send() needs a torch.Tensor, got {type(tensor).__name__}")
        codec = self._opts.codec if codec is None else codec
        effective_codec(codec, tensor.dtype)  # unknown codec -> ValueError
        dtype_name(tensor.dtype)
        if tensor.layout is not torch.strided or tensor.dim() > MAX_DIMS:
            raise ValueError(
                f"only dense tensors of at most {MAX_DIMS} dims can be sent, got "
                f"{tensor.layout} with {tensor.dim()} dims"
            )
        try:
            version = tensor._version  # bumped by every in-place op on the storage
        except RuntimeError:  # inference-mode tensors have no version counter
            version = None
        ready = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        key = FrameKey(TENSOR, tag, step, micro)
        self._enqueue(
            _Job(key, tensor.detach(), codec=codec, version=version, ready=ready)
        )

    def send_scalar(self, tag: str, value: float, *, step: int) -> None:
        self._enqueue(_Job(FrameKey(SCALAR, tag, step, 0), value=float(value)))

    def _enqueue(self, job: _Job) -> None:
        key = job.key
        assert key is not None
        problem = key_problem(key.tag, key.step, key.micro)
        if problem:
            raise ValueError(problem)
        with self._cond:
            self._check_usable()
            if self._peer_gone:
                raise PeerLostError(
                    f"{self._name}: cannot send {key}: {self._peer_gone}"
                )
            if key.step < self._out_step:
                raise ValueError(
                    f"cannot send {key}: step {self._out_step} was already sent "
                    "and steps must not decrease"
                )
            if key.step > self._out_step:
                self._out_step = key.step
                self._out_keys.clear()
            if key in self._out_keys:
                raise ValueError(f"{key} was already sent")
            self._out_keys.add(key)
            inline = self._inline_small and not self._queued and _small(job)
            self._queued += 1
            if inline:
                # Nothing is queued or being written: write it from this
                # thread, which saves a thread hand-off per message (a good
                # part of a round trip). The lock is free (the sender thread
                # releases it before it counts its job done) and taken before
                # _cond is let go, so a job queued after this one waits for it.
                self._write_lock.acquire()
            else:
                # Inside the lock so wire order always matches the step checks above.
                self._jobs.put(job)
        if inline:
            try:
                self._send_one(job)
            finally:
                self._write_lock.release()
                self._job_done()

    def _send_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                with self._write_lock:
                    self._send_one(job)
            finally:
                self._job_done()

    def _send_one(self, job: _Job) -> None:
        try:
            if self._error is None:  # after a failure, queued jobs are dropped
                self._transmit(job)
        except LinkError as exc:  # the transport is gone, or a deliberate abort
            self._fail(exc, notify_peer=isinstance(exc, SessionAbortedError))
        except Exception as exc:  # a bug here must not leave recv() hanging
            log.exception("%s: sender failed", self._name)
            self._fail(LinkError(f"sender failed: {exc!r}"), notify_peer=False)

    def _job_done(self) -> None:
        with self._cond:
            self._queued -= 1
            self._cond.notify_all()

    def _transmit(self, job: _Job) -> None:
        if job.key is None:
            self._write_frame(BYE_FRAME)
            self._end_writes()
        elif job.key.kind == SCALAR:
            self._write_frame(scalar_frame(job.key, job.value))
        else:
            self._transmit_tensor(job)

    def _transmit_tensor(self, job: _Job) -> None:
        assert job.key is not None and job.tensor is not None
        self._tensors.write(
            job.key, job.tensor, codec=job.codec, version=job.version,
            ready=job.ready, tensor_wire=self._tensor_wire,
            write_frame=self._write_frame,
        )  # fmt: skip

    def _write_frame(self, frame: bytes | Wire) -> None:
        self._sent += self._write(frame)

    def flush(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queued and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise LinkTimeoutError(
                        f"{self._name}: {self._queued} send(s) still queued after "
                        f"{timeout:g} s"
                    )
                self._cond.wait(remaining)
            if self._error is not None:
                self._check_usable()

    # ---------------------------------------------------------------- receiving

    def recv(
        self,
        tag: str,
        *,
        step: int,
        micro: int = 0,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        key = FrameKey(TENSOR, tag, step, micro)
        tensor = self._take(key, timeout)
        assert isinstance(tensor, torch.Tensor)
        expected_shape = None if shape is None else tuple(shape)
        if (expected_shape is not None and tuple(tensor.shape) != expected_shape) or (
            dtype is not None and tensor.dtype != dtype
        ):
            exc = FrameMismatchError(
                f"{key}: expected {_describe(expected_shape, dtype)}, got "
                f"{_describe(tuple(tensor.shape), tensor.dtype)}"
            )
            self._fail(exc, notify_peer=True)
            raise exc
        return tensor

    def recv_scalar(
        self, tag: str, *, step: int, timeout: float | None = None
    ) -> float:
        value = self._take(FrameKey(SCALAR, tag, step, 0), timeout)
        assert isinstance(value, float)
        return value

    def _take(self, key: FrameKey, timeout: float | None) -> torch.Tensor | float:
        problem = key_problem(key.tag, key.step, key.micro)
        if problem:
            raise ValueError(problem)
        if timeout is None:
            timeout = self._opts.recv_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if key.step < self._recv_step:
                raise ValueError(
                    f"cannot receive {key}: this side already moved on to step "
                    f"{self._recv_step}"
                )
            violation = None
            if key.step > self._recv_step:
                violation = self._advance(key.step)
            while violation is None:
                self._check_usable()
                entry = self._pending.pop(key, None)
                if entry is not None:
                    self._pending_bytes -= entry[1]
                    return entry[0]
                if self._in_step > key.step:
                    # Steps never decrease on the wire: it can no longer come.
                    violation = FrameOrderError(
                        f"{key} never came: the peer went on to step "
                        f"{self._in_step} without sending it"
                    )
                    break
                if self._peer_gone:
                    # The peer said BYE: a normal end if nothing more was due.
                    raise PeerClosedError(
                        f"{self._name}: {self._peer_gone}; {key} never arrived"
                    )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise LinkTimeoutError(
                        f"{self._name}: timed out after {timeout:g} s waiting for {key}"
                    )
                self._wait_for_frames(remaining)
        self._fail(violation, notify_peer=True)
        raise violation

    def _wait_for_frames(self, timeout: float | None) -> None:
        """A receiver waits (caller holds _cond) until frames may have come."""
        self._cond.wait(timeout)

    def _advance(self, step: int) -> FrameError | None:
        """Receiver moves on to ``step``; drop what earlier steps left unread.
        Returns the protocol error to end the session with, if that is one."""
        self._recv_step = step
        stale = [key for key in self._pending if key.step < step]
        for key in stale:
            self._pending_bytes -= self._pending.pop(key)[1]
        if not stale:
            return None
        if not self._opts.drop_unread:
            return FrameOrderError(
                f"the peer sent {stale[0]}, which this side never asked for"
            )
        log.warning(
            "%s: dropping %d frame(s) from earlier steps that were never received: %s",
            self._name,
            len(stale),
            ", ".join(map(str, stale[:4])),
        )
        return None

    # ------------------------------------------------- inbound (transport thread)

    def _on_frame(self, inbound: Inbound) -> None:
        """Handle one inbound frame; raises FrameError on a protocol violation
        (the transport then fails the link and tells the peer)."""
        self._received += inbound.nbytes
        frame = inbound.frame
        if frame is None:
            raise MalformedFrameError(inbound.error or "undecodable frame")
        kind = frame_kind(frame)
        if kind == "error":  # may legitimately cut a tensor short: checked first
            msg = f"peer rejected the session: {frame.error.message}"
            self._fail(FrameError(msg), notify_peer=False)
            return
        partial = self._assembler.in_progress
        if partial is not None and kind != "tensor":
            self._assembler.reset()
            raise MalformedFrameError(
                f"{partial} truncated: a {kind.upper()} frame arrived before its end"
            )
        if kind == "tensor":
            done = self._assembler.add(frame.tensor, inbound.data)
            if done is not None:
                self._deliver(*done)
        elif kind == "scalar":
            key = check_scalar(frame.scalar)
            self._admit(key, 0)
            self._deliver(key, frame.scalar.value)
        elif kind == "bye":
            with self._cond:
                self._peer_gone = "peer closed the link"
                self._cond.notify_all()
            self._peer_said_bye()
        else:
            raise MalformedFrameError(f"unexpected {kind.upper()} frame mid-session")

    def _admit(self, key: FrameKey, nbytes: int) -> None:
        """Ordering and memory checks before a frame's data is accepted."""
        with self._cond:
            if key.step < self._in_step:
                raise FrameOrderError(
                    f"{key} arrived after step {self._in_step}: steps must not decrease"
                )
            if key.step > self._in_step:
                self._in_step = key.step
                self._in_keys.clear()
            if key in self._in_keys:
                raise FrameOrderError(f"duplicate {key}")
            cost = nbytes + _ENTRY_COST
            if self._pending_bytes + cost > self._opts.max_pending_bytes:
                raise FrameTooLargeError(
                    f"{key}: receiver already buffers {self._pending_bytes} unread "
                    f"bytes; max_pending_bytes={self._opts.max_pending_bytes}"
                )
            self._in_keys.add(key)
            self._pending_bytes += cost  # reserved now, released when consumed

    def _deliver(self, key: FrameKey, value: torch.Tensor | float) -> None:
        nbytes = 0
        if isinstance(value, torch.Tensor):
            nbytes = value.numel() * value.element_size()
        with self._cond:
            if key.step < self._recv_step:
                self._pending_bytes -= nbytes + _ENTRY_COST
                if not self._opts.drop_unread:
                    raise FrameOrderError(
                        f"{key} arrived after this side moved on to step "
                        f"{self._recv_step}: it was never asked for"
                    )
                log.warning(
                    "%s: dropping %s: this side already moved on to step %d",
                    self._name,
                    key,
                    self._recv_step,
                )
                return
            self._pending[key] = (value, nbytes + _ENTRY_COST)
            self._cond.notify_all()

    # ---------------------------------------------------------- failure, close

    def _check_usable(self) -> None:
        """Raise the sticky failure, if any (caller holds _cond)."""
        if self._error is not None:
            # A fresh instance per raise: re-raising one object would keep
            # growing its traceback across calls.
            raise type(self._error)(str(self._error))
        if self._closing:
            raise LinkClosedError(f"{self._name} is closed")

    def _fail(self, exc: LinkError, *, notify_peer: bool) -> None:
        with self._cond:
            if self._error is not None or self._closing:
                return
            if self._peer_gone is not None and isinstance(exc, PeerLostError):
                return  # the peer already said goodbye; keep unread frames readable
            self._error = exc
            self._cond.notify_all()
        log.log(self._fail_level, "%s: %s: %s", self._name, type(exc).__name__, exc)
        try:
            self._teardown(exc, notify_peer)
        finally:
            self._torn_down.set()

    def abort(self, reason: str) -> None:
        reason = " ".join(str(reason).split()) or "no reason given"  # one line
        self._fail(SessionAbortedError(reason), notify_peer=True)

    def close(self) -> None:
        timeout = self._opts.close_timeout_s
        with self._cond:
            if self._closing:
                return
            failed = self._error is not None  # only _fail() sets it before close
            graceful = not failed and self._peer_gone is None
            if graceful:
                self._queued += 1
                self._jobs.put(_Job(None))
            self._closing = True
        if failed:
            # The thread that noticed the failure may still be stopping the
            # transport (e.g. queueing the frame that tells the peer why);
            # releasing resources under it would bury that reason.
            self._torn_down.wait(timeout)
        if graceful:
            try:
                self.flush(timeout)
            except LinkError as exc:
                log.warning("%s: closing without goodbye: %s", self._name, exc)
                graceful = False
        self._jobs.put(None)
        self._shutdown(graceful, timeout)
        self._sender.join(timeout)
        with self._cond:
            if self._error is None:
                self._error = LinkClosedError(f"{self._name} is closed")
            self._cond.notify_all()
        log.info(
            "%s: closed (%d bytes sent, %d received)",
            self._name,
            self._sent,
            self._received,
        )

    @property
    def bytes_sent(self) -> int:
        return self._sent

    @property
    def bytes_received(self) -> int:
        return self._received

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name}>"


def _describe(shape: tuple[int, ...] | None, dtype: torch.dtype | None) -> str:
    parts = []
    if dtype is not None:
        parts.append(str(dtype).removeprefix("torch."))
    if shape is not None:
        parts.append(str(list(shape)))
    return " ".join(parts)

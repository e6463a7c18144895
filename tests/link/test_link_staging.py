"""A GPU tensor's bytes staged to the host chunk by chunk (``link/staging.py``).

The schedule -- which buffer a copy may land in while which chunk is still to
be written -- is what can go wrong, and it does not need a GPU: these copiers
run the copies on the CPU, once at the worst moment for each hazard. One copy
lands the moment it is issued (a buffer reused too soon is overwritten before
its chunk is written); the other lands only when waited for (a chunk handed
out before its copy landed is seen unfilled). The real CUDA copier is
exercised by ``bench/link_gpu.py`` on a machine with a GPU.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch
from linkutil import transport_pair

from aisyn.link import LinkError
from aisyn.link.codec import decode, encode
from aisyn.link.frames import TENSOR, FrameKey, tensor_chunks, tensor_frames
from aisyn.link.staging import HostStaging, device_parts
from aisyn.link.tensor_writer import TensorWriter


def _land(dst, srcs) -> None:
    offset = 0
    for src in srcs:
        dst[offset : offset + src.numel()].copy_(src)
        offset += src.numel()


class _Copier:
    """Host 'device': copies into plain CPU buffers, at a chosen moment."""

    def __init__(self, lands: str) -> None:
        self.lands = lands  # "at-start" or "at-wait"
        self.buffers = 0
        self.started = 0
        self.waited = 0

    def buffer(self, nbytes: int) -> torch.Tensor:
        self.buffers += 1
        return torch.full((nbytes,), 0xEE, dtype=torch.uint8)

    def start(self, dst, srcs):
        self.started += 1

        def land() -> None:
            _land(dst, srcs)

        if self.lands == "at-start":
            land()
            return None
        return land

    def wait(self, pending) -> None:
        self.waited += 1
        if pending is not None:
            pending()

    def ordered_after(self, ready):
        return contextlib.nullcontext()


class _ThreadCopier(_Copier):
    """Copies that land on a thread of their own, a little later."""

    def __init__(self) -> None:
        super().__init__("thread")
        self._pool = ThreadPoolExecutor(1)

    def start(self, dst, srcs) -> Future:
        self.started += 1

        def land() -> None:
            time.sleep(0.001)
            _land(dst, srcs)

        return self._pool.submit(land)

    def wait(self, pending) -> None:
        self.waited += 1
        pending.result(timeout=10)


def _write_one_behind(chunks):
    """Consume chunks as ``TensorWriter.write`` does -- chunk k is
    written only once chunk k + 1 has been taken -- and return the bytes each
    chunk held at the moment it was written."""
    written, last = [], None
    for views in chunks:
        if last is not None:
            written.append(b"".join(bytes(v) for v in last))
        last = views
    if last is not None:
        written.append(b"".join(bytes(v) for v in last))
    return written


def _ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(total, s + chunk)) for s in range(0, total or 1, chunk)]


@pytest.mark.parametrize("lands", ["at-start", "at-wait"])
@pytest.mark.parametrize("total", [0, 5, 64, 65, 64 * 7 + 3])
def test_each_chunk_holds_its_bytes_when_it_is_written(lands, total):
    side = torch.arange(24, dtype=torch.uint8)
    payload = torch.randint(0, 256, (total,), dtype=torch.uint8)
    stream = torch.cat([side, payload])
    ranges = _ranges(stream.numel(), 64)
    copier = _Copier(lands)
    staging = HostStaging(64, copier)
    written = _write_one_behind(staging.chunks(device_parts(side, payload), ranges))
    assert written == [bytes(stream[s:e].numpy()) for s, e in ranges]
    assert copier.buffers == min(3, len(ranges))  # reused, never more than three
    assert copier.started == copier.waited == len(ranges)


def test_two_buffers_would_overwrite_a_chunk_before_it_is_written():
    """The reason for three: with two, the copy of chunk k + 1 lands in the
    buffer of chunk k - 1, which the link has not written yet."""
    payload = torch.randint(0, 256, (64 * 5,), dtype=torch.uint8)
    ranges = _ranges(payload.numel(), 64)
    staging = HostStaging(64, _Copier("at-start"))
    staging.depth = 2
    written = _write_one_behind(staging.chunks([payload], ranges))
    assert written != [bytes(payload[s:e].numpy()) for s, e in ranges]


def test_copies_on_another_thread_arrive_whole_and_in_order():
    payload = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    ranges = _ranges(payload.numel(), 100_000)
    staging = HostStaging(100_000, _ThreadCopier())
    for _ in range(2):  # the buffers are reused by the next tensor
        written = _write_one_behind(staging.chunks([payload], ranges))
        assert b"".join(written) == bytes(payload.numpy())


def test_a_tensor_abandoned_mid_send_leaves_no_copy_in_flight():
    copier = _Copier("at-wait")
    staging = HostStaging(64, copier)
    payload = torch.zeros(64 * 4, dtype=torch.uint8)
    chunks = staging.chunks([payload], _ranges(payload.numel(), 64))
    next(chunks)  # chunk 0 handed out, chunk 1 in flight
    chunks.close()  # the link failed: the generator is dropped
    assert copier.started == copier.waited == 2


def test_a_range_larger_than_the_buffers_is_refused():
    staging = HostStaging(64, _Copier("at-wait"))
    with pytest.raises(ValueError, match="exceeds the staging size"):
        next(staging.chunks([torch.zeros(65, dtype=torch.uint8)], [(0, 65)]))


@pytest.mark.parametrize("codec", ["none", "bf16", "int8"])
def test_staged_frames_are_the_host_frames(codec):
    x = torch.randn(3, 1000)
    key = FrameKey(TENSOR, "act", 2, 1)
    host = encode(x, codec)
    kept = encode(x, codec, to_host=False)  # the CPU is this test's device
    staging = HostStaging(1000, _Copier("at-wait"))
    data = partial(staging.chunks, device_parts(kept.side, kept.payload))
    assert list(tensor_frames(key, kept, 1000, data)) == list(
        tensor_frames(key, host, 1000)
    )
    staged = [(w.header, b"".join(map(bytes, w.data))) for w in _copied(key, kept)]
    plain = [(w.header, b"".join(map(bytes, w.data))) for w in _copied(key, host)]
    assert staged == plain


def _copied(key, enc):
    """tensor_chunks, each chunk's views read before the next is built."""
    staging = HostStaging(1000, _Copier("at-start"))
    data = partial(staging.chunks, device_parts(enc.side, enc.payload))
    for wire in tensor_chunks(key, enc, 1000, data):
        yield wire._replace(data=[bytes(v) for v in wire.data])


@contextlib.contextmanager
def _staged_links(transport: str, monkeypatch):
    """A link pair whose sender stages every tensor, as it does a GPU's."""
    copier = _ThreadCopier()

    def staging(self, tensor):
        if "staging" not in self._staging:
            self._staging["staging"] = HostStaging(self._chunk_bytes, copier)
        return self._staging["staging"]

    monkeypatch.setattr(TensorWriter, "_host_staging", staging)
    with transport_pair(transport) as (a, b):
        yield a, b, copier


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("transport", "codec"),
    [
        ("grpc", "none"),
        ("data-plane", "none"),
        ("data-plane", "int8"),
        ("memory", "bf16"),
    ],
)
def test_staged_tensors_arrive_as_sent(transport, codec, monkeypatch):
    with _staged_links(transport, monkeypatch) as (a, b, copier):
        xs = [torch.randn(1_500_000), torch.randn(7), torch.randn(2, 300_001)]
        for micro, x in enumerate(xs):
            a.send("act", x, step=0, micro=micro, codec=codec)
        for micro, x in enumerate(xs):
            got = b.recv("act", step=0, micro=micro, timeout=10)
            expected = x if codec == "none" else _round_trip(x, codec)
            assert torch.equal(got, expected)
        assert copier.started == copier.waited >= len(xs)  # all of them staged


def _round_trip(x, codec):
    return decode(encode(x, codec))


def test_a_staged_tensor_modified_before_it_was_read_fails_the_link(monkeypatch):
    with _staged_links("data-plane", monkeypatch) as (a, b, _):
        gate = threading.Event()
        write = a._write

        def held(frame):
            assert gate.wait(10)
            return write(frame)

        a._write = held
        a.send("first", torch.zeros(100_000), step=0)
        x = torch.randn(1_000_000)
        a.send("act", x, step=0)
        x.add_(1)  # before the sender staged it: the guard must notice
        gate.set()
        with pytest.raises(LinkError, match="modified in place"):
            b.recv("act", step=0, timeout=5)


@pytest.mark.slow
def test_the_gpu_bench_runs_its_plumbing_on_the_cpu(tmp_path):
    """bench/link_gpu.py is the device check of a task lent a GPU: it must not
    first fail there on its own plumbing."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "link_gpu.py"
    args = [sys.executable, str(bench), "--device", "cpu", "--shape", "64,1024"]
    res = subprocess.run(
        args + ["--n", "2", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "exact: 9 tensors from cpu (none, bf16, int8) equal the host's" in res.stdout
    assert re.search(
        r"^gpu: link from the GPU \d+ % of a host tensor's rate \(\.cpu\(\) first "
        r"\d+ %\); D2H staged nan GB/s, pinned nan GB/s, pageable [\d.]+ GB/s; "
        r"host memcpy [\d.]+ GB/s$",
        res.stdout,
        re.M,
    ), res.stdout

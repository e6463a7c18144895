"""User-space link shaper: a TCP proxy that adds latency and caps bandwidth.

Kernel ``netem``/``tc`` need privileges that CI and shared boxes don't grant,
so experiments on "two organisations over a WAN" put this proxy between the
parties instead::

    with ShapedProxy(0, "127.0.0.1", server.port, latency_ms_rtt=40,
                     bandwidth_bits_per_s=1e9) as proxy:
        link = connect(f"127.0.0.1:{proxy.port}", ...)

Each direction is modelled as a link of the given rate followed by rtt/2 of
propagation delay: a chunk that arrives at time ``t`` leaves the (serialising)
link at ``max(t, link_free) + size / rate`` and is written out rtt/2 later.
The proxy buffers at most about two bandwidth-delay products per direction
and then stops reading, so TCP flow control -- not unbounded proxy memory --
absorbs a fast sender. Runs an asyncio loop on one background thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from typing import Self

from .base import Service

__all__ = ["ShapedProxy"]

log = logging.getLogger(__name__)

_MAX_READ = 64 * 1024
_UNSHAPED_BUFFER = 16 * 1024 * 1024


class ShapedProxy(Service):
    """Forward ``listen_port`` to ``target_host:target_port`` with added delay
    (``latency_ms_rtt / 2`` each way) and a per-direction rate cap
    (``bandwidth_bits_per_s``; None or 0 = unlimited). ``listen_port`` 0 picks
    a free port, readable as :attr:`port` after :meth:`start`."""

    def __init__(
        self,
        listen_port: int,
        target_host: str,
        target_port: int,
        latency_ms_rtt: float = 0.0,
        bandwidth_bits_per_s: float | None = None,
        *,
        listen_host: str = "127.0.0.1",
    ) -> None:
        if latency_ms_rtt < 0 or (bandwidth_bits_per_s or 0) < 0:
            raise ValueError("latency and bandwidth must be non-negative")
        self.port = listen_port
        self._listen_host = listen_host
        self._target = (target_host, target_port)
        self._one_way = latency_ms_rtt / 2000.0
        self._rate = (bandwidth_bits_per_s or 0) / 8.0  # bytes per second; 0 = off
        if self._rate:
            # ~2 ms of data per chunk keeps pacing smooth at low rates.
            self._read_size = int(min(_MAX_READ, max(1024, self._rate * 0.002)))
            buffer = max(1 << 20, 2 * self._rate * max(self._one_way, 0.01))
        else:
            self._read_size = _MAX_READ
            buffer = _UNSHAPED_BUFFER
        self._queue_chunks = max(16, math.ceil(buffer / self._read_size))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    def start(self) -> Self:
        if self._loop is not None:
            raise RuntimeError("proxy already started")
        loop = self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=loop.run_forever, name="shaped-proxy", daemon=True
        )
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, self._listen_host, self.port), loop
        ).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info(
            "shaped proxy %s:%d -> %s:%d (rtt %.1f ms, %s)",
            self._listen_host,
            self.port,
            *self._target,
            self._one_way * 2000,
            f"{self._rate * 8 / 1e6:g} Mbit/s" if self._rate else "unlimited",
        )
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._conns):
                task.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
            self._loop = self._thread = None

    # -- inside the event loop

    async def _accept(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            try:
                upstream_r, upstream_w = await asyncio.open_connection(*self._target)
                # TaskGroup: an error in one direction cancels the other.
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._pipe(client_r, upstream_w))
                    group.create_task(self._pipe(upstream_r, client_w))
            except* OSError as errors:
                log.debug("shaped proxy connection ended: %s", errors.exceptions[0])
        except asyncio.CancelledError:
            # stop() cancels live connections; ending quietly here keeps
            # asyncio's connection callback from printing the cancellation.
            pass
        finally:
            for writer in (client_w, upstream_w):
                if writer is not None:
                    writer.transport.abort()
            self._conns.discard(task)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One direction: pace to the rate, delay by rtt/2, then half-close."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(
            self._queue_chunks
        )

        failed: list[OSError] = []

        async def ingest() -> None:
            # No try/finally around the puts: a cancelled feeder must not block
            # on a full queue that nobody drains any more.
            try:
                while data := await reader.read(self._read_size):
                    await chunks.put((loop.time(), data))
            except OSError as exc:
                failed.append(exc)
            await chunks.put(None)

        feeder = asyncio.create_task(ingest())
        link_free = 0.0
        try:
            while (item := await chunks.get()) is not None:
                arrived, data = item
                start = max(arrived, link_free)
                link_free = start + len(data) / self._rate if self._rate else start
                wait = link_free + self._one_way - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            if failed:
                raise failed[0]  # a reset on one side ends both directions
            if writer.can_write_eof():
                writer.write_eof()
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await feeder

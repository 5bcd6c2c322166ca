"""The gateway client: httpx2 over asyncio transports, read without a timer per read.

httpx2 is pydantic's maintained fork of httpx. Its connection pool assigns requests in one pass
over the connections; httpx 0.28's pool (httpcore 1.0) rescanned every connection for every idle
one, so with 200 replies streaming its bookkeeping took a tenth of the loop (issue 30). The
socket layer is our own: httpcore2's anyio backend maps exceptions, enters a cancel scope and
starts and cancels a timer on every read, and a reply is forty-odd reads with hundreds of replies
at once. This backend keeps httpcore2's HTTP/1.1, pool and TLS (through asyncio's `start_tls`)
and replaces only the socket: bytes land in a protocol's buffer, a read that finds them returns
at once, and a read that has to wait is bounded by one timer per connection, which is re-armed
only when it fires. Timeouts and failures surface as httpcore2's own exceptions, so httpx2 and
`failures.classify_exception` see what they always saw.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Iterable
from typing import Any

import httpcore2
import httpx2

# httpcore's names for what it asks of a stream, as asyncio's transports name them.
_EXTRA_INFO = {"ssl_object": "ssl_object", "client_addr": "sockname", "server_addr": "peername", "socket": "socket"}
# Reading from the socket pauses while this much is buffered unread, and resumes below half of it.
READ_BUFFER_BYTES = 256 * 1024


class _Protocol(asyncio.Protocol):
    """One connection's received bytes, and futures for the read and the write that wait."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.reading_paused = False
        self.eof = False
        self.closed = False
        self.lost: Exception | None = None
        self.reader: asyncio.Future | None = None
        self.writing_paused = False
        self.drained: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > READ_BUFFER_BYTES and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed, self.lost = True, exc
        self._wake_reader()
        self._wake_writer()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_writer()

    def take(self, max_bytes: int) -> bytes:
        data = self.chunks.popleft()
        if len(data) > max_bytes:
            self.chunks.appendleft(data[max_bytes:])
            data = data[:max_bytes]
        self.buffered -= len(data)
        if self.reading_paused and self.buffered <= READ_BUFFER_BYTES // 2 and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()
        return data

    def _wake_reader(self) -> None:
        if (reader := self.reader) is not None and not reader.done():
            reader.set_result(None)

    def _wake_writer(self) -> None:
        if (drained := self.drained) is not None and not drained.done():
            drained.set_result(None)


class AsyncioStream(httpcore2.AsyncNetworkStream):
    def __init__(self, protocol: _Protocol) -> None:
        self._protocol = protocol
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        protocol = self._protocol
        while not protocol.chunks:
            if protocol.closed or protocol.eof:
                if protocol.lost is not None:
                    raise httpcore2.ReadError(str(protocol.lost) or type(protocol.lost).__name__)
                return b""
            waiter = protocol.reader = protocol.loop.create_future()
            if timeout is not None:
                self._deadline = protocol.loop.time() + timeout
                if self._timer is None:
                    self._timer = protocol.loop.call_at(self._deadline, self._expire)
            try:
                await waiter
            finally:
                protocol.reader = None
        return protocol.take(max_bytes)

    def _expire(self) -> None:
        """The one timer: fails a read that has waited past its deadline, or waits for a later one."""
        self._timer = None
        waiter = self._protocol.reader
        if waiter is None or waiter.done():
            return  # no read is waiting; the next one that waits arms the timer again
        if self._protocol.loop.time() >= self._deadline:
            waiter.set_exception(httpcore2.ReadTimeout("the gateway sent nothing within the read timeout"))
        else:
            self._timer = self._protocol.loop.call_at(self._deadline, self._expire)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        protocol = self._protocol
        if protocol.closed or protocol.transport.is_closing():
            raise httpcore2.WriteError("the connection to the gateway is closed")
        protocol.transport.write(buffer)
        while protocol.writing_paused and not protocol.closed:
            protocol.drained = protocol.loop.create_future()
            try:
                async with asyncio.timeout(timeout):
                    await protocol.drained
            except TimeoutError:
                raise httpcore2.WriteTimeout("the gateway accepted nothing within the write timeout") from None
            finally:
                protocol.drained = None
        if protocol.lost is not None:
            raise httpcore2.WriteError(str(protocol.lost) or type(protocol.lost).__name__)

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._protocol.transport is not None:
            self._protocol.transport.close()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore2.AsyncNetworkStream:
        protocol = self._protocol
        try:
            async with asyncio.timeout(timeout):
                transport = await protocol.loop.start_tls(protocol.transport, protocol, ssl_context,
                                                          server_hostname=server_hostname)
        except TimeoutError:
            await self.aclose()
            raise httpcore2.ConnectTimeout("the TLS handshake with the gateway timed out") from None
        except (OSError, ssl.SSLError) as exc:
            await self.aclose()
            raise httpcore2.ConnectError(str(exc)) from exc
        protocol.transport = transport
        return self

    def get_extra_info(self, info: str) -> Any:
        protocol = self._protocol
        if info == "is_readable":  # an idle pooled connection the gateway closed, or that holds stray bytes
            return bool(protocol.chunks) or protocol.eof or protocol.closed
        name = _EXTRA_INFO.get(info)
        return protocol.transport.get_extra_info(name) if name is not None else None


class AsyncioBackend(httpcore2.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[tuple] | None = None) -> httpcore2.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        return await self._connect(lambda: loop.create_connection(
            lambda: _Protocol(loop), host, port, local_addr=(local_address, 0) if local_address else None),
            timeout, socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[tuple] | None = None) -> httpcore2.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        return await self._connect(lambda: loop.create_unix_connection(lambda: _Protocol(loop), path),
                                   timeout, socket_options)

    @staticmethod
    async def _connect(connect, timeout: float | None, socket_options: Iterable[tuple] | None) -> AsyncioStream:
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await connect()
        except TimeoutError:
            raise httpcore2.ConnectTimeout("connecting to the gateway timed out") from None
        except OSError as exc:
            raise httpcore2.ConnectError(str(exc)) from exc
        for option in socket_options or ():
            transport.get_extra_info("socket").setsockopt(*option)
        return AsyncioStream(protocol)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def gateway_transport(limits: httpx2.Limits) -> httpx2.AsyncHTTPTransport:
    """httpx2's transport with its connection pool on this backend (httpx2 takes no backend of its own)."""
    transport = httpx2.AsyncHTTPTransport(limits=limits)
    transport._pool = httpcore2.AsyncConnectionPool(
        ssl_context=httpx2.create_ssl_context(), max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
        network_backend=AsyncioBackend())
    return transport

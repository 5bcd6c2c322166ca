"""The gateway client's socket layer (upstream/transport.py) against real sockets on loopback.

Each test runs a small asyncio server that misbehaves in one way a gateway can: stalls mid-body,
closes an idle kept-alive connection, reads a large body slowly, speaks TLS. The client is the
one the app builds (`gateway_transport`), and failures must reach `classify_exception` as the
httpx2 exceptions it already knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import threading
import time
from pathlib import Path

import httpx2
import pytest

from chatserver.upstream.failures import classify_exception
from chatserver.upstream.transport import AsyncioBackend, AsyncioStream, gateway_transport
from gateway_sim.simulator import GatewaySimulator, Hold, Script, Text

LIMITS = httpx2.Limits(max_connections=10, max_keepalive_connections=5)


def client(timeout: float = 5.0) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(timeout=timeout, transport=gateway_transport(LIMITS))


def sse_head(keep_alive: bool = True) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            + (b"" if keep_alive else b"connection: close\r\n") + b"\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return await reader.readexactly(length)


@contextlib.asynccontextmanager
async def serving(handle, ssl_context: ssl.SSLContext | None = None):
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ssl_context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_a_stream_read_whole_through_the_simulator_keeps_every_byte():
    with GatewaySimulator() as sim:
        sim.enqueue(Script([Text("one two three four five six seven", chunk_size=1)], chunk_delay=0.01))
        async with client() as http, http.stream("POST", f"{sim.base_url}/v1/chat/completions",
                                                 json={"model": "openai/gpt-4o-mini", "stream": True,
                                                       "messages": [{"role": "user", "content": "hi"}]}) as response:
            body = b"".join([piece async for piece in response.aiter_raw()])
    texts = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert texts[-1] == b"data: [DONE]" and len(texts) > 7
    assert b"seven" in body


async def test_a_gateway_that_stalls_mid_body_is_a_read_timeout_after_the_timeout_not_before():
    release = threading.Event()
    with GatewaySimulator() as sim:
        sim.enqueue(Script([Text("first words", chunk_size=1), Hold(release, timeout=30)]))
        async with client(timeout=httpx2.Timeout(5.0, read=0.6)) as http:
            began = time.monotonic()
            with pytest.raises(httpx2.ReadTimeout) as caught:
                async with http.stream("POST", f"{sim.base_url}/v1/chat/completions",
                                       json={"model": "openai/gpt-4o-mini", "stream": True,
                                             "messages": [{"role": "user", "content": "hi"}]}) as response:
                    async for _ in response.aiter_raw():
                        pass
            waited = time.monotonic() - began
        release.set()
    assert 0.6 <= waited < 5.0
    assert classify_exception(caught.value).message == "The gateway timed out (ReadTimeout)."


async def test_reads_that_keep_arriving_inside_the_timeout_never_time_out():
    """One timer per connection, re-armed when it fires: a slow but steady stream is not cut."""
    async def handle(reader, writer):
        await read_request(reader)
        writer.write(sse_head())
        for n in range(8):
            writer.write(chunk(b"data: %d\n\n" % n))
            await writer.drain()
            await asyncio.sleep(0.15)  # the stream's pace: each gap is under the read timeout, their sum is not
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with serving(handle) as port, client(timeout=httpx2.Timeout(5.0, read=0.4)) as http:
        async with http.stream("POST", f"http://127.0.0.1:{port}/", content=b"{}") as response:
            body = b"".join([piece async for piece in response.aiter_raw()])
    assert body.count(b"data: ") == 9


async def test_an_idle_connection_the_gateway_closed_is_not_reused():
    connections = []
    hang_up = asyncio.Event()

    async def handle(reader, writer):
        connections.append(writer)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await hang_up.wait()
        writer.close()  # later, and without saying `connection: close`: the client learns it only from the socket

    async with serving(handle) as port, client() as http:
        first = await http.post(f"http://127.0.0.1:{port}/", content=b"{}")
        pooled = http._transport._pool.connections
        stream = pooled[0]._connection._network_stream
        assert len(pooled) == 1 and pooled[0].is_idle() and not stream.get_extra_info("is_readable")
        hang_up.set()
        async with asyncio.timeout(5):  # the client's side hears the FIN a moment after the server's close
            while not stream.get_extra_info("is_readable"):
                await asyncio.sleep(0.01)
        second = await http.post(f"http://127.0.0.1:{port}/", content=b"{}")
    assert (first.text, second.text) == ("ok", "ok")
    assert len(connections) == 2


async def test_a_body_larger_than_the_socket_buffers_is_written_whole_to_a_slow_reader():
    body = bytes(range(256)) * (12 * 4096)  # 12 MiB, as a long history makes
    received = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")))
        got = bytearray()
        while len(got) < length:
            got += await reader.read(65536)
            await asyncio.sleep(0)  # a reader slower than the writer: the client's writes must wait for it
        received.append(bytes(got))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndone")
        await writer.drain()
        writer.close()

    async with serving(handle) as port, client() as http:
        response = await http.post(f"http://127.0.0.1:{port}/", content=body)
    assert response.text == "done"
    assert received == [body]


async def test_a_gateway_that_drops_the_connection_mid_body_is_a_read_error():
    async def handle(reader, writer):
        await read_request(reader)
        writer.write(sse_head() + chunk(b"data: {}\n\n"))
        await writer.drain()
        writer.transport.abort()

    async with serving(handle) as port, client() as http:
        with pytest.raises(httpx2.HTTPError) as caught:
            async with http.stream("POST", f"http://127.0.0.1:{port}/", content=b"{}") as response:
                async for _ in response.aiter_raw():
                    pass
    assert classify_exception(caught.value).message == "The gateway closed the connection mid-reply."


async def test_nothing_listening_is_a_connect_error():
    async with serving(lambda reader, writer: None) as port:
        pass  # the port is free again
    async with client() as http:
        with pytest.raises(httpx2.ConnectError) as caught:
            await http.post(f"http://127.0.0.1:{port}/", content=b"{}")
    assert classify_exception(caught.value).message == "Could not connect to the gateway."


async def test_a_large_answer_is_read_whole_even_when_the_client_reads_slowly():
    """Reading pauses while 256 KiB wait unread and resumes as they are taken: nothing is lost."""
    answer = bytes(range(256)) * 8192  # 2 MiB

    async def handle(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(answer) + answer)
        await writer.drain()
        writer.close()

    async with serving(handle) as port, client() as http:
        async with http.stream("POST", f"http://127.0.0.1:{port}/", content=b"{}") as response:
            pieces = []
            async for piece in response.aiter_raw():
                pieces.append(piece)
                await asyncio.sleep(0.001)
    assert b"".join(pieces) == answer


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


async def answer_over_tls(http: httpx2.AsyncClient, certificate) -> str:
    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    async def handle(reader, writer):
        await read_request(reader)
        writer.write(sse_head(keep_alive=False) + chunk(b"data: secure\n\n") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with serving(handle, context) as port:
        async with http.stream("POST", f"https://127.0.0.1:{port}/", content=b"{}") as response:
            return (b"".join([piece async for piece in response.aiter_raw()])).decode()


async def test_a_gateway_on_https_is_read_through_tls(certificate, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))  # trusted the way an operator adds a private CA
    async with client() as http:
        assert await answer_over_tls(http, certificate) == "data: secure\n\n"


async def test_a_gateway_whose_certificate_is_not_trusted_is_refused(certificate, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    async with client() as http:
        with pytest.raises(httpx2.ConnectError) as caught:
            await answer_over_tls(http, certificate)
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)


async def test_the_app_s_gateway_client_reads_through_this_backend(app):
    """The server's one gateway client is the one these tests exercise, not httpx2's default."""
    gateway = app.state.chat.turns.gateway
    response = await gateway.client.get(gateway.url("/v1/models"))
    assert response.status_code == 200
    streams = [connection._connection._network_stream for connection in gateway.client._transport._pool.connections]
    assert streams and all(isinstance(stream, AsyncioStream) for stream in streams)
    assert isinstance(AsyncioBackend(), type(gateway.client._transport._pool._network_backend))

"""A gateway address that cannot work is refused at start; /healthz says whether the gateway answers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx2
import pytest
from pydantic import ValidationError

from chatserver.config import Settings
from chatserver.upstream.probe import gateway_reachable
from support import ROOT, free_port, serve


@pytest.mark.parametrize("url", ["openrouter.ai/api", "localhost:4000", "ftp://example.com/api", "https://"])
def test_gateway_url_without_http_scheme_is_refused_with_what_to_write(url):
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=None, gateway_base_url=url)
    message = caught.value.errors()[0]["msg"]
    assert "must be a full URL starting with https:// or http://" in message
    assert "e.g. GATEWAY_BASE_URL=https://" in message


@pytest.mark.parametrize("url,kept", [("https://openrouter.ai/api/", "https://openrouter.ai/api"),
                                      (" http://127.0.0.1:4000 ", "http://127.0.0.1:4000")])
def test_good_gateway_urls_are_kept_without_trailing_slash(url, kept):
    assert Settings(_env_file=None, gateway_base_url=url).gateway_base_url == kept


def test_make_run_refuses_to_start_on_a_schemeless_gateway_url(tmp_path):
    env = {**os.environ, "GATEWAY_BASE_URL": "openrouter.ai/api", "DATA_DIR": str(tmp_path),
           "PORT": str(free_port())}
    result = subprocess.run([sys.executable, "server.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "configuration error" in result.stderr and "GATEWAY_BASE_URL=https://openrouter.ai/api" in result.stderr


async def test_healthz_says_the_configured_gateway_answers(client):
    health = (await client.get("/healthz")).json()
    assert health["gateway_configured"] is True and health["gateway_reachable"] is True


async def test_healthz_says_a_dead_gateway_port_does_not_answer(tmp_path):
    settings = Settings(_env_file=None, gateway_base_url=f"http://127.0.0.1:{free_port()}",
                        data_dir=tmp_path / "data")
    async with serve(settings) as (_, client):
        health = (await client.get("/healthz")).json()
    assert health["gateway_configured"] is True and health["gateway_reachable"] is False


async def test_healthz_has_no_reachability_for_the_demo_gateway(tmp_path):
    async with serve(Settings(_env_file=None, data_dir=tmp_path / "data")) as (_, client):
        health = (await client.get("/healthz")).json()
    assert health["gateway"] == "demo" and health["gateway_reachable"] is None


class CountingServer:
    """A loopback server that answers every connection with a 404 and counts them."""

    def __init__(self) -> None:
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()


async def test_probe_is_cached_and_shared_by_simultaneous_callers():
    counter = CountingServer()
    server = await asyncio.start_server(counter.handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with httpx2.AsyncClient() as client:
        answers = await asyncio.gather(*[gateway_reachable(base, client, ttl=60) for _ in range(5)])
        assert answers == [True] * 5 and counter.connections == 1
        assert await gateway_reachable(base, client, ttl=60) is True and counter.connections == 1

        server.close()
        await server.wait_closed()
        # Past its time to live the answer is asked again, and a closed port reads as not answering.
        assert await gateway_reachable(base, client, ttl=0) is False


async def test_probe_gives_up_on_a_gateway_that_accepts_but_never_answers():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers; the client's timeout must end this

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server, httpx2.AsyncClient() as client:
        assert await asyncio.wait_for(gateway_reachable(base, client, timeout=0.3, ttl=0), 5) is False


async def test_custom_model_listed_in_reasoning_models_is_reported_reasoning(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        reasoning_models="deepseek/deepseek-r1,acme/thinker-1")
    async with serve(settings) as (_, client):
        assert (await client.post("/api/models", json={"id": "acme/thinker-1", "tier": "frontier"})).status_code == 201
        assert (await client.post("/api/models", json={"id": "acme/plain-1", "tier": "fast"})).status_code == 201
        models = {m["id"]: m for tier in (await client.get("/api/models")).json()["tiers"] for m in tier["models"]}
    assert models["acme/thinker-1"]["reasoning"] is True and models["acme/thinker-1"]["custom"] is True
    assert models["acme/plain-1"]["reasoning"] is False

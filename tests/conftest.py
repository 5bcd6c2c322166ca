"""Shared fixtures: a scriptable gateway simulator, the real ASGI app, and a real uvicorn server."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from chatserver.app import create_app
from chatserver.config import Settings
from gateway_sim.simulator import GatewaySimulator
from support import Api, LiveServer

# Titles off in every test (and every server a test starts): the title call after a first reply
# would take a reply a test queued for its next turn. tests/test_branches.py turns them on.
os.environ["AUTO_TITLE"] = "false"

# The `redis_server` fixture: a real redis-server of its own per test module; `s3_server`: a real
# S3 (SeaweedFS) of its own per test module.
pytest_plugins = ["redis_support", "s3_support"]


# What in a test module says it starts a process of its own (a uvicorn server, a CLI, a writer).
STARTS_A_PROCESS = ("LiveServer(", "subprocess.", "Server(")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test gets its kind's marker (`-m unit`, `-m "not browser"`, ...), and browser tests run
    last: Playwright's sync API keeps an event loop running in the main thread for the session, and
    an asyncio test after it cannot start its own."""
    sources: dict[str, str] = {}
    for item in items:
        source = sources.setdefault(str(item.path), item.path.read_text(encoding="utf-8"))
        kinds = []
        if "e2e" in item.path.parts:
            kinds.append("browser")
        if "redis_server" in getattr(item, "fixturenames", ()):
            kinds.append("redis")
        if any(sign in source for sign in STARTS_A_PROCESS) or "s3_server" in getattr(item, "fixturenames", ()):
            kinds.append("live")
        for kind in kinds or ["unit"]:
            item.add_marker(kind)
    items.sort(key=lambda item: "e2e" in item.path.parts)


@pytest.fixture
def sim():
    with GatewaySimulator(keep_requests=1000) as simulator:
        yield simulator


@pytest.fixture
def settings(tmp_path, sim) -> Settings:
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                    upstream_timeout=5)


@pytest.fixture
async def app(settings):
    application = create_app(settings)
    async with application.router.lifespan_context(application):
        # Started as a server that has settled: its search index built, so a test that snapshots
        # DATA_DIR never sees the start-up build's writes land after its snapshot.
        await asyncio.wait_for(asyncio.shield(application.state.search.ready), 30)
        yield application


@pytest.fixture
async def client(app):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=30) as c:
        yield c


@pytest.fixture
def api(client) -> Api:
    return Api(client)


@pytest.fixture
def live_server(tmp_path, sim):
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url})
    yield server
    server.stop()


@pytest.fixture
def hang_up_stops_server(tmp_path, sim):
    """A real server where a dropped connection stops its turn (ON_DISCONNECT=stop)."""
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "ON_DISCONNECT": "stop"})
    yield server
    server.stop()

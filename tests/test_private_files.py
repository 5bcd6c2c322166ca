"""Files that hold a person's text are 0600, like the conversations: the search index (with its
WAL and shared-memory files) and a streaming reply's checkpoint slots were left to the umask."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from chatserver.config import Settings
from gateway_sim.simulator import Script, steps
from support import names, parse_sse, serve


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


async def test_the_search_index_and_checkpoints_are_private_like_the_conversations(tmp_path, sim, umask_022):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, checkpoint_seconds=0.05)
    sim.enqueue(Script([steps.Text("slowly " * 40, chunk_size=1)], chunk_delay=0.02))
    async with serve(settings) as (_, client):
        conv = (await client.post("/api/conversations", json={})).json()
        turn = asyncio.create_task(client.post(f"/api/conversations/{conv['id']}/messages",
                                               json={"content": "tell me slowly"}))
        conversations = settings.data_dir / "conversations"
        deadline = asyncio.get_running_loop().time() + 10
        while not (slots := list(conversations.rglob(f"{conv['id']}.checkpoint*"))):
            assert asyncio.get_running_loop().time() < deadline, "no checkpoint was written"
            await asyncio.sleep(0.01)
        assert {p.name: mode(p) for p in slots} == {p.name: 0o600 for p in slots}
        assert names(parse_sse((await turn).text))[-1] == "done"
        assert (await client.get("/api/search", params={"q": "slowly"})).json()

        [conversation] = conversations.rglob(f"{conv['id']}.json")
        index_files = sorted((settings.data_dir / "index").glob("search.sqlite3*"))
        assert [p.name for p in index_files][:1] == ["search.sqlite3"]
        assert {p.name: mode(p) for p in index_files} == {p.name: mode(conversation) for p in index_files}
        assert mode(conversation) == 0o600

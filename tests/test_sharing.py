"""Shared read-only copies: anyone with the link reads the snapshot without an account (no memory,
no files or costs unless chosen), the page runs no script and asks not to be indexed, revoking
makes the link 404, another person cannot revoke it, ALLOW_SHARING=false refuses, and the link's
id is random and never a path. Every test runs on the file store and on Redis."""

from __future__ import annotations

import re

import pytest

from chatserver.config import Settings
from gateway_sim.simulator import Script, Usage, steps
from test_attachments import upload
from test_auth import A_PASSWORD, B_PASSWORD, FAST, Server, log_in, store_options
from test_projects import new_conversation, send

MEMORY = "- the person's secret: keeps bees on the roof"
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


@pytest.fixture(params=["files", "redis"])
async def server(request, tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="password", **store_options(request))
    async with Server(settings) as srv:
        await srv.accounts.store.add_user("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
        await srv.accounts.store.add_user("bob", FAST.hash(B_PASSWORD), admin=False, now=0)
        yield srv


@pytest.fixture
async def alice(server):
    async with server.client(peer="192.0.2.1") as client:
        assert (await log_in(client, "alice", A_PASSWORD)).status_code == 204
        yield client


@pytest.fixture
async def bob(server):
    async with server.client(peer="192.0.2.2") as client:
        assert (await log_in(client, "bob", B_PASSWORD)).status_code == 204
        yield client


@pytest.fixture
async def stranger(server):
    async with server.client(peer="198.51.100.7") as client:
        yield client


async def a_conversation(alice, sim) -> dict:
    assert (await alice.put("/api/memory", json={"text": MEMORY})).status_code == 200
    conv = await new_conversation(alice)
    stored = await upload(alice, conv["id"], "plans.txt", b"the roof plans")
    sim.enqueue(Script([steps.Text(f"Here is markup, shown as text: {HOSTILE}")],
                       usage=Usage(prompt=1234, completion=56, cost=0.0123, dialect="openrouter")))
    response = await alice.post(f"/api/conversations/{conv['id']}/messages",
                                json={"content": "What about the roof?", "attachment_ids": [stored.json()["id"]]})
    assert response.status_code == 200
    return conv


async def test_a_link_is_read_without_an_account_and_shows_no_memory_files_or_costs(server, alice, stranger, sim):
    conv = await a_conversation(alice, sim)

    made = await alice.post(f"/api/conversations/{conv['id']}/share", json={})

    assert made.status_code == 201, made.text
    link = made.json()
    assert link["url"] == f"/s/{link['id']}" and link["conversation_id"] == conv["id"] and link["messages"] == 2
    page = await stranger.get(link["url"])
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["x-robots-tag"] == "noindex, nofollow"
    assert '<meta name="robots" content="noindex, nofollow">' in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert "What about the roof?" in page.text and "Here is markup, shown as text" in page.text
    assert "<script" not in page.text and "<img" not in page.text and "&lt;script&gt;" in page.text
    assert "bees" not in page.text and "plans.txt" not in page.text and "1,234" not in page.text
    data = (await stranger.get(f"/api/shared/{link['id']}")).json()
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert "owner" not in data and "bees" not in str(data) and "usage" not in str(data) and "files" not in str(data)


async def test_files_and_costs_are_shown_only_when_chosen(server, alice, stranger, sim):
    conv = await a_conversation(alice, sim)
    link = (await alice.post(f"/api/conversations/{conv['id']}/share",
                             json={"attachments": True, "costs": True})).json()
    page = (await stranger.get(link["url"])).text
    assert "Files: plans.txt" in page and "1,234 in · 56 out · $0.0123" in page
    assert "bees" not in page


async def test_links_are_listed_and_a_revoked_link_is_404(server, alice, bob, stranger, sim):
    conv = await a_conversation(alice, sim)
    first = (await alice.post(f"/api/conversations/{conv['id']}/share", json={})).json()
    second = (await alice.post(f"/api/conversations/{conv['id']}/share", json={})).json()
    listed = (await alice.get("/api/shares")).json()
    assert {s["id"] for s in listed} == {first["id"], second["id"]} and listed[0]["title"] == "What about the roof?"
    assert (await bob.get("/api/shares")).json() == []
    assert (await bob.delete(f"/api/shares/{first['id']}")).status_code == 404  # not Bob's to revoke
    assert (await stranger.get(first["url"])).status_code == 200

    assert (await alice.delete(f"/api/shares/{first['id']}")).status_code == 204

    gone = await stranger.get(first["url"])
    assert gone.status_code == 404 and "What about the roof" not in gone.text
    assert gone.headers["x-robots-tag"] == "noindex, nofollow"
    assert (await stranger.get(f"/api/shared/{first['id']}")).status_code == 404
    assert (await stranger.get(second["url"])).status_code == 200
    assert [s["id"] for s in (await alice.get("/api/shares")).json()] == [second["id"]]
    # Bob cannot share Alice's conversation either: it is 404 to him, as an unknown one.
    assert (await bob.post(f"/api/conversations/{conv['id']}/share", json={})).status_code == 404


async def test_the_share_id_is_random_enough_and_never_a_path(server, alice, stranger, sim):
    conv = await a_conversation(alice, sim)
    ids = [(await alice.post(f"/api/conversations/{conv['id']}/share", json={})).json()["id"] for _ in range(20)]
    assert len(set(ids)) == 20
    for share_id in ids:
        # 32 URL-safe characters: 192 random bits, and nothing a path could make of it.
        assert re.fullmatch(r"[A-Za-z0-9_-]{32}", share_id) and conv["id"] not in share_id
    # (A bare ".." never reaches the server: the client resolves it first.)
    for probe in ("..%2F..%2Fusers.json", "%2e%2e", "%2E%2E%2Fshares", ids[0][:-1], ids[0] + "x", "a" * 31):
        for path in (f"/s/{probe}", f"/api/shared/{probe}"):
            assert (await stranger.get(path)).status_code == 404, path
    assert (await stranger.delete(f"/api/shares/{ids[0]}")).status_code == 401


async def test_allow_sharing_false_refuses_every_sharing_route(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5)
    async with Server(settings) as srv, srv.client() as client:
        conv = await new_conversation(client)
        sim.enqueue(Script([steps.Text("Hi.")]))
        await send(client, conv["id"], "hello")
        link = (await client.post(f"/api/conversations/{conv['id']}/share", json={})).json()
    off = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                   upstream_timeout=5, allow_sharing=False)
    async with Server(off) as srv, srv.client() as client:
        refused = await client.post(f"/api/conversations/{conv['id']}/share", json={})
        assert refused.status_code == 403 and "ALLOW_SHARING" in refused.json()["detail"]
        assert (await client.get("/api/shares")).status_code == 403
        assert (await client.delete(f"/api/shares/{link['id']}")).status_code == 403
        assert (await client.get(link["url"])).status_code == 404
        assert (await client.get(f"/api/shared/{link['id']}")).status_code == 404
        assert (await client.get("/healthz")).json()["sharing"] is False  # the page hides Share

"""People managed from the page (AUTH=password): a non-admin gets 403 from every people route; an
admin adds, resets the password of, promotes, demotes and removes people on both account stores
(files and Redis); the last admin can be neither removed nor demoted; removing a person removes
their data as `server.py user remove` does."""

from __future__ import annotations

import contextlib

import pytest

from chatserver.config import Settings
from test_auth import A_PASSWORD, B_PASSWORD, FAST, Server, log_in, store_options

C_PASSWORD = "carol's brand new secret"


@pytest.fixture(params=["files", "redis"])
async def server(request, tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="password", **store_options(request))
    async with Server(settings) as srv:
        await srv.accounts.store.add_user("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
        await srv.accounts.store.add_user("bob", FAST.hash(B_PASSWORD), admin=False, now=0)
        yield srv


@contextlib.asynccontextmanager
async def signed_in(server, name: str, password: str, peer: str):
    async with server.client(peer=peer) as client:
        response = await log_in(client, name, password)
        assert response.status_code == 204, (name, response.text)
        yield client


def people_routes(app) -> list[tuple[str, str]]:
    """Every people route of the contract, its name filled in."""
    out = []
    for path, operations in app.openapi()["paths"].items():
        if path.startswith("/api/people"):
            out += [(method.upper(), path.replace("{name}", "alice")) for method in operations]
    return out


async def test_a_non_admin_gets_403_from_every_people_route(server):
    routes = people_routes(server.app)
    assert {m for m, _ in routes} == {"GET", "POST", "PUT", "PATCH", "DELETE"} and len(routes) == 5
    bodies = {"POST": {"name": "mallory", "password": "long enough password"},
              "PUT": {"password": "long enough password"}, "PATCH": {"admin": False}}
    async with signed_in(server, "bob", B_PASSWORD, "192.0.2.2") as bob:
        for method, path in routes:
            for body in ({}, bodies.get(method, {})):
                response = await bob.request(method, path, json=body if method != "GET" else None)
                assert response.status_code == 403, (method, path, body, response.text)
        assert (await bob.patch("/api/people/bob", json={"admin": True})).status_code == 403
    names = [u["name"] for u in await server.accounts.store.users()]
    assert names == ["alice", "bob"] and not (await server.accounts.store.find_user("bob"))["admin"]


async def test_an_admin_adds_resets_promotes_demotes_and_removes(server):
    store = server.accounts.store
    async with signed_in(server, "alice", A_PASSWORD, "192.0.2.1") as alice, contextlib.AsyncExitStack() as stack:
        listed = (await alice.get("/api/people")).json()
        assert [(p["name"], p["admin"]) for p in listed] == [("alice", True), ("bob", False)]
        assert "password_hash" not in str(listed) and "owner" not in str(listed)

        added = await alice.post("/api/people", json={"name": "carol", "password": C_PASSWORD})
        assert added.status_code == 201 and added.json()["name"] == "carol" and added.json()["admin"] is False
        assert (await alice.post("/api/people", json={"name": "Carol", "password": C_PASSWORD})).status_code == 409
        assert (await alice.post("/api/people", json={"name": "dan", "password": "short"})).status_code == 422
        assert (await alice.post("/api/people", json={"name": "bad name/..", "password": C_PASSWORD})).status_code == 422
        carol = await stack.enter_async_context(signed_in(server, "carol", C_PASSWORD, "192.0.2.3"))
        assert (await carol.get("/api/conversations")).status_code == 200

        reset = await alice.put("/api/people/carol/password", json={"password": "another long secret"})
        assert reset.status_code == 204
        assert (await carol.get("/api/conversations")).status_code == 401  # her sessions ended
        assert (await log_in(carol, "carol", C_PASSWORD)).status_code == 401
        assert (await log_in(carol, "carol", "another long secret")).status_code == 204

        promoted = await alice.patch("/api/people/carol", json={"admin": True})
        assert promoted.json() == {**promoted.json(), "name": "carol", "admin": True}
        assert (await carol.get("/api/people")).status_code == 200
        assert (await store.find_user("carol"))["admin"] is True
        assert (await alice.patch("/api/people/carol", json={"admin": False})).json()["admin"] is False
        assert (await carol.get("/api/people")).status_code == 403

        assert (await alice.delete("/api/people/carol")).status_code == 204
        assert await store.find_user("carol") is None
        assert (await carol.get("/api/conversations")).status_code == 401
        assert (await log_in(carol, "carol", "another long secret")).status_code == 401
        assert (await alice.delete("/api/people/carol")).status_code == 404
        assert (await alice.put("/api/people/nobody/password", json={"password": C_PASSWORD})).status_code == 404


async def test_the_last_admin_can_be_neither_demoted_nor_removed(server):
    store = server.accounts.store
    async with signed_in(server, "alice", A_PASSWORD, "192.0.2.1") as alice:
        for refused in (await alice.patch("/api/people/alice", json={"admin": False}),
                        await alice.delete("/api/people/alice")):
            assert refused.status_code == 409 and "last administrator" in refused.json()["detail"]
        assert (await store.find_user("alice"))["admin"] is True
        assert (await alice.patch("/api/people/bob", json={"admin": True})).status_code == 200
        # With Bob an admin too, Alice may step down; then Bob is the last one.
        assert (await alice.patch("/api/people/alice", json={"admin": False})).json()["admin"] is False
    async with signed_in(server, "bob", B_PASSWORD, "192.0.2.2") as bob:
        assert (await bob.patch("/api/people/bob", json={"admin": False})).status_code == 409
        assert (await bob.delete("/api/people/alice")).status_code == 204  # not an admin any more
    assert [u["name"] for u in await store.users()] == ["bob"]


async def test_removing_a_person_removes_their_data(server):
    async with signed_in(server, "bob", B_PASSWORD, "192.0.2.2") as bob:
        conv = (await bob.post("/api/conversations", json={})).json()
        assert (await bob.put("/api/memory", json={"text": "- bob's secret"})).status_code == 200
        project = (await bob.post("/api/projects", json={"name": "Bob's"})).json()
        upload = await bob.post(f"/api/projects/{project['id']}/files",
                                files={"file": ("b.txt", b"bob's project notes", "text/plain")})
        assert upload.status_code == 201
        assert (await bob.post(f"/api/conversations/{conv['id']}/share", json={})).status_code == 201
        owner = (await server.accounts.store.find_user("bob"))["owner"]
    store = server.app.state.chat.store
    share_id = (await store.for_owner(owner).read_document("shares")).decode().split('"id":')[1].split('"')[1]
    async with signed_in(server, "alice", A_PASSWORD, "192.0.2.1") as alice:
        assert (await alice.delete("/api/people/bob")).status_code == 204
        assert (await alice.get(f"/s/{share_id}")).status_code == 404
    mine = store.for_owner(owner)
    assert await mine.list() == [] and await mine.read_memory() == ""
    assert await mine.read_document("projects") is None and await mine.read_document("shares") is None
    from chatserver.attachments.store import project_scope
    assert await server.app.state.chat.attachments.list(project_scope(project["id"])) == []


async def test_people_routes_are_404_without_passwords(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5)
    async with Server(settings) as srv, srv.client() as client:
        response = await client.get("/api/people")
        assert response.status_code == 404 and "AUTH=password" in response.json()["detail"]

"""Projects: a project's instructions ride inside the cached prefix (after the persona, before
memory), its files are searched from every conversation in it and from no other, another person's
project is 404, deleting one keeps its conversations (moved out) and deletes its files, and the
migration carries projects files -> Redis -> files. Every test runs on the file store and on Redis."""

from __future__ import annotations

import pytest

from chatserver.config import Settings
from chatserver.store.files import FileStore
from gateway_sim.simulator import Script, steps
from redis_support import unique_prefix
from support import names, parse_sse
from test_attachments import upload
from test_auth import A_PASSWORD, B_PASSWORD, FAST, Server, log_in, store_options
from test_migrate import run_migrate

INSTRUCTIONS = "Project rule: answer every question about the Harbour Survey in metric units."


@pytest.fixture(params=["files", "redis"])
async def server(request, tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="password", default_tool_runtime="local", tool_rounds_max=1,
                        **store_options(request))
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


async def new_project(client, name: str = "Harbour Survey", instructions: str = INSTRUCTIONS) -> dict:
    response = await client.post("/api/projects", json={"name": name, "instructions": instructions})
    assert response.status_code == 201, response.text
    return response.json()


async def new_conversation(client, **body) -> dict:
    response = await client.post("/api/conversations", json=body)
    assert response.status_code == 201, response.text
    return response.json()


async def send(client, conv_id: str, content: str) -> list[tuple[str, dict]]:
    response = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": content})
    assert response.status_code == 200, response.text
    return parse_sse(response.text)


async def test_instructions_sit_in_the_cached_prefix_and_the_file_is_found_from_a_second_conversation(
        server, alice, sim):
    project = await new_project(alice)
    assert (await alice.put("/api/memory", json={"text": "- prefers tea"})).status_code == 200
    stored = await upload(alice, "", "survey.txt", b"Survey notes: the cormorant colony nests on the north pier.\n",
                          path=f"/api/projects/{project['id']}/files")
    assert stored.status_code == 201, stored.text
    first = await new_conversation(alice, project_id=project["id"])
    second = await new_conversation(alice)
    moved = await alice.patch(f"/api/conversations/{second['id']}", json={"project_id": project["id"]})
    assert moved.status_code == 200 and moved.json()["project_id"] == project["id"]
    outside = await new_conversation(alice)
    sim.keep_calling(Script([steps.ToolCall("search_attachments", {"query": "cormorant colony"})]),
                     Script([steps.Text("On the north pier.")]))

    await send(alice, first["id"], "Hello")
    events = await send(alice, second["id"], "Where does the cormorant colony nest?")
    await send(alice, outside["id"], "Where does the cormorant colony nest?")

    assert names(events)[-1] == "done"
    request = next(r for r in sim.requests if "Where does" in str(r.body["messages"]))
    system = [p["text"] for p in request.body["messages"][0]["content"]]
    marked = [i for i, p in enumerate(request.body["messages"][0]["content"]) if "cache_control" in p]
    persona = next(i for i, t in enumerate(system) if t == first["settings"]["system_prompt"].strip())
    rule = next(i for i, t in enumerate(system) if INSTRUCTIONS in t)
    memory = next(i for i, t in enumerate(system) if "prefers tea" in t)
    assert persona < rule < memory <= marked[0], system  # persona, project, memory: all before the marker
    assert "survey.txt" in system[marked[0] + 2]  # the file is listed after the marker and the date
    seen = (await alice.get(f"/api/conversations/{second['id']}")).json()["messages"][-1]
    assert "north pier" in seen["rounds"][0]["results"][0]["content"]
    assert seen["citations"][0]["source"] == "project" and seen["citations"][0]["name"] == "survey.txt"
    behind_chip = await alice.get(f"/api/projects/{project['id']}/files/{stored.json()['id']}/passages")
    assert behind_chip.status_code == 200 and "north pier" in behind_chip.json()["passages"][0]["text"]
    # A conversation outside the project neither sees its file nor carries its instructions.
    elsewhere = (await alice.get(f"/api/conversations/{outside['id']}")).json()["messages"][-1]
    assert "Survey notes" not in str(elsewhere)
    outside_request = [r for r in sim.requests if "Where does" in str(r.body["messages"])][-1]
    assert INSTRUCTIONS not in str(outside_request.body) and "survey.txt" not in str(outside_request.body)
    listed = {c["id"]: c["project_id"] for c in (await alice.get("/api/conversations")).json()}
    assert listed == {first["id"]: project["id"], second["id"]: project["id"], outside["id"]: None}


async def test_another_persons_project_is_404_on_every_project_route(server, alice, bob):
    project = await new_project(alice)
    upload_ok = await upload(alice, "", "a.txt", b"alice's file", path=f"/api/projects/{project['id']}/files")
    file_id = upload_ok.json()["id"]
    bobs_conv = await new_conversation(bob)
    for method, path, kwargs in [
        ("GET", "", {}), ("PATCH", "", {"json": {"name": "mine"}}), ("DELETE", "", {}), ("GET", "/files", {}),
        ("POST", "/files", {"files": {"file": ("b.txt", b"bob's", "text/plain")}}),
        ("GET", f"/files/{file_id}", {}), ("GET", f"/files/{file_id}/passages", {}),
        ("DELETE", f"/files/{file_id}", {}),
    ]:
        theirs = await bob.request(method, f"/api/projects/{project['id']}{path}", **kwargs)
        unknown = await bob.request(method, f"/api/projects/NoSuchProject1234{path}", **kwargs)
        assert theirs.status_code == 404 and (theirs.text == unknown.text), (method, path, theirs.text)
    refused = await bob.patch(f"/api/conversations/{bobs_conv['id']}", json={"project_id": project["id"]})
    assert refused.status_code == 404
    assert (await bob.post("/api/conversations", json={"project_id": project["id"]})).status_code == 404
    assert (await bob.get("/api/projects")).json() == []
    mine = (await alice.get(f"/api/projects/{project['id']}")).json()
    assert mine["name"] == "Harbour Survey" and len((await alice.get(f"/api/projects/{project['id']}/files")).json()) == 1


async def test_deleting_a_project_keeps_its_conversations_moved_out_and_deletes_its_files(server, alice):
    project = await new_project(alice)
    conv = await new_conversation(alice, project_id=project["id"])
    file_id = (await upload(alice, "", "a.txt", b"to be deleted",
                            path=f"/api/projects/{project['id']}/files")).json()["id"]

    assert (await alice.delete(f"/api/projects/{project['id']}")).status_code == 204

    assert (await alice.get(f"/api/conversations/{conv['id']}")).json()["project_id"] is None
    assert (await alice.get(f"/api/projects/{project['id']}")).status_code == 404
    attachments = server.app.state.chat.attachments
    from chatserver.attachments.store import project_scope
    assert await attachments.list(project_scope(project["id"])) == []
    assert file_id not in str(await alice.get("/api/projects"))


async def test_bad_project_input_is_refused_and_changes_nothing(server, alice):
    project = await new_project(alice)
    for body in ({"name": "   "}, {"name": ""}, {"name": "x", "extra": 1}, {"instructions": "x" * 100_001}):
        response = await alice.patch(f"/api/projects/{project['id']}", json=body)
        assert response.status_code == 422, body
    assert (await alice.post("/api/projects", json={"instructions": "no name"})).status_code == 422
    conv = await new_conversation(alice)
    assert (await alice.patch(f"/api/conversations/{conv['id']}", json={"project_id": "../../etc"})).status_code == 404
    assert (await alice.get(f"/api/projects/{project['id']}")).json() == project
    renamed = await alice.patch(f"/api/projects/{project['id']}", json={"name": " Survey 2 "})
    assert renamed.json()["name"] == "Survey 2" and renamed.json()["instructions"] == INSTRUCTIONS


async def test_a_conversation_moves_in_and_out_with_one_patch(server, alice):
    project = await new_project(alice)
    conv = await new_conversation(alice)
    assert (await alice.patch(f"/api/conversations/{conv['id']}",
                              json={"project_id": project["id"]})).json()["project_id"] == project["id"]
    # Another change leaves the project as it is; null moves it out.
    assert (await alice.patch(f"/api/conversations/{conv['id']}",
                              json={"pinned": True})).json()["project_id"] == project["id"]
    assert (await alice.patch(f"/api/conversations/{conv['id']}", json={"project_id": None})).json()["project_id"] is None


async def test_migrate_carries_projects_and_their_files_to_redis_and_back(tmp_path, sim, redis_server):
    """`server.py migrate` files -> Redis -> files: the projects, their files, the shared links."""
    source_dir, back_dir = tmp_path / "source", tmp_path / "back"
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=source_dir, upstream_timeout=5)
    async with Server(settings) as srv, srv.client() as client:
        project = await new_project(client)
        stored = await upload(client, "", "survey.txt", b"Survey notes: the cormorant colony.\n",
                              path=f"/api/projects/{project['id']}/files")
        assert stored.status_code == 201
        conv = await new_conversation(client, project_id=project["id"])
        sim.enqueue(Script([steps.Text("Hi.")]))
        await send(client, conv["id"], "hello")
        link = (await client.post(f"/api/conversations/{conv['id']}/share", json={})).json()
    redis_args = ["--redis-url", redis_server.url, "--redis-prefix", unique_prefix()]

    out = run_migrate("--from", "files", "--to", "redis", "--data-dir", str(source_dir), *redis_args)
    assert "1 projects, 1 shares" in out and "1 shared snapshots, 1 attachments" in out
    run_migrate("--from", "redis", "--to", "files", "--data-dir", str(back_dir), *redis_args)

    for relative in ("projects.json", "shares.json", f"shares/{link['id']}.json"):
        assert (back_dir / relative).read_bytes() == (source_dir / relative).read_bytes(), relative
    files = source_dir / "attachments" / "project" / project["id"]
    copied = back_dir / "attachments" / "project" / project["id"]
    assert sorted(p.relative_to(files) for p in files.rglob("*") if p.is_file()) == \
        sorted(p.relative_to(copied) for p in copied.rglob("*") if p.is_file())
    assert (copied / stored.json()["id"] / "original").read_bytes() == b"Survey notes: the cormorant colony.\n"
    back = FileStore(back_dir)
    assert back.load(conv["id"])["project_id"] == project["id"]


async def test_the_budget_projection_counts_the_project_instructions(server, alice):
    """Before the first measured reply the projection is an estimate: it must not leave them out."""
    project = await new_project(alice, instructions="Keep to the survey's vocabulary. " * 600)
    inside = await new_conversation(alice, project_id=project["id"])
    outside = await new_conversation(alice)
    grown = inside["context"]["history"] - outside["context"]["history"]
    assert grown > 3000, (inside["context"], outside["context"])

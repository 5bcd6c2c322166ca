"""Two people on one server: another person's ids answer exactly like unknown ids on every route,
running turns and memory stay apart, and personal data is masked before it is stored or sent.
Every test runs on the file store and on Redis (a real redis-server)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import pytest

from chatserver.accounts.auth import UserFile
from chatserver.config import Settings
from gateway_sim.simulator import Script, Usage, steps
from support import names, parse_sse
from test_auth import A_PASSWORD, B_PASSWORD, FAST, Server, log_in

UNKNOWN = "NoSuchConversation123"


_databases = itertools.count(1)


@pytest.fixture(params=["files", "redis"])
async def server(request, tmp_path, sim):
    store = {}
    if request.param == "redis":
        # A database of its own per test (16 in all; this module has fewer tests).
        store = {"store": "redis",
                 "redis_url": f"{request.getfixturevalue('redis_server').url}/{next(_databases) % 16}"}
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="password", keep_recent_messages=2, **store)
    async with Server(settings) as srv:
        # Where STORE keeps accounts: users.json, or the Redis the conversations are in.
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


async def send(client, conv_id: str, content: str) -> list[tuple[str, dict]]:
    response = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": content})
    assert response.status_code == 200, response.text
    return parse_sse(response.text)


def owned_files(data_dir) -> dict[str, bytes]:
    """Everything the store keeps for people (sessions and the search cache change on every request)."""
    return {str(p.relative_to(data_dir)): p.read_bytes() for p in sorted(data_dir.rglob("*"))
            if p.is_file() and p.name not in ("sessions.json",) and not p.name.startswith("search")}


def requests_naming(app, conv_id: str, attachment_id: str, message_id: str) -> list[tuple[str, str, dict]]:
    """Every route of the contract that takes a conversation id, with a body it would accept."""
    bodies = {"messages": {"content": "let me in"}, "branch": {"message_id": message_id}}
    out = []
    for path, operations in app.openapi()["paths"].items():
        if "{conv_id}" not in path:
            continue
        concrete = path.replace("{conv_id}", conv_id).replace("{attachment_id}", attachment_id)
        for method in operations:
            last = concrete.rstrip("/").rsplit("/", 1)[-1]
            body = {"title": "mine now"} if method == "patch" else bodies.get(last, {})
            out.append((method.upper(), concrete, body))
    return out


async def ask(client, method: str, path: str, body: dict):
    if method == "POST" and path.endswith("/attachments"):
        return await client.post(path, files={"file": ("notes.txt", b"private notes", "text/plain")})
    return await client.request(method, path, json=body if method != "GET" else None)


async def test_another_persons_ids_answer_exactly_like_unknown_ids_on_every_route(server, alice, bob, sim):
    conv = (await alice.post("/api/conversations", json={})).json()
    sim.enqueue(Script(steps=[steps.Text("Hello Alice.")]))
    events = await send(alice, conv["id"], "my secret plan")
    message_id = events[0][1]["user_message_id"]
    upload = await alice.post(f"/api/conversations/{conv['id']}/attachments",
                              files={"file": ("plan.txt", b"the plan", "text/plain")})
    assert upload.status_code == 201
    attachment_id = upload.json()["id"]
    before = owned_files(server.settings.data_dir)
    stored_before = (await alice.get(f"/api/conversations/{conv['id']}")).json()  # on Redis it is not a file
    requests_before = len(sim.requests)

    checked = requests_naming(server.app, conv["id"], attachment_id, message_id)
    assert {m for m, _, _ in checked} >= {"GET", "PATCH", "DELETE", "POST"} and len(checked) >= 12
    for method, path, body in checked:
        theirs = await ask(bob, method, path, body)
        unknown = await ask(bob, method, path.replace(conv["id"], UNKNOWN), body)
        assert (theirs.status_code, theirs.text) == (unknown.status_code, unknown.text), (method, path)
        assert theirs.status_code in (404, 422), (method, path, theirs.status_code)

    # Bob's own conversation cannot reach Alice's attachment by its id either.
    own = (await bob.post("/api/conversations", json={})).json()
    assert (await bob.get(f"/api/conversations/{own['id']}/attachments/{attachment_id}")).status_code == 404
    assert [c["id"] for c in (await bob.get("/api/conversations")).json()] == [own["id"]]
    assert (await bob.get("/api/search", params={"q": "secret"})).json() == []
    after = {k: v for k, v in owned_files(server.settings.data_dir).items() if own["id"] not in k}
    assert after == before, "Alice's data changed"
    assert (await alice.get(f"/api/conversations/{conv['id']}")).json() == stored_before
    assert len(sim.requests) == requests_before, "Bob's requests reached the gateway"


async def test_a_turn_of_alices_runs_while_bob_hammers_its_id(server, alice, bob, sim):
    conv = (await alice.post("/api/conversations", json={})).json()
    sim.enqueue(Script(steps=[steps.Text("First half, "), steps.Sleep(0.5), steps.Text("second half.")]))
    turn = asyncio.create_task(send(alice, conv["id"], "tell me slowly"))
    path = f"/api/conversations/{conv['id']}"

    answers = set()
    while not turn.done():
        for method, suffix, body in [("GET", "", None), ("PATCH", "", {"title": "bob's"}),
                                     ("POST", "/messages", {"content": "me too"}), ("POST", "/regenerate", {}),
                                     ("POST", "/rewind", {}), ("POST", "/compress", {}), ("DELETE", "", None)]:
            answers.add((await bob.request(method, path + suffix, json=body)).status_code)
        await asyncio.sleep(0)

    events = await turn
    assert answers == {404}
    assert names(events)[-1] == "done"
    stored = (await alice.get(path)).json()
    assert stored["messages"][-1]["content"] == "First half, second half." and stored["title"] != "bob's"


async def test_a_fact_from_alices_conversation_never_reaches_bobs_prompt(alice, bob, sim):
    conv = (await alice.post("/api/conversations", json={})).json()
    for n in range(3):
        sim.enqueue(Script(steps=[steps.Text(f"answer {n}")], usage=Usage(prompt=1000, completion=40)))
        await send(alice, conv["id"], f"question {n} about durian")
    sim.enqueue(Script(steps=[steps.Text(json.dumps({"summary": "Fruit talk.", "facts": ["Loves durian"]}))]))
    compressed = (await alice.post(f"/api/conversations/{conv['id']}/compress", json={})).json()
    assert compressed["facts_added"] == 1
    assert "Loves durian" in (await alice.get("/api/memory")).json()["text"]

    theirs = (await bob.post("/api/conversations", json={})).json()
    sim.enqueue(Script(steps=[steps.Text("Hi Bob.")]))
    await send(bob, theirs["id"], "hello")

    assert (await bob.get("/api/memory")).json()["text"] == ""
    assert "durian" not in json.dumps(sim.requests[-1].body).lower()


async def test_the_model_lineup_is_changed_by_admins_only(alice, bob):
    assert (await bob.post("/api/models", json={"id": "x/model", "tier": "fast"})).status_code == 403
    assert (await alice.post("/api/models", json={"id": "x/model", "tier": "fast"})).status_code == 201
    assert (await bob.delete("/api/models/x/model")).status_code == 403
    assert (await alice.delete("/api/models/x/model")).status_code == 204


async def test_mcp_servers_are_added_by_admins_only_and_only_admins_see_where_they_are(alice, bob):
    body = {"name": "tools", "url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": "Bearer abc-secret-123"}}
    refused = await bob.post("/api/tools/servers", json=body)
    assert refused.status_code == 403 and "administrator" in refused.json()["detail"]
    assert (await alice.post("/api/tools/servers", json=body)).status_code == 201
    assert (await bob.delete("/api/tools/servers/tools")).status_code == 403
    (seen_by_bob,) = (await bob.get("/api/tools/servers")).json()["servers"]
    assert set(seen_by_bob) == {"name", "connected", "error", "failures", "tools"}
    (seen_by_alice,) = (await alice.get("/api/tools/servers")).json()["servers"]
    assert seen_by_alice["url"] == body["url"] and seen_by_alice["header_names"] == ["Authorization"]
    for client in (alice, bob):
        assert "abc-secret-123" not in (await client.get("/api/tools/servers")).text
    assert (await alice.delete("/api/tools/servers/tools")).status_code == 204


# --- masking -------------------------------------------------------------------------------------

PERSONAL = ("Call me at 010-1234-5678 or +82 10-9876-5432, mail kim@example.co.kr, "
            "RRN 900101-1234567, card 4111 1111 1111 1111.")
ORDINARY = "It costs $1,234.56 or ₩15,000 on 2026-12-01, version 1.108.3, order 1234567890123."


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"pii_masking": "on", "keep_recent_messages": 2})


async def test_masking_covers_the_stored_message_the_upstream_request_and_memory(api, client, sim, settings):
    conv = await api.new()
    sim.enqueue(Script(steps=[steps.Text("Noted.")]))

    events = await api.send(conv["id"], PERSONAL + " " + ORDINARY)

    assert events[0][1]["masked"] == 5
    stored = (await api.get(conv["id"]))["messages"][0]["content"]
    sent = json.dumps(sim.requests[-1].body, ensure_ascii=False)
    for text in (stored, sent):
        for secret in ("1234-5678", "9876-5432", "kim@example", "900101-1234567", "4111 1111"):
            assert secret not in text
        for placeholder in ("[phone]", "[email]", "[rrn]", "[card]"):
            assert placeholder in text
        assert ORDINARY in text, "prices, dates, versions and ordinary numbers stay"

    for n in range(2):
        sim.enqueue(Script(steps=[steps.Text(f"answer {n}")]))
        await api.send(conv["id"], f"more {n}")
    fact = "Reach them at 010-1234-5678 or kim@example.co.kr"
    sim.enqueue(Script(steps=[steps.Text(json.dumps({"summary": "Contact.", "facts": [fact]}))]))
    await client.post(f"/api/conversations/{conv['id']}/compress", json={})
    memory = (await client.get("/api/memory")).json()["text"]
    assert "Reach them at [phone] or [email]" in memory and "5678" not in memory


async def test_without_masking_nothing_is_counted_or_changed(api, sim, settings):
    settings.pii_masking = "off"
    conv = await api.new()
    sim.enqueue(Script(steps=[steps.Text("Noted.")]))

    events = await api.send(conv["id"], PERSONAL)

    assert "masked" not in events[0][1]
    assert (await api.get(conv["id"]))["messages"][0]["content"] == PERSONAL
    assert re.search(r"010-1234-5678", json.dumps(sim.requests[-1].body))


async def test_a_persons_own_presets_are_theirs_alone(alice, bob):
    made = await alice.post("/api/presets", json={"name": "pirate", "text": "Talk like a pirate.", "tools": []})
    assert made.status_code == 201

    assert "pirate" not in [p["name"] for p in (await bob.get("/api/presets")).json()]
    assert (await bob.delete("/api/presets/pirate")).status_code == 404
    assert (await bob.post("/api/conversations", json={"preset": "pirate"})).json()["settings"]["preset"] == "default"
    assert (await alice.post("/api/conversations", json={"preset": "pirate"})).json()["settings"]["system_prompt"] \
        == "Talk like a pirate."


async def test_the_tool_check_on_patch_reads_the_persons_own_presets(alice, bob):
    """It read the first admin's presets: it refused bob's own and told him what alice's allowed."""
    secret = {"name": "secret-notes", "text": "Alice's own.", "tools": ["remember", "read_attachment"]}
    assert (await alice.post("/api/presets", json=secret)).status_code == 201
    mine = {"name": "bob-notes", "text": "Bob's own.", "tools": ["remember"]}
    assert (await bob.post("/api/presets", json=mine)).status_code == 201
    conv = (await bob.post("/api/conversations", json={"preset": "bob-notes"})).json()

    patched = await bob.patch(f"/api/conversations/{conv['id']}", json={"settings": {"tools": ["remember"]}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["settings"]["tools"] == ["remember"]

    peek = await bob.patch(f"/api/conversations/{conv['id']}",
                           json={"settings": {"preset": "secret-notes", "tools": ["web_fetch"]}})
    assert peek.status_code == 422 and "does not exist" in peek.json()["detail"]
    assert "read_attachment" not in peek.text
    assert (await bob.get(f"/api/conversations/{conv['id']}")).json()["settings"]["preset"] == "bob-notes"


async def test_switching_accounts_on_gives_the_first_admin_everything_the_server_held(tmp_path, sim):
    from support import serve

    alone = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data")
    async with serve(alone) as (_, client):
        conv = (await client.post("/api/conversations", json={})).json()
        await client.put("/api/memory", json={"text": "- Likes tea\n"})
    UserFile(alone.data_dir).add("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
    UserFile(alone.data_dir).add("bob", FAST.hash(B_PASSWORD), admin=False, now=0)

    async with Server(alone.model_copy(update={"auth": "password"})) as server:
        async with server.client() as alice, server.client(peer="192.0.2.9") as bob:
            await log_in(alice, "alice", A_PASSWORD)
            await log_in(bob, "bob", B_PASSWORD)
            assert [c["id"] for c in (await alice.get("/api/conversations")).json()] == [conv["id"]]
            assert (await alice.get("/api/memory")).json()["text"] == "- Likes tea\n"
            assert (await bob.get("/api/conversations")).json() == []


async def test_a_persons_own_preset_decides_the_tools_their_turns_offer(alice, sim):
    made = await alice.post("/api/presets", json={"name": "notes", "text": "Keep notes.", "tools": ["remember"]})
    assert made.status_code == 201
    conv = (await alice.post("/api/conversations", json={"preset": "notes"})).json()
    sim.enqueue(Script(steps=[steps.Text("Ok.")]))

    await send(alice, conv["id"], "hello")

    declared = [t["function"]["name"] for t in sim.requests[-1].body.get("tools", [])]
    assert declared == ["remember"], "her own preset's whitelist is the one the turn offers"


# Each path personal text takes, with masking on: what is stored and what goes upstream is masked.
FULL_WIDTH_PHONE = "０１０－１２３４－５６７８"


def upstream_text(sim) -> str:
    return json.dumps(sim.requests[-1].body, ensure_ascii=False)


async def test_masking_covers_memory_written_by_hand(api, client, sim, settings):
    put = await client.put("/api/memory", json={"text": f"- My number is {FULL_WIDTH_PHONE}\n"})
    assert put.json()["text"] == "- My number is [phone]\n"
    assert (await client.get("/api/memory")).json()["text"] == "- My number is [phone]\n"
    conv = await api.new()
    sim.enqueue(Script(steps=[steps.Text("Ok.")]))
    await api.send(conv["id"], "hi")
    assert "My number is [phone]" in upstream_text(sim) and "１２３４" not in upstream_text(sim)


async def test_masking_covers_the_conversation_title_and_prompt(api, client, sim, settings):
    conv = await api.new()
    patched = await api.patch(conv["id"], title="Call kim＠example.com",
                              settings={"system_prompt": "The person's card is 4111.1111.1111.1111."})
    assert patched["title"] == "Call [email]"
    assert patched["settings"]["system_prompt"] == "The person's card is [card]."
    sim.enqueue(Script(steps=[steps.Text("Ok.")]))
    await api.send(conv["id"], "hi")
    assert "The person's card is [card]." in upstream_text(sim) and "4111" not in upstream_text(sim)


async def test_masking_covers_the_summary(api, client, sim, settings):
    conv = await api.new()
    for n in range(3):
        sim.enqueue(Script(steps=[steps.Text(f"answer {n}")]))
        await api.send(conv["id"], f"question {n}")
    summary = "They asked about (02) 123-4567 and 900101 1234567."
    sim.enqueue(Script(steps=[steps.Text(json.dumps({"summary": summary, "facts": []}))]))
    assert (await client.post(f"/api/conversations/{conv['id']}/compress", json={})).status_code == 200
    assert (await api.get(conv["id"]))["summary"] == "They asked about [phone] and [rrn]."
    sim.enqueue(Script(steps=[steps.Text("Ok.")]))
    await api.send(conv["id"], "next")
    assert "They asked about [phone] and [rrn]." in upstream_text(sim) and "4567" not in upstream_text(sim)


async def test_masking_covers_imported_conversations(api, client, sim, settings):
    settings.pii_masking = "off"
    conv = await api.new()
    sim.enqueue(Script(steps=[steps.Text("Noted.")]))
    await api.send(conv["id"], f"Reach me at {FULL_WIDTH_PHONE} or hong@naver.com")
    await api.patch(conv["id"], title="hong@naver.com")
    exported = (await client.get(f"/api/conversations/{conv['id']}/export", params={"format": "json"})).content
    assert FULL_WIDTH_PHONE.encode() in exported
    settings.pii_masking = "on"

    response = await client.post("/api/import", files={"file": ("export.json", exported, "application/json")})
    assert response.status_code == 201, response.text
    [new_id] = response.json()["imported"]
    imported = await api.get(new_id)
    assert imported["title"] == "[email]"
    assert imported["messages"][0]["content"] == "Reach me at [phone] or [email]"
    sim.enqueue(Script(steps=[steps.Text("Ok.")]))
    await api.send(new_id, "hi")
    assert "Reach me at [phone] or [email]" in upstream_text(sim) and "naver" not in upstream_text(sim)


async def test_masking_covers_attachment_text(api, client, sim, settings):
    settings.default_tool_runtime = "local"
    conv = await api.new()
    text = f"Contact sheet\nKim: {FULL_WIDTH_PHONE}\nLee: lee@example.org\n".encode()
    uploaded = await client.post(f"/api/conversations/{conv['id']}/attachments",
                                 files={"file": ("contacts.txt", text, "text/plain")})
    assert uploaded.status_code == 201, uploaded.text
    sim.enqueue(Script(steps=[steps.ToolCall("read_attachment", {"name": "contacts.txt"})]),
                Script(steps=[steps.Text("Here they are.")]))
    response = await client.post(f"/api/conversations/{conv['id']}/messages",
                                 json={"content": "who is on the sheet?", "attachment_ids": [uploaded.json()["id"]]})
    events = parse_sse(response.text)
    assert names(events)[-1] == "done"
    sent = upstream_text(sim)
    assert "Kim: [phone]" in sent and "Lee: [email]" in sent
    assert "１２３４" not in sent and "lee@example.org" not in sent

"""Issue 17 through the real app and the gateway simulator: edit and resend, regenerate as siblings,
switching branches, compression and the summary following the current branch, pin and archive,
titles from the summarizer, and an import's tree surviving export and import again."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import orjson
import pytest

from chatserver.config import Settings
from chatserver.conversations.document import SCHEMA_VERSION, new_id, now_iso
from gateway_sim.simulator import Script, Usage, errors, steps
from support import parse_sse, serve

FIXTURES = Path(__file__).parent / "fixtures"
KEEP = 2


@pytest.fixture
def settings(tmp_path, sim) -> Settings:
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5,
                    keep_recent_messages=KEEP)


@pytest.fixture
async def conv(api):
    created = await api.new()
    await api.patch(created["id"], settings={"web_search": False, "web_fetch": False})
    return created


def reply(text: str, prompt: int = 1000) -> Script:
    return Script(steps=[steps.Text(text)], usage=Usage(prompt=prompt, completion=20))


def history_of(body: dict) -> list[str]:
    """The texts of the non-system messages an upstream request carried."""
    out = []
    for m in body["messages"]:
        if m["role"] == "system":
            continue
        content = m["content"]
        out.append(content if isinstance(content, str) else "".join(p.get("text", "") for p in content))
    return out


def system_of(body: dict) -> str:
    return "\n".join(p["text"] if isinstance(p, dict) else "" for m in body["messages"] if m["role"] == "system"
                     for p in (m["content"] if isinstance(m["content"], list) else [{"text": m["content"]}]))


def turns_sent(sim) -> list[dict]:
    return [r.body for r in sim.requests if r.body.get("stream")]


def texts(conv: dict) -> list[str]:
    return [m["content"] for m in conv["messages"] if m["role"] != "notice"]


async def talk(api, sim, conv_id: str, n: int) -> None:
    for i in range(1, n + 1):
        sim.enqueue(reply(f"answer {i}", prompt=1000 + 100 * i))
        events = await api.send(conv_id, f"question {i}")
        assert events[-1][0] == "done", events


async def send_from(client, conv_id: str, parent_id, content: str):
    return await client.post(f"/api/conversations/{conv_id}/messages", json={"content": content, "parent_id": parent_id})


async def switch(client, conv_id: str, message_id: str) -> dict:
    response = await client.post(f"/api/conversations/{conv_id}/branch", json={"message_id": message_id})
    assert response.status_code == 200, response.text
    return response.json()


# --- Edit and resend -------------------------------------------------------------------------------

async def test_editing_the_second_of_five_messages_makes_a_branch_and_keeps_the_old_one(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 5)
    before = await api.get(cid)
    second = [m for m in before["messages"] if m["role"] == "user"][1]
    assert [m["parent_id"] for m in before["messages"]] == [None] + [m["id"] for m in before["messages"][:-1]]

    sim.enqueue(reply("answer to the edit"))
    response = await send_from(client, cid, second["parent_id"], "question 2, edited")

    assert response.status_code == 200 and parse_sse(response.text)[-1][0] == "done"
    assert history_of(turns_sent(sim)[-1]) == ["question 1", "answer 1", "question 2, edited"]
    after = await api.get(cid)
    assert texts(after) == ["question 1", "answer 1", "question 2, edited", "answer to the edit"]
    edited = after["messages"][2]
    assert edited["parent_id"] == second["parent_id"] and after["messages"][3]["parent_id"] == edited["id"]
    # Only the current path's messages list their siblings (the old question is off it now).
    assert after["branches"] == {edited["id"]: [second["id"], edited["id"]]}
    assert after["last_prompt_tokens"] is not None  # measured again, on the new path

    back = await switch(client, cid, second["id"])
    assert back["messages"] == before["messages"]  # the old branch exactly as it was
    assert back["last_prompt_tokens"] is None  # that measurement was the other path's
    sim.enqueue(reply("answer 6"))
    await api.send(cid, "question 6")
    assert history_of(turns_sent(sim)[-1]) == texts(before) + ["question 6"]

    again = await switch(client, cid, edited["id"])
    assert texts(again) == texts(after)


async def test_a_send_from_a_point_that_is_not_an_answer_point_is_422_and_changes_nothing(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 2)
    before = await api.get(cid)
    first_user, first_answer = before["messages"][0], before["messages"][1]

    for parent in (first_user["id"], "AAAAAAAAAAAAAAAAAAAAAA"):
        response = await send_from(client, cid, parent, "from nowhere")
        assert response.status_code == 422 and "parent_id" in response.json()["detail"]
    assert (await api.get(cid))["messages"] == before["messages"]
    assert len(turns_sent(sim)) == 2

    sim.enqueue(reply("a new first answer"))
    response = await send_from(client, cid, None, "a new first question")  # editing the first message
    assert response.status_code == 200
    rooted = await api.get(cid)
    assert texts(rooted) == ["a new first question", "a new first answer"]
    assert rooted["messages"][0]["parent_id"] is None
    assert rooted["branches"] == {rooted["messages"][0]["id"]: [first_user["id"], rooted["messages"][0]["id"]]}
    assert rooted["title"] == before["title"]  # an edit does not rename the conversation
    assert history_of(turns_sent(sim)[-1]) == ["a new first question"]
    assert first_answer["id"] not in {m["id"] for m in rooted["messages"]}


async def test_an_edit_that_fails_before_any_output_puts_the_old_branch_back(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 3)
    before = await api.get(cid)
    sim.enqueue(errors.server_error_502())

    response = await send_from(client, cid, before["messages"][1]["id"], "question 2, edited")

    events = parse_sse(response.text)
    assert events[-1][0] == "error" and events[-1][1]["draft"] == "question 2, edited"
    after = await api.get(cid)
    assert after["messages"] == before["messages"] and after["branches"] == {}


async def test_search_finds_a_word_on_a_branch_that_is_not_current(api, client, sim, conv):
    cid = conv["id"]
    sim.enqueue(reply("answer about zanzibar"))
    await api.send(cid, "tell me about zanzibar")
    first = await api.get(cid)
    sim.enqueue(reply("answer about madagascar"))
    await send_from(client, cid, None, "tell me about madagascar")

    hits = (await client.get("/api/search", params={"q": "zanzibar"})).json()

    found = [h["message_id"] for h in hits if h["message_id"] is not None]  # (a title hit has none)
    assert found and set(found) <= {m["id"] for m in first["messages"]}
    opened = await switch(client, cid, found[0])
    assert "zanzibar" in texts(opened)[0]


# --- Regenerate ------------------------------------------------------------------------------------

async def test_regenerate_keeps_every_answer_as_a_sibling(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 1)
    sim.enqueue(reply("second try"), reply("third try"))

    await api.regenerate(cid)
    await api.regenerate(cid)

    stored = await api.get(cid)
    assert texts(stored) == ["question 1", "third try"]
    question = stored["messages"][0]
    answer_ids = stored["branches"][stored["messages"][1]["id"]]
    assert len(answer_ids) == 3 and answer_ids[-1] == stored["messages"][1]["id"]
    for body in turns_sent(sim)[-2:]:
        assert history_of(body) == ["question 1"]  # no earlier answer goes upstream

    first = await switch(client, cid, answer_ids[0])
    assert texts(first) == ["question 1", "answer 1"] and first["messages"][1]["parent_id"] == question["id"]
    second = await switch(client, cid, answer_ids[1])
    assert texts(second) == ["question 1", "second try"] and second["branches"] == {answer_ids[1]: answer_ids}


async def test_a_regenerate_that_fails_before_any_output_keeps_the_answer_it_was_replacing(api, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 1)
    sim.enqueue(errors.server_error_502())

    events = await api.regenerate(cid)

    assert events[-1][0] == "error"
    stored = await api.get(cid)
    assert texts(stored) == ["question 1", "answer 1"] and stored["branches"] == {}


async def test_rewind_takes_back_the_message_with_all_its_answers(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 2)
    sim.enqueue(reply("another answer 2"))
    await api.regenerate(cid)

    response = await client.post(f"/api/conversations/{cid}/rewind", json={})

    assert response.json() == {"content": "question 2"}
    stored = await api.get(cid)
    assert texts(stored) == ["question 1", "answer 1"] and stored["branches"] == {}


# --- Switching ---------------------------------------------------------------------------------------

async def test_going_back_to_an_older_version_returns_to_the_path_last_viewed_under_it(api, client, sim, conv):
    """Switching back to version 1 of a message showed the most recent child at each level, so a
    thread continued under an older version of a later message seemed lost."""
    cid = conv["id"]
    await talk(api, sim, cid, 2)
    first_q, _, second_q, _ = (await api.get(cid))["messages"]
    sim.enqueue(reply("answer to the edit"))
    await send_from(client, cid, second_q["parent_id"], "question 2, edited")
    await switch(client, cid, second_q["id"])  # back to version 1 of question 2, and on from there
    sim.enqueue(reply("answer 3"))
    await api.send(cid, "question 3")
    viewed = texts(await api.get(cid))
    sim.enqueue(reply("answer to another first question"))
    await send_from(client, cid, None, "question 1, edited")

    back = await switch(client, cid, first_q["id"])

    assert texts(back) == viewed == ["question 1", "answer 1", "question 2", "answer 2", "question 3", "answer 3"]
    assert "last_child" not in back
    forward = await switch(client, cid, back["branches"][first_q["id"]][1])
    assert texts(forward) == ["question 1, edited", "answer to another first question"]


async def test_the_branch_route_refuses_unknown_messages_and_running_turns(api, app, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 1)
    stored = await api.get(cid)

    unknown = await client.post(f"/api/conversations/{cid}/branch", json={"message_id": "AAAAAAAAAAAAAAAAAAAAAA"})
    assert unknown.status_code == 404
    store = app.state.chat.store.for_owner("local")
    lock = await store.lock_turn(cid)
    try:
        busy = await client.post(f"/api/conversations/{cid}/branch", json={"message_id": stored["messages"][0]["id"]})
        assert busy.status_code == 409
    finally:
        await store.unlock_turn(lock)
    assert (await api.get(cid))["messages"] == stored["messages"]


async def test_every_new_route_answers_another_owners_conversation_as_unknown(app, client):
    theirs = await app.state.chat.store.for_owner("bob").create({
        "id": new_id(), "title": "Bob's", "model": "m", "created_at": now_iso(), "updated_at": now_iso(),
        "settings": {}, "messages": [{"id": new_id(), "role": "user", "content": "hi", "created_at": now_iso(),
                                      "parent_id": None}],
    })
    cid, mid = theirs["id"], theirs["messages"][0]["id"]

    assert (await client.post(f"/api/conversations/{cid}/branch", json={"message_id": mid})).status_code == 404
    assert (await send_from(client, cid, None, "edit")).status_code == 404
    assert (await client.patch(f"/api/conversations/{cid}", json={"pinned": True})).status_code == 404
    assert (await client.get("/api/conversations", params={"archived": "true"})).json() == []
    assert (await app.state.chat.store.for_owner("bob").get(cid))["pinned"] is False


# --- Compression follows the branch ------------------------------------------------------------------

def summary_script(text: str) -> Script:
    return Script(steps=[steps.Text(json.dumps({"summary": text, "facts": []}))],
                  usage=Usage(prompt=300, completion=30))


async def test_the_summary_covers_the_current_path_only(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 4)
    sim.enqueue(summary_script("Talked about questions one to three."))
    assert (await client.post(f"/api/conversations/{cid}/compress", json={})).json()["folded"] == 6
    folded = await api.get(cid)
    assert [m["content"] for m in folded["archive"]][:2] == ["question 1", "answer 1"]
    assert folded["summary"] == "Talked about questions one to three."

    # Below the fold point: the summary still describes this path, so it goes upstream.
    last_question = [m for m in folded["messages"] if m["role"] == "user"][-1]
    sim.enqueue(reply("answer 4, again"))
    await send_from(client, cid, last_question["parent_id"], "question 4, edited")
    sent = turns_sent(sim)[-1]
    assert "Talked about questions one to three." in system_of(sent)
    assert history_of(sent) == ["question 4, edited"]

    # Above it: question 2 was folded, so that summary describes messages no longer on the path.
    question_2 = folded["archive"][2]
    assert question_2["content"] == "question 2"
    sim.enqueue(reply("answer 2, again"))
    await send_from(client, cid, question_2["parent_id"], "question 2, edited")
    sent = turns_sent(sim)[-1]
    assert "Talked about" not in system_of(sent)
    assert history_of(sent) == ["question 1", "answer 1", "question 2, edited"]
    edited = await api.get(cid)
    assert edited["summary"] == "" and edited.get("archive", []) == []
    assert edited["context"]["summary"] == 0 and edited["context"]["measured"] is True

    # Back on the first branch, the fold and its summary are exactly what they were.
    back = await switch(client, cid, last_question["id"])
    assert back["summary"] == folded["summary"] and back["archive"] == folded["archive"]
    assert back["messages"] == folded["messages"]
    assert back["last_prompt_tokens"] is None


# --- Pin and archive --------------------------------------------------------------------------------

async def test_pinned_conversations_come_first_and_archived_ones_only_when_asked(api, sim):
    ids = []
    for title in ("oldest", "middle", "newest"):
        conv = await api.new()
        await api.patch(conv["id"], settings={"web_search": False, "web_fetch": False})
        sim.enqueue(reply("ok"))
        await api.send(conv["id"], title)
        ids.append(conv["id"])
    oldest, middle, newest = ids

    pinned = await api.patch(oldest, pinned=True)
    archived = await api.patch(middle, archived=True)

    assert pinned["pinned"] is True and archived["archived"] is True
    listed = (await api.client.get("/api/conversations")).json()
    assert [c["id"] for c in listed] == [oldest, newest]
    assert [(c["pinned"], c["archived"]) for c in listed] == [(True, False), (False, False)]
    only_archived = (await api.client.get("/api/conversations", params={"archived": "true"})).json()
    assert [c["id"] for c in only_archived] == [middle]
    await api.patch(middle, archived=False)
    await api.patch(oldest, pinned=False)
    assert [c["id"] for c in (await api.client.get("/api/conversations")).json()] == [newest, middle, oldest]
    bad = await api.client.patch(f"/api/conversations/{oldest}", json={"pinned": "yes"})
    assert bad.status_code == 422


# --- Titles ------------------------------------------------------------------------------------------

def summarizer_calls(sim) -> list[dict]:
    return [r.body for r in sim.requests if not r.body.get("stream")]


@pytest.fixture
async def titled(settings):
    async with serve(settings.model_copy(update={"auto_title": True})) as (app, client):
        yield app, client


async def first_turn(client, text: str) -> str:
    conv = (await client.post("/api/conversations", json={})).json()
    await client.patch(f"/api/conversations/{conv['id']}", json={"settings": {"web_search": False, "web_fetch": False}})
    response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": text})
    assert parse_sse(response.text)[-1][0] == "done"
    return conv["id"]


async def test_the_first_reply_brings_a_title_from_the_summarizer_with_its_cost(titled, sim):
    app, client = titled
    sim.enqueue(reply("Gyeongbokgung first."),
                Script(steps=[steps.Text('"Seoul trip plan."')], usage=Usage(prompt=60, completion=4, cost=0.00002,
                                                                           dialect="openrouter")))
    cid = await first_turn(client, "Plan a trip to Seoul for me\nwith three days")
    await asyncio.wait_for(app.state.chat.turns.idle(), 10)

    stored = (await client.get(f"/api/conversations/{cid}")).json()
    assert stored["title"] == "Seoul trip plan" and stored["title_source"] == "model"
    assert stored["totals"]["title_calls"] == 1 and stored["totals"]["title_cost"] == pytest.approx(0.00002)
    (call,) = summarizer_calls(sim)
    assert call["model"] == app.state.chat.settings.summarizer_model and call["max_tokens"] == 64
    assert "Plan a trip to Seoul" in call["messages"][0]["content"]

    response = await client.post(f"/api/conversations/{cid}/messages", json={"content": "and food?"})
    assert parse_sse(response.text)[-1][0] == "done"
    await asyncio.wait_for(app.state.chat.turns.idle(), 10)
    assert len(summarizer_calls(sim)) == 1  # only after the first reply


async def test_the_demo_gateway_answers_the_title_request(titled, sim):
    app, client = titled
    cid = await first_turn(client, "How do tides work on the moon and earth")
    await asyncio.wait_for(app.state.chat.turns.idle(), 10)
    stored = (await client.get(f"/api/conversations/{cid}")).json()
    assert stored["title"] == "Simulated: How do tides work on"


async def test_a_renamed_conversation_keeps_its_name_and_a_failed_title_call_keeps_the_first_line(titled, sim):
    app, client = titled
    conv = (await client.post("/api/conversations", json={})).json()
    await client.patch(f"/api/conversations/{conv['id']}", json={"title": "My name for it",
                                                                  "settings": {"web_search": False, "web_fetch": False}})
    response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hello there"})
    assert parse_sse(response.text)[-1][0] == "done"
    await asyncio.wait_for(app.state.chat.turns.idle(), 10)
    stored = (await client.get(f"/api/conversations/{conv['id']}")).json()
    assert stored["title"] == "My name for it" and stored["title_source"] == "user"
    assert summarizer_calls(sim) == []

    sim.enqueue(reply("hi"), errors.server_error_502())
    cid = await first_turn(client, "Why is the sky blue")
    await asyncio.wait_for(app.state.chat.turns.idle(), 10)
    failed = (await client.get(f"/api/conversations/{cid}")).json()
    assert failed["title"] == "Why is the sky blue" and failed["title_source"] == "auto"
    assert failed["totals"]["title_calls"] == 1


# --- Import and export ---------------------------------------------------------------------------------

def tree_shape(nodes: list[dict], current: str | None) -> tuple:
    """The tree without ids: each node's role and text with its children in order, and the current path."""
    children: dict = {}
    for n in nodes:
        if n["role"] in ("user", "assistant"):
            children.setdefault(n["parent_id"], []).append(n)

    def shape(parent):
        return tuple((n["role"], n["content"], shape(n["id"])) for n in children.get(parent, []))

    by_id = {n["id"]: n for n in nodes}
    path, at = [], current
    while at is not None:
        path.append(by_id[at]["content"])
        at = by_id[at]["parent_id"]
    return shape(None), tuple(reversed(path))


async def export_of(client, cid: str) -> bytes:
    response = await client.get(f"/api/conversations/{cid}/export", params={"format": "json"})
    assert response.status_code == 200
    return response.content


async def test_a_branched_chatgpt_import_survives_export_and_import_again(client):
    raw = (FIXTURES / "chatgpt_conversations.json").read_bytes()
    imported = await client.post("/api/import", files={"file": ("conversations.json", raw)})
    cid = imported.json()["imported"][0]
    stored = (await client.get(f"/api/conversations/{cid}")).json()
    assert texts(stored)[-1] == "Rome is the capital of Italy." and stored["title_source"] == "imported"
    assert all("parent_id" in m for m in stored["messages"])
    germany = (await switch(client, cid, stored["branches"][stored["messages"][2]["id"]][0]))
    assert texts(germany) == ["What is the capital of France?", "The capital of France is Paris.",
                              "And of Germany?", "Berlin."]
    await switch(client, cid, stored["messages"][-2]["id"])  # the last is the notice that gpt-4o is not in the lineup

    first = orjson.loads(await export_of(client, cid))["conversations"][0]
    again = await client.post("/api/import", files={"file": ("export.json", await export_of(client, cid))})
    second_id = again.json()["imported"][0]
    second = orjson.loads(await export_of(client, second_id))["conversations"][0]

    assert tree_shape(first["nodes"], first["current"]) == tree_shape(second["nodes"], second["current"])
    shape, path = tree_shape(first["nodes"], first["current"])
    assert path[-1] == "Rome is the capital of Italy." and len(shape[0][2][0][2]) == 2  # two branches after Paris
    restored = (await client.get(f"/api/conversations/{second_id}")).json()
    assert texts(restored) == texts(stored) and len(restored["branches"]) == 1


async def test_a_compressed_branched_conversation_survives_export_and_import(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 4)
    sim.enqueue(summary_script("Summary of the start."))
    await client.post(f"/api/conversations/{cid}/compress", json={})
    folded = await api.get(cid)
    sim.enqueue(reply("other answer 4"))
    await api.regenerate(cid)
    before = await api.get(cid)

    again = await client.post("/api/import", files={"file": ("export.json", await export_of(client, cid))})
    restored = await api.get(again.json()["imported"][0])

    assert restored["summary"] == "Summary of the start."
    assert [m["content"] for m in restored["archive"]] == [m["content"] for m in folded["archive"] if m["role"] != "notice"]
    assert texts(restored) == texts(before) and len(restored["branches"]) == 1
    sim.enqueue(reply("fine"))
    await api.send(restored["id"], "question 5")
    sent = turns_sent(sim)[-1]
    assert "Summary of the start." in system_of(sent) and "question 1" not in history_of(sent)


# --- Older files ---------------------------------------------------------------------------------------

async def test_a_version_3_file_loads_as_one_path(settings, tmp_path):
    cid = new_id()
    messages = [{"id": new_id(), "role": role, "content": f"{role} {i}", "created_at": now_iso()}
                for i in range(3) for role in ("user", "assistant")]
    old = {"schema_version": 3, "id": cid, "owner": "local", "title": "Old", "model": "openai/gpt-5-mini", "created_at": now_iso(),  # noqa: E501
           "updated_at": now_iso(), "settings": {}, "summary": "old summary", "last_prompt_tokens": 10,
           "totals": {"turns": 3}, "archive": messages[:2], "messages": messages[2:]}
    folder = settings.data_dir / "conversations"
    folder.mkdir(parents=True)
    (folder / f"{cid}.json").write_bytes(orjson.dumps(old))

    async with serve(settings) as (app, client):
        stored = (await client.get(f"/api/conversations/{cid}")).json()
        assert [m["parent_id"] for m in stored["messages"]] == [m["id"] for m in messages[1:5]]
        assert stored["archive"][0]["parent_id"] is None and stored["branches"] == {}
        assert (stored["pinned"], stored["archived"], stored["totals"]["title_calls"]) == (False, False, 0)
        # The old archive is one fold: an edit above it leaves the summary behind, a switch back restores it.
        edit = await client.post(f"/api/conversations/{cid}/messages",
                                 json={"content": "edited", "parent_id": None})
        assert edit.status_code == 200
        assert (await client.get(f"/api/conversations/{cid}")).json()["summary"] == ""
        back = await switch(client, cid, messages[-1]["id"])
        assert back["summary"] == "old summary" and [m["id"] for m in back["archive"]] == [m["id"] for m in messages[:2]]
    on_disk = orjson.loads((folder / f"{cid}.json").read_bytes())
    assert on_disk["schema_version"] == SCHEMA_VERSION

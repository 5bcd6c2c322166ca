"""Export and import (issue 17): Markdown and JSON of a real conversation, ChatGPT and Open WebUI
exports as trees, the round trip through our own format, and files that cannot be read."""

from __future__ import annotations

import codecs
import io
import json
import re
import struct
import zipfile
from pathlib import Path

import orjson
import pytest

from chatserver.conversations import exchange
from chatserver.conversations.exchange import Unreadable, current_path, parse_import, siblings
from gateway_sim.simulator import Script, Usage, steps

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def shape(nodes: list[dict], current: str | None) -> tuple:
    """A tree without its ids: each root with its children, in order, and the current path's positions."""
    children: dict[str | None, list[dict]] = {}
    for n in nodes:
        children.setdefault(n["parent_id"], []).append(n)

    def walk(n: dict) -> tuple:
        return (n["role"], n["content"], n["created_at"], n.get("model"),
                tuple(walk(c) for c in children.get(n["id"], [])))

    path = current_path(nodes, current)
    positions = tuple(children[n["parent_id"]].index(n) for n in path)
    return tuple(walk(r) for r in children.get(None, [])), positions


def path_texts(conv: dict) -> list[tuple[str, str]]:
    return [(n["role"], n["content"]) for n in current_path(conv["nodes"], conv["current"])]


def stored_from(imported: dict) -> tuple[dict, list[dict]]:
    """What the store will hold for an import: the current path as `messages`, every node besides."""
    conv = {"id": "conv-under-test", "title": imported["title"], "model": imported["model"],
            "created_at": imported["created_at"], "updated_at": imported["updated_at"],
            "messages": current_path(imported["nodes"], imported["current"])}
    return conv, imported["nodes"]


# --- ChatGPT -------------------------------------------------------------------------------------

def test_a_chatgpt_export_becomes_trees_with_branches():
    capitals, seoul = parse_import(fixture("chatgpt_conversations.json"))

    assert (capitals["title"], capitals["model"]) == ("Capitals", "gpt-4o")
    # The system node, the call to the web tool, its output and the reasoning are left out.
    assert [(n["role"], n["content"]) for n in capitals["nodes"]] == [
        ("user", "What is the capital of France?"), ("assistant", "The capital of France is Paris."),
        ("user", "And of Germany?"), ("assistant", "Berlin."),
        ("user", "And of Italy? Please check the web."), ("assistant", "Rome is the capital of Italy."),
    ]
    assert path_texts(capitals) == [
        ("user", "What is the capital of France?"), ("assistant", "The capital of France is Paris."),
        ("user", "And of Italy? Please check the web."), ("assistant", "Rome is the capital of Italy."),
    ]
    by_text = {n["content"]: n for n in capitals["nodes"]}
    edited = [by_text["And of Germany?"]["id"], by_text["And of Italy? Please check the web."]["id"]]
    assert siblings(capitals["nodes"]) == {edited[0]: edited, edited[1]: edited}
    # The reply after the skipped tool nodes hangs from the question that started them.
    assert by_text["Rome is the capital of Italy."]["parent_id"] == edited[1]
    assert by_text["Berlin."]["model"] == "gpt-4o" and "model" not in by_text["And of Germany?"]
    assert by_text["What is the capital of France?"]["created_at"] == "2024-05-29T16:26:40.122Z"
    assert capitals["nodes"][0]["parent_id"] is None
    assert path_texts(seoul) == [("user", "[image]\n\n서울에서 가볼 만한 곳을 알려 주세요."),
                                 ("assistant", "경복궁과 북촌 한옥마을을 추천합니다.")]


def test_chatgpt_current_node_on_a_skipped_node_falls_back_to_its_kept_ancestor():
    data = json.loads(fixture("chatgpt_conversations.json"))
    data[0]["current_node"] = "think-1"  # reasoning, left out

    (capitals, _) = parse_import(orjson.dumps(data))

    assert path_texts(capitals)[-1] == ("user", "And of Italy? Please check the web.")


# --- Open WebUI ----------------------------------------------------------------------------------

def test_an_open_webui_export_keeps_regenerated_answers_as_siblings():
    (haiku,) = parse_import(fixture("open_webui_export.json"))

    assert (haiku["title"], haiku["model"]) == ("Haiku", "llama3.1:8b")
    assert haiku["created_at"] == "2024-07-03T09:46:40.000Z"
    assert path_texts(haiku) == [("user", "Write a haiku about autumn."), ("assistant", "Crimson maple leaves"),
                                 ("user", "Now one about winter."), ("assistant", "Silent snow settles")]
    answers = [n["id"] for n in haiku["nodes"] if n["content"] in ("Leaves drift slowly down", "Crimson maple leaves")]
    assert siblings(haiku["nodes"]) == {a: answers for a in answers}
    assert all(n.get("model") == "llama3.1:8b" for n in haiku["nodes"] if n["role"] == "assistant")


def test_an_open_webui_chat_without_history_reads_its_message_list():
    data = json.loads(fixture("open_webui_export.json"))
    del data[0]["chat"]["history"]

    (haiku,) = parse_import(orjson.dumps(data))

    assert [n["content"] for n in haiku["nodes"]] == [
        "Write a haiku about autumn.", "Crimson maple leaves", "Now one about winter.", "Silent snow settles"]


# --- round trip ----------------------------------------------------------------------------------

def test_a_branched_chatgpt_import_survives_export_and_import_again():
    (capitals, _) = parse_import(fixture("chatgpt_conversations.json"))

    exported = exchange.export_json([stored_from(capitals)])
    (again,) = parse_import(exported)

    assert json.loads(exported)["format"] == "chat-server-export" and json.loads(exported)["version"] == 1
    assert shape(again["nodes"], again["current"]) == shape(capitals["nodes"], capitals["current"])
    assert (again["title"], again["model"], again["created_at"]) == (
        capitals["title"], capitals["model"], capitals["created_at"])
    assert {n["id"] for n in again["nodes"]}.isdisjoint(n["id"] for n in capitals["nodes"])  # fresh ids


def test_tree_helpers_read_a_linear_conversation_and_give_the_branch_fields():
    messages = [{"id": f"m{i}", "role": "user" if i % 2 == 0 else "assistant", "content": str(i)} for i in range(4)]
    nodes, leaf = exchange.to_tree({"messages": messages})

    assert [n["parent_id"] for n in nodes] == [None, "m0", "m1", "m2"] and leaf == "m3"
    forked = nodes + [{"id": "m1b", "parent_id": "m0", "role": "assistant", "content": "again"}]
    path, branches = exchange.from_tree(forked, "m1b")
    assert [m["id"] for m in path] == ["m0", "m1b"]
    assert branches == {"m1": ["m1", "m1b"], "m1b": ["m1", "m1b"]}


# --- files that cannot be read -------------------------------------------------------------------

def chatgpt_with(mutate, keep: int | None = None) -> bytes:
    """The ChatGPT fixture changed by `mutate`; only its conversation `keep` when given."""
    data = json.loads(fixture("chatgpt_conversations.json"))
    mutate(data)
    return orjson.dumps(data if keep is None else [data[keep]])


def cycle(data):
    data[0]["mapping"]["client-created-root"]["parent"] = "a-2b"


def missing_parent(data):
    data[1]["mapping"]["k-2"]["parent"] = "nowhere"


def mapping_not_object(data):
    data[1]["mapping"] = ["not", "a", "mapping"]


UNREADABLE = [
    (b"not json at all", "not JSON; Import takes this server's JSON export"),
    # What people give Import by mistake: each gets the way on, not a parser's message.
    (exchange.export_markdown({"id": "c-trip", "title": "Trip", "created_at": "2026-01-01T00:00:00Z", "messages": [
        {"role": "user", "content": "hi", "created_at": "2026-01-01T00:00:00Z"}]}).encode(),
     "^Markdown exports can't be imported; use the JSON export"),
    (b"\x89PNG\r\n\x1a\n" + bytes(64), "^this is an image, not a conversation export; to ask about an image, attach it"),
    (b"%PDF-1.7\n" + bytes(64), "^this is a PDF, not a conversation export"),
    (b'[{"title": "cut', "^the JSON breaks off or is damaged near line 1, column"),
    (b'"a string"', "not a list of conversations"),
    (b"[]", "no conversations"),
    (b'[{"title": "x"}]', "not a ChatGPT, Open WebUI or chat-server export"),
    (b'{"format": "chat-server-export", "version": 99, "conversations": []}', "version 99"),
    (b'{"format": "chat-server-export", "version": 1, "conversations": [{"nodes": "x"}]}', "nodes: Input should be a valid list"),
    # A file of one conversation that cannot be read (one among readable ones is skipped, below).
    (chatgpt_with(cycle, keep=0), "cycle"),
    (chatgpt_with(missing_parent, keep=1), "not in the file"),
    (chatgpt_with(mapping_not_object, keep=1), "no `mapping`"),
    (b'[{"title": "t", "mapping": {}}, 7]', "conversation 2 is not an object"),
    (b'[{"chat": {"history": {"messages": {}}}}, {"title": "Second"}]', "conversation 2 .*no `chat` object"),
]


@pytest.mark.parametrize("raw,reason", UNREADABLE, ids=[r for _, r in UNREADABLE])
def test_a_file_that_cannot_be_read_says_why(raw, reason):
    with pytest.raises(Unreadable, match=reason):
        parse_import(raw)


def test_odd_field_types_are_tolerated_not_refused():
    raw = orjson.dumps([{"title": None, "mapping": {"a": {"parent": None, "children": [], "message": {
        "author": {"role": "user"}, "content": {"content_type": "text", "parts": ["hi", None, 3]},
        "metadata": {"model_slug": 5}, "create_time": "yesterday"}}}}])

    (conv,) = parse_import(raw)

    assert conv["title"] == "Imported conversation" and [n["content"] for n in conv["nodes"]] == ["hi"]


def test_absurd_sizes_are_refused(monkeypatch):
    monkeypatch.setattr(exchange, "MAX_NODES", 2)
    with pytest.raises(Unreadable, match="over 2 messages"):
        parse_import(fixture("chatgpt_conversations.json"))
    monkeypatch.setattr(exchange, "MAX_NODES", 100)
    monkeypatch.setattr(exchange, "MAX_CONTENT_CHARS", 10)
    with pytest.raises(Unreadable, match="over 10 characters"):
        parse_import(fixture("chatgpt_conversations.json"))
    monkeypatch.setattr(exchange, "MAX_CONVERSATIONS", 1)
    with pytest.raises(Unreadable, match="over 1 conversations"):
        parse_import(fixture("chatgpt_conversations.json"))
    monkeypatch.setattr(exchange, "MAX_IMPORT_BYTES", 100)
    with pytest.raises(Unreadable, match="over 0 MB"):
        parse_import(fixture("chatgpt_conversations.json"))


def test_progress_is_reported_per_conversation():
    seen = []

    parse_import(fixture("chatgpt_conversations.json"), progress=lambda done, total: seen.append((done, total)))

    assert seen == [(1, 2), (2, 2)]


# --- export through the app ----------------------------------------------------------------------

@pytest.fixture
def settings(tmp_path, sim):
    from chatserver.config import Settings
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                    upstream_timeout=5, keep_recent_messages=2)


async def made_through_the_api(api, client, sim) -> dict:
    conv = await api.new()
    cid = conv["id"]
    await api.patch(cid, settings={"web_search": False, "web_fetch": False})
    for q in ("first question about Seoul", "second question", "third question"):
        sim.enqueue(Script(steps=[steps.Text(f"**answer** to {q}")], usage=Usage(prompt=1000, completion=40)))
        events = await api.send(cid, q)
        assert events[-1][0] == "done"
    await api.patch(cid, title='Trip: "Seoul" / ../../etc <plan>')  # after the first message named it
    sim.enqueue(Script(steps=[steps.Text(json.dumps({"summary": "Seoul trip.", "facts": []}))]))
    assert (await client.post(f"/api/conversations/{cid}/compress", json={})).json()["folded"] > 0
    return await api.get(cid)


async def test_export_markdown_of_a_real_conversation(api, client, sim):
    conv = await made_through_the_api(api, client, sim)

    response = await client.get(f"/api/conversations/{conv['id']}/export", params={"format": "md"})

    assert response.status_code == 200 and response.headers["content-type"].startswith("text/markdown")
    disposition = response.headers["content-disposition"]
    assert disposition.startswith('attachment; filename="Trip Seoul etc plan.md"') and "/" not in disposition
    text = response.text
    assert text.startswith('# Trip: "Seoul" / ../../etc <plan>\n')
    folded_at, conversation_at = text.index("## Earlier messages (folded"), text.index("## Conversation")
    assert folded_at < text.index("first question about Seoul") < conversation_at
    assert text.index("third question") > conversation_at
    assert "\n> Folded " in text  # the compression notice, as a quote
    assert f"### Assistant · {conv['model']} · " in text and "**answer** to third question" in text


async def test_export_json_of_a_real_conversation_imports_back_as_its_path(api, client, sim):
    conv = await made_through_the_api(api, client, sim)

    response = await client.get(f"/api/conversations/{conv['id']}/export", params={"format": "json"})

    assert response.status_code == 200 and response.headers["content-disposition"].startswith("attachment;")
    envelope = response.json()
    assert (envelope["format"], envelope["version"]) == ("chat-server-export", 1)
    (entry,) = envelope["conversations"]
    assert [m["id"] for m in entry["archive"]] == [m["id"] for m in conv["archive"]]
    (imported,) = parse_import(response.content)
    # The whole path is in the tree, folded messages included; `folded` says which were folded.
    path = conv["archive"] + conv["messages"]
    assert path_texts(imported) == [(m["role"], m["content"]) for m in path if m["role"] != "notice"]
    by_id = {n["id"]: n for n in imported["nodes"]}
    assert [by_id[i]["content"] for i in imported["folded"]] == [
        m["content"] for m in conv["archive"] if m["role"] != "notice"]
    assert imported["summary"] == "Seoul trip."


async def test_export_of_an_unknown_conversation_is_404(client):
    response = await client.get("/api/conversations/AAAAAAAAAAAAAAAAAAAAAA/export")
    assert response.status_code == 404
    assert (await client.get("/api/conversations/AAAAAAAAAAAAAAAAAAAAAA/export?format=pdf")).status_code == 422


def test_file_names_never_carry_a_path():
    assert exchange.safe_filename("../../etc/passwd", "md") == "etc passwd.md"
    assert exchange.safe_filename("서울 여행", "json") == "서울 여행.json"
    assert exchange.safe_filename("...", "md") == "conversation.md"
    assert exchange.content_disposition("서울 여행.json") == (
        "attachment; filename=\"conversation.json\"; filename*=UTF-8''%EC%84%9C%EC%9A%B8%20%EC%97%AC%ED%96%89.json")


# --- the import route ---------------------------------------------------------------------------

async def test_the_import_route_stores_nothing_when_no_conversation_can_be_read(client):
    bad = chatgpt_with(cycle, keep=0)

    refused = await client.post("/api/import", files={"file": ("conversations.json", bad, "application/json")})

    assert refused.status_code == 422 and "cycle" in refused.json()["detail"]
    assert [(w["code"], w["index"], w["title"]) for w in refused.json()["warnings"]] == [
        ("conversation_skipped", 1, "Capitals")]
    assert (await client.get("/api/conversations")).json() == []
    accepted = await client.post("/api/import", files={"file": ("x.json", fixture("chatgpt_conversations.json"))})
    assert accepted.status_code == 201
    ids = accepted.json()["imported"]
    assert len(ids) == 2
    stored = (await client.get(f"/api/conversations/{ids[0]}")).json()
    assert [m["content"] for m in stored["messages"] if m["role"] != "notice"][-1] == "Rome is the capital of Italy."
    assert stored["title"] == "Capitals" and len(stored["branches"]) == 1  # the Italy question, on the path


# --- sizes that must stay linear (issue 21) -------------------------------------------------------

def chatgpt_node(parent: str | None, role: str, text: str) -> dict:
    return {"parent": parent, "children": [],
            "message": {"author": {"role": role}, "content": {"content_type": "text", "parts": [text]}}}


def chatgpt_file(mapping: dict, current: str | None = None) -> bytes:
    return orjson.dumps([{"title": "Many versions", "mapping": mapping, "current_node": current}])


def answered_levels(levels: int, answers: int) -> tuple[dict, str]:
    """`levels` questions, each answered `answers` times; the next question follows the last answer."""
    mapping, parent = {}, None
    for level in range(levels):
        question = f"q{level}"
        mapping[question] = chatgpt_node(parent, "user", f"question {level}")
        for k in range(answers):
            mapping[f"a{level}-{k}"] = chatgpt_node(question, "assistant", f"answer {level}.{k}")
        parent = f"a{level}-{answers - 1}"
    return mapping, parent


class CountingRaw(dict):
    """The source nodes handed to `build_tree`, counting how often it reads one."""

    reads = 0

    def __getitem__(self, key):
        self.reads += 1
        return super().__getitem__(key)


def test_a_long_chain_of_left_out_messages_is_read_a_few_times_per_node_not_once_per_step():
    # Tool calls, reasoning and hidden system messages are left out and their children hang from
    # the nearest kept message: each answer below a chain used to walk the whole chain up.
    chain, answers = 5_000, exchange.MAX_SIBLINGS
    raw = CountingRaw(q={"parent": None, "role": "user", "content": "q", "created_at": "t", "model": None})
    parent = "q"
    for i in range(chain):
        raw[f"h{i}"] = {"parent": parent, "role": None, "content": "", "created_at": "t", "model": None}
        parent = f"h{i}"
    for k in range(answers):
        raw[f"a{k}"] = {"parent": parent, "role": "assistant", "content": f"a{k}", "created_at": "t", "model": None}

    nodes, current = exchange.build_tree(raw, {}, "a0")

    assert len(nodes) == 1 + answers and {n["parent_id"] for n in nodes[1:]} == {nodes[0]["id"]}
    assert current == nodes[1]["id"]
    assert raw.reads <= 4 * len(raw)  # walking up from every answer read it 10 million times


def test_an_import_with_more_versions_of_a_message_than_the_cap_is_refused():
    mapping, _ = answered_levels(1, 20_000)  # the attack: 20,000 answers to one question

    with pytest.raises(Unreadable, match=f"over {exchange.MAX_SIBLINGS} versions"):
        parse_import(chatgpt_file(mapping))


async def test_an_import_of_20000_sibling_answers_answers_a_get_of_a_few_megabytes(client):
    # 20 questions answered 1,000 times each: listing every sibling's group made this 500 MB.
    mapping, last = answered_levels(20, exchange.MAX_SIBLINGS)
    imported = await client.post("/api/import", files={"file": ("conversations.json", chatgpt_file(mapping, last))})
    assert imported.status_code == 201, imported.text

    response = await client.get(f"/api/conversations/{imported.json()['imported'][0]}")

    assert response.status_code == 200 and len(response.content) < 3 * 2**20
    conv = response.json()
    assert len(conv["messages"]) == 40 and set(conv["branches"]) == {m["id"] for m in conv["messages"][1::2]}
    assert all(len(group) == exchange.MAX_SIBLINGS for group in conv["branches"].values())


async def test_a_refused_import_stores_nothing(client):
    mapping, _ = answered_levels(1, exchange.MAX_SIBLINGS + 1)

    response = await client.post("/api/import", files={"file": ("conversations.json", chatgpt_file(mapping))})

    assert response.status_code == 422 and f"over {exchange.MAX_SIBLINGS} versions" in response.json()["detail"]
    assert (await client.get("/api/conversations")).json() == []


# --- models from the lineup only (issue 21) ---------------------------------------------------------

async def test_an_import_whose_model_is_not_in_the_lineup_uses_the_default_and_says_so(client, sim, settings):
    response = await client.post("/api/import", files={"file": ("x.json", fixture("chatgpt_conversations.json"))})

    assert response.status_code == 201
    ids, warnings = response.json()["imported"], response.json()["warnings"]
    assert [(w["id"], w["code"]) for w in warnings] == [(ids[0], "model_replaced"), (ids[1], "model_replaced")]
    assert "gpt-4o" in warnings[0]["message"] and settings.default_model in warnings[0]["message"]
    capitals = (await client.get(f"/api/conversations/{ids[0]}")).json()
    assert capitals["model"] == settings.default_model
    notice = capitals["messages"][-1]
    assert (notice["role"], notice["content"]) == ("notice", warnings[0]["message"])
    assert notice["parent_id"] == capitals["messages"][-2]["id"]
    await client.patch(f"/api/conversations/{ids[0]}", json={"settings": {"web_search": False, "web_fetch": False}})
    sim.enqueue(Script(steps=[steps.Text("Madrid.")]))
    sent = await client.post(f"/api/conversations/{ids[0]}/messages", json={"content": "And of Spain?"})
    assert sent.status_code == 200
    body = [r.body for r in sim.requests if r.body.get("stream")][-1]
    assert body["model"] == settings.default_model  # never "gpt-4o" as the file said
    assert [m["role"] for m in body["messages"] if m["role"] != "system"] == ["user", "assistant"] * 2 + ["user"]


async def test_an_import_whose_model_is_in_the_lineup_keeps_it_without_a_word(client):
    data = json.loads(fixture("chatgpt_conversations.json"))
    for item in data:
        item["default_model_slug"] = "anthropic/claude-sonnet-4.5"

    response = await client.post("/api/import", files={"file": ("x.json", orjson.dumps(data))})

    assert response.status_code == 201 and response.json()["warnings"] == []
    stored = (await client.get(f"/api/conversations/{response.json()['imported'][0]}")).json()
    assert stored["model"] == "anthropic/claude-sonnet-4.5" and stored["messages"][-1]["role"] == "assistant"


# --- this server's own export: every imported field is type-checked (issue 21) ---------------------

def own_export(mutate) -> bytes:
    """A real export of the ChatGPT fixture's first conversation, with an older export's `archive`, changed by `mutate`."""
    (capitals, _) = parse_import(fixture("chatgpt_conversations.json"))
    envelope = json.loads(exchange.export_json([stored_from(capitals)]))
    envelope["conversations"][0]["archive"] = [
        {"role": "user", "content": "an earlier question", "created_at": "2024-05-01T10:00:00.000Z"},
        {"role": "assistant", "content": "an earlier answer", "model": "gpt-4", "created_at": "2024-05-01T10:00:01.000Z"}]
    mutate(envelope["conversations"][0])
    return orjson.dumps(envelope)


def setter(*path, value):
    def mutate(conv: dict) -> None:
        target = conv
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


BAD_FIELDS = [
    (setter("archive", 1, "model", value=5), "archive[1].model"),  # made every Markdown export of it a 500
    (setter("archive", 0, "created_at", value=7), "archive[0].created_at"),
    (setter("archive", 0, "content", value=["x"]), "archive[0].content"),
    (setter("archive", value="folded"), "archive"),
    (setter("model", value={"id": "gpt-4o"}), "model"),
    (setter("title", value=5), "title"),
    (setter("summary", value=5), "summary"),
    (setter("created_at", value="yesterday"), "created_at"),
    (setter("updated_at", value=1717000000), "updated_at"),
    (setter("settings", value="none"), "settings"),
    (setter("current", value=3), "current"),
    (setter("nodes", 1, "model", value=5), "nodes[1].model"),
    (setter("nodes", 0, "created_at", value="the 29th of May"), "nodes[0].created_at"),
    (setter("nodes", 0, "parent_id", value=0), "nodes[0].parent_id"),
    (setter("nodes", 2, "role", value=None), "nodes[2].role"),
    (setter("nodes", 2, "content", value=None), "nodes[2].content"),
    (setter("nodes", 3, "id", value=4), "nodes[3].id"),
]


def test_the_unmutated_export_of_the_field_tests_imports():
    (conv,) = parse_import(own_export(lambda conv: None))

    assert [m["content"] for m in conv["archive"]] == ["an earlier question", "an earlier answer"]
    assert conv["archive"][1]["model"] == "gpt-4"


@pytest.mark.parametrize("mutate,field", BAD_FIELDS, ids=[f for _, f in BAD_FIELDS])
def test_a_field_of_the_wrong_type_in_our_own_export_is_refused_naming_it(mutate, field):
    with pytest.raises(Unreadable, match=rf"^conversation 1( \(“Capitals”\))?: {re.escape(field)}: "):
        parse_import(own_export(mutate))


async def test_an_own_export_with_a_bad_field_is_422_and_stores_nothing(client):
    bad = own_export(setter("archive", 1, "model", value=5))

    response = await client.post("/api/import", files={"file": ("export.json", bad)})

    assert response.status_code == 422 and "archive[1].model: Input should be a valid string" in response.json()["detail"]
    assert (await client.get("/api/conversations")).json() == []
    good = await client.post("/api/import", files={"file": ("export.json", own_export(lambda conv: None))})
    (cid,) = good.json()["imported"]
    markdown = await client.get(f"/api/conversations/{cid}/export", params={"format": "md"})
    assert markdown.status_code == 200 and "### Assistant · gpt-4 · " in markdown.text


# --- imports as people export them (issue 24) -------------------------------------------------------
# Fixtures: tests/fixtures/README.md says where each file comes from.

def zipped(members: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out.getvalue()


PNG = b"\x89PNG\r\n\x1a\n" + bytes(64)


def chatgpt_download(conversations: bytes) -> bytes:
    """ChatGPT's "Export data" zip as it is laid out: conversations.json beside chat.html, account
    files and the images of the conversations."""
    return zipped({"conversations.json": conversations, "chat.html": b"<html><body>...</body></html>",
                   "user.json": b'{"id": "user-x"}', "message_feedback.json": b"[]",
                   "file-Ab12Cd34-photo.png": PNG, "dalle-generations/file-Ef56-image.webp": PNG,
                   "user-x/file-Gh78-screenshot.JPG": PNG, "dalle-generations/": b""})


@pytest.mark.parametrize("encode", [
    lambda text: codecs.BOM_UTF8 + text.encode("utf-8"),
    lambda text: text.encode("utf-16"),  # with its byte-order mark, as Windows tools write it
    lambda text: codecs.BOM_UTF16_BE + text.encode("utf-16-be"),
], ids=["utf-8 bom", "utf-16 le bom", "utf-16 be bom"])
def test_a_file_with_a_byte_order_mark_is_read_as_without_it(encode):
    text = fixture("chatgpt_conversations.json").decode("utf-8")

    marked = parse_import(encode(text))

    plain = parse_import(text.encode("utf-8"))
    assert [path_texts(c) for c in marked] == [path_texts(c) for c in plain]
    assert path_texts(marked[1])[0] == ("user", "[image]\n\n서울에서 가볼 만한 곳을 알려 주세요.")


def test_a_utf16_mark_on_text_that_is_not_utf16_says_so():
    with pytest.raises(Unreadable, match="UTF-16 byte-order mark but is not UTF-16"):
        parse_import(codecs.BOM_UTF16_LE + b"[\x00\xd8")  # a lone surrogate


async def test_a_bom_file_imports_through_the_route(client):
    response = await client.post("/api/import", files={"file": (
        "conversations.json", codecs.BOM_UTF8 + fixture("librechat_openwebui_export.json"), "application/json")})

    assert response.status_code == 201, response.text
    assert len(response.json()["imported"]) == 3


def test_one_broken_conversation_among_good_ones_is_skipped_and_named():
    result = exchange.read_import(fixture("librechat_chatgpt_modern_export.json"))

    assert [c["title"] for c in result["conversations"]] == ["Deploying the staging cluster", "Weeknight pasta"]
    assert result["warnings"] == [{
        "code": "conversation_skipped", "index": 2, "title": "Corrupted entry",
        "message": "conversation 2 (“Corrupted entry”): it has no `mapping` of messages"}]
    # ChatGPT's custom instructions (a hidden "user system message") are the conversation's system prompt.
    assert result["conversations"][0]["system_prompt"] == "The user is an SRE.\n\nAnswer concisely."
    assert path_texts(result["conversations"][0])[-1] == ("assistant", "Restore from the last known-good chart.")


def test_a_file_whose_conversations_all_fail_is_unreadable_with_every_reason():
    raw = orjson.dumps([{"title": "A", "mapping": {"x": {"parent": "x", "message": None}}}, 7, {"title": "C"}])

    with pytest.raises(Unreadable) as caught:
        parse_import(raw)

    assert caught.value.reason == ("conversation 1 (“A”): its message tree has a cycle; conversation 2 is not an object; "
                                   "conversation 3 (“C”): it has no `mapping` of messages")
    assert [w["index"] for w in caught.value.skipped] == [1, 2, 3]


def test_a_conversation_of_system_and_tool_messages_only_is_not_imported_but_reported():
    result = exchange.read_import(fixture("chatgpt_reasoning_and_tools.json"))

    assert [c["title"] for c in result["conversations"]] == ["Two to the hundredth"]
    (warning,) = result["warnings"]
    assert (warning["code"], warning["index"], warning["title"]) == (
        "conversation_skipped", 2, "Only a system prompt and a tool")
    assert "no user or assistant message" in warning["message"]
    only = json.loads(fixture("chatgpt_reasoning_and_tools.json"))[1:]
    with pytest.raises(Unreadable, match="no user or assistant message"):
        parse_import(orjson.dumps(only))


def test_chatgpt_reasoning_and_tool_messages_become_the_replys_activity():
    (conv,) = parse_import(fixture("chatgpt_reasoning_and_tools.json"))

    assert path_texts(conv) == [("user", "What is 2**100 exactly?"),
                                ("assistant", "2**100 = **1267650600228229401496703205376**.")]
    reply = current_path(conv["nodes"], conv["current"])[-1]
    thought, call = reply["activity"]
    assert thought["kind"] == "thinking" and thought["text"] == (
        "Computing a large power\nThe user wants the exact value; I will run it in Python rather than guess.")
    assert thought["ended_at"] - thought["started_at"] == 4  # the recap's "Thought for 4s"
    assert {k: call[k] for k in ("kind", "name", "arguments", "status", "summary")} == {
        "kind": "tool", "name": "python", "arguments": {"code": "2**100"}, "status": "done",
        "summary": "1267650600228229401496703205376"}
    assert isinstance(call["at"], float) and isinstance(call["call_id"], str)


def test_open_webui_reasoning_and_tool_blocks_become_activity_not_html():
    reasoning, tool, simple = parse_import(fixture("librechat_openwebui_export.json"))

    answer = current_path(reasoning["nodes"], reasoning["current"])[-1]
    assert answer["content"] == "255" and answer["activity"] == [
        {"kind": "thinking", "text": "Let me break this down...", "started_at": 1700000007.0, "ended_at": 1700000010.0}]
    weather = current_path(tool["nodes"], tool["current"])[-1]
    assert weather["content"] == "The weather in Paris is 18C with rain."
    (step,) = weather["activity"]
    assert (step["kind"], step["status"], step["summary"]) == ("tool", "done", "Paris: 18C, rain")
    assert "activity" not in current_path(simple["nodes"], simple["current"])[-1]


def test_open_webui_tool_calls_with_their_attributes_keep_name_arguments_and_result():
    # Open WebUI 0.6 writes a call's name, arguments and result as escaped attributes.
    data = json.loads(fixture("librechat_openwebui_export.json"))
    data[1]["chat"]["history"]["messages"]["ta2"]["content"] = (
        '<details type="tool_calls" done="true" id="call_1" name="get_weather" '
        'arguments="{&quot;city&quot;: &quot;Paris&quot;}" result="&quot;Paris: 18C, rain&quot;" files="">\n'
        "<summary>Tool Executed</summary>\n</details>\n"
        "The weather in Paris is 18C with rain.\n\n<details><summary>Sources</summary>kept as written</details>")

    (_, tool, _) = parse_import(orjson.dumps(data))

    reply = current_path(tool["nodes"], tool["current"])[-1]
    assert reply["content"] == ("The weather in Paris is 18C with rain.\n\n"
                                "<details><summary>Sources</summary>kept as written</details>")
    assert [{k: s[k] for k in ("call_id", "name", "arguments", "summary")} for s in reply["activity"]] == [
        {"call_id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}, "summary": "Paris: 18C, rain"}]


def test_a_bare_open_webui_chat_object_and_a_list_of_them_are_read():
    rows = json.loads(fixture("librechat_openwebui_export.json"))
    chats = [row["chat"] for row in rows]  # the chat objects without the rows around them

    (one,) = parse_import(orjson.dumps(chats[0]))
    many = parse_import(orjson.dumps(chats))

    assert (one["title"], one["model"]) == ("Chat with reasoning", "deepseek-r1")
    assert path_texts(one) == [("user", "What is 15 * 17?"), ("assistant", "255")]
    assert [c["title"] for c in many] == ["Chat with reasoning", "Chat with tool call", "Simple linear chat"]


def test_open_webui_system_prompt_is_kept_and_roles_without_a_place_are_reported():
    chat = json.loads(fixture("librechat_openwebui_export.json"))[2]["chat"]
    chat["params"] = {"system": "Answer in French."}
    chat["history"]["messages"]["sa2"]["childrenIds"] = ["f1"]
    chat["history"]["messages"]["f1"] = {"id": "f1", "parentId": "sa2", "childrenIds": [], "role": "function",
                                         "content": "{}", "timestamp": 1700002006}

    (conv,) = parse_import(orjson.dumps(chat))

    assert conv["system_prompt"] == "Answer in French."
    (note,) = conv["notes"]
    assert note["code"] == "roles_skipped" and "1 “function”" in note["message"]
    assert path_texts(conv) == [("user", "Hello"), ("assistant", "Hi there!")]


async def test_reasoning_and_tools_are_stored_as_our_own_replies_keep_them(client, settings):
    settings.pii_masking = "on"
    data = json.loads(fixture("librechat_openwebui_export.json"))
    ra2 = data[0]["chat"]["history"]["messages"]["ra2"]
    ra2["content"] = ra2["content"].replace("Let me break this down...", "Mail hong@naver.com the steps.")

    response = await client.post("/api/import", files={"file": ("chats.json", orjson.dumps(data))})

    assert response.status_code == 201, response.text
    ids = response.json()["imported"]
    stored = (await client.get(f"/api/conversations/{ids[0]}")).json()
    (reply,) = [m for m in stored["messages"] if m["role"] == "assistant"]
    assert reply["content"] == "255"
    assert reply["activity"] == [{"kind": "thinking", "text": "Mail [email] the steps.",
                                  "started_at": 1700000007.0, "ended_at": 1700000010.0}]


async def test_a_chatgpt_zip_download_imports_its_conversations_and_counts_its_images(client):
    download = chatgpt_download(fixture("librechat_chatgpt_modern_export.json"))

    response = await client.post("/api/import", files={"file": ("chatgpt-export.zip", download, "application/zip")})

    assert response.status_code == 201, response.text
    body = response.json()
    assert len(body["imported"]) == 2
    codes = [(w["code"], w.get("count"), w.get("index")) for w in body["warnings"]]
    # No message of these conversations shows one of the images, so none is kept.
    assert codes[0] == ("conversation_skipped", None, 2) and codes[-1] == ("images_skipped", 3, None)
    assert "3 images" in body["warnings"][-1]["message"]
    assert {w["code"] for w in body["warnings"][1:-1]} == {"model_replaced"}
    stored = (await client.get(f"/api/conversations/{body['imported'][0]}")).json()
    assert stored["settings"]["system_prompt"] == "The user is an SRE.\n\nAnswer concisely."
    assert [m["content"] for m in stored["messages"] if m["role"] == "user"] == [
        "How do I roll back the deploy?", "And if that fails?"]


def test_conversations_json_is_found_in_a_folder_of_the_zip_and_may_carry_a_bom():
    raw = zipped({"export/conversations.json": codecs.BOM_UTF8 + fixture("chatgpt_conversations.json")})

    assert [c["title"] for c in parse_import(raw)] == ["Capitals", "서울 여행"]


def forged_size(archive: bytes, size: int) -> bytes:
    """The archive with its members' uncompressed sizes stated as `size` (local and central headers)."""
    data = bytearray(archive)
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = data.find(signature)
        while at != -1:
            struct.pack_into("<I", data, at + offset, size)
            at = data.find(signature, at + 4)
    return bytes(data)


def bomb() -> bytes:
    """2 MiB of JSON that compresses to a few kilobytes."""
    return zipped({"conversations.json": b"[" + b" " * (2 * 2**20) + b"]"})


@pytest.mark.parametrize("archive,reason", [
    (bomb, "conversations.json in the zip archive is over 1 MB unpacked"),
    (lambda: forged_size(bomb(), 100), "the zip archive cannot be read"),  # says 100 bytes, holds 2 MiB
], ids=["declared", "forged"])
async def test_a_zip_bomb_is_refused_with_a_clear_422_and_stores_nothing(client, monkeypatch, archive, reason):
    monkeypatch.setattr(exchange, "MAX_IMPORT_BYTES", 2**20)
    raw = archive()
    assert len(raw) < 64 * 1024

    response = await client.post("/api/import", files={"file": ("chatgpt-export.zip", raw, "application/zip")})

    assert response.status_code == 422 and reason in response.json()["detail"]
    assert (await client.get("/api/conversations")).json() == []


def test_a_zip_of_too_many_files_is_refused_before_they_are_listed(monkeypatch):
    monkeypatch.setattr(exchange, "MAX_ZIP_ENTRIES", 10)
    raw = zipped({"conversations.json": fixture("chatgpt_conversations.json"),
                  **{f"file-{i}.png": PNG for i in range(10)}})
    listed = []
    monkeypatch.setattr(zipfile.ZipFile, "infolist", lambda self: listed.append(1) or [])

    with pytest.raises(Unreadable, match="over 10 files"):
        parse_import(raw)
    assert listed == []


@pytest.mark.parametrize("raw,reason", [
    (lambda: zipped({"chat.html": b"<html></html>"}), "holds no conversations.json"),
    (lambda: chatgpt_download(b"[]")[:-30], "no central directory"),  # a download cut short
    (lambda: zipped({}), "the zip archive is empty"),
], ids=["no conversations.json", "truncated", "empty"])
def test_a_zip_that_cannot_be_read_says_why(raw, reason):
    with pytest.raises(Unreadable, match=reason):
        parse_import(raw())


async def test_a_replys_trail_survives_our_own_export_and_import(api, client, sim):
    conv = await api.new()
    await api.patch(conv["id"], settings={"tools": [], "web_search": True, "web_fetch": True})
    sim.enqueue(Script(steps=[
        steps.Reasoning("Need today's forecast.", chunk_size=50),
        steps.Search("seoul weather today", results=[{"url": "https://kma.go.kr/weather", "title": "KMA forecast"}]),
        steps.Fetch("https://kma.go.kr/weather", "KMA forecast"),
        steps.Text("Sunny, 21°C.")]))
    await api.send(conv["id"], "Weather in Seoul?")
    imported = await client.post("/api/import", files={"file": ("chats.json", fixture("librechat_openwebui_export.json"))})
    ids = [conv["id"], *imported.json()["imported"][:2]]

    for cid in ids:
        original = [m for m in (await api.get(cid))["messages"] if m["role"] == "assistant"][-1]
        exported = await client.get(f"/api/conversations/{cid}/export", params={"format": "json"})
        envelope = exported.json()
        envelope["conversations"][0]["nodes"][-1]["activity"] = [  # steps of shapes not ours are left out
            {"kind": "dance"}, {"kind": "search", "query": 5, "at": 1}, *original["activity"], "x"]
        (again,) = parse_import(orjson.dumps(envelope))

        reply = current_path(again["nodes"], again["current"])[-1]
        assert reply["content"] == original["content"] and reply["activity"] == original["activity"]
    assert [s["kind"] for s in original_steps(await api.get(ids[0]))] == ["thinking", "search", "fetch"]


def original_steps(conv: dict) -> list[dict]:
    return [m for m in conv["messages"] if m["role"] == "assistant"][-1]["activity"]


def raw_node(parent, role, content="", steps=None) -> dict:
    node = {"parent": parent, "role": role, "content": content, "created_at": "t", "model": None}
    if steps:
        node["steps"] = steps
    return node


def thought(text: str) -> dict:
    return {"kind": "thinking", "text": text, "started_at": 1.0, "ended_at": 2.0}


def test_steps_above_a_fork_go_to_every_reply_under_it_and_stop_at_a_question(monkeypatch):
    raw = {"q": raw_node(None, "user", "q"), "t": raw_node("q", None, steps=[thought("shared")]),
           "a1": raw_node("t", "assistant", "one", [thought("own")]), "a2": raw_node("t", "assistant", "two"),
           "q2": raw_node("a2", "user", "again"), "a3": raw_node("q2", "assistant", "three")}

    nodes, _ = exchange.build_tree(raw, {}, "a3")

    activity = {n["content"]: [s["text"] for s in n.get("activity", [])] for n in nodes}
    assert activity == {"q": [], "one": ["shared", "own"], "two": ["shared"], "again": [], "three": []}
    by_content = {n["content"]: n for n in nodes}
    assert by_content["one"]["activity"][0] is not by_content["two"]["activity"][0]  # copies, not one shared step
    # Steps above many forks are copied to each reply under them: a bounded number in all.
    monkeypatch.setattr(exchange, "MAX_NODES", 10)
    chain = {"q": raw_node(None, "user", "q"), "t1": raw_node("q", None, steps=[thought("1")]),
             "t2": raw_node("t1", None, steps=[thought("2")]), "t3": raw_node("t2", None, steps=[thought("3")]),
             **{f"a{i}": raw_node("t3", "assistant", str(i)) for i in range(4)}}
    with pytest.raises(Unreadable, match="over 10 activity steps"):
        exchange.build_tree(chain, {}, None)


def test_open_webui_think_tags_and_code_it_ran_become_steps_too():
    text, steps = exchange.open_webui_reply("<think>\nCount the letters.\n</think>\n\nThere are 3.", 100.0)
    assert text == "There are 3." and steps == [
        {"kind": "thinking", "text": "Count the letters.", "started_at": 100.0, "ended_at": 100.0}]

    text, steps = exchange.open_webui_reply(
        'Running it.\n<details type="code_interpreter" done="true" output="{&quot;stdout&quot;: &quot;6\\n&quot;}">\n'
        "<summary>Analyzed</summary>\n```python\nprint(2 * 3)\n```\n</details>\nIt prints 6. <detailsx>not a tag</detailsx>",
        100.0)
    assert text == "Running it.\nIt prints 6. <detailsx>not a tag</detailsx>"
    (step,) = steps
    assert (step["name"], step["arguments"], step["summary"]) == (
        "code_interpreter", {"code": "print(2 * 3)"}, '{"stdout":"6\\n"}')

"""Export and import (issue 17): Markdown and JSON of a real conversation, ChatGPT and Open WebUI
exports as trees, the round trip through our own format, and files that cannot be read."""

from __future__ import annotations

import json
import re
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

def chatgpt_with(mutate) -> bytes:
    data = json.loads(fixture("chatgpt_conversations.json"))
    mutate(data)
    return orjson.dumps(data)


def cycle(data):
    data[0]["mapping"]["client-created-root"]["parent"] = "a-2b"


def missing_parent(data):
    data[1]["mapping"]["k-2"]["parent"] = "nowhere"


def mapping_not_object(data):
    data[1]["mapping"] = ["not", "a", "mapping"]


UNREADABLE = [
    (b"not json at all", "not JSON"),
    (b'"a string"', "not a list of conversations"),
    (b"[]", "no conversations"),
    (b'[{"title": "x"}]', "not a ChatGPT, Open WebUI or chat-server export"),
    (b'{"format": "chat-server-export", "version": 99, "conversations": []}', "version 99"),
    (b'{"format": "chat-server-export", "version": 1, "conversations": [{"nodes": "x"}]}', "nodes: Input should be a valid list"),
    (chatgpt_with(cycle), "cycle"),
    (chatgpt_with(missing_parent), "not in the file"),
    (chatgpt_with(mapping_not_object), "no `mapping`"),
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
    monkeypatch.setattr(exchange, "MAX_NODES", 5)
    with pytest.raises(Unreadable, match="over 5 messages"):
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

async def test_the_import_route_stores_every_conversation_or_none(client):
    bad = chatgpt_with(cycle)

    refused = await client.post("/api/import", files={"file": ("conversations.json", bad, "application/json")})

    assert refused.status_code == 422 and "cycle" in refused.json()["detail"]
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

"""Search (issue 17): the FTS5 trigram index on its own, and `GET /api/search` over the real app and
store, including folded (archived) messages and sealed segments read back from disk."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from chatserver.app import create_app
from chatserver.config import Settings
from chatserver.conversations.document import new_id, now_iso
from chatserver.search import index as search_index
from chatserver.search.index import SearchIndex
from chatserver.store.files import SEAL_AFTER, FileStore
from gateway_sim.simulator import Script, Usage, steps


@pytest.fixture
async def index(tmp_path):
    ix = SearchIndex(tmp_path / "search.sqlite3")
    await ix.open()
    yield ix
    await ix.close()


def conversation(title: str, *texts: str, archive: tuple[str, ...] = ()) -> dict:
    def message(i: int, text: str) -> dict:
        return {"id": new_id(), "role": "user" if i % 2 == 0 else "assistant", "content": text,
                "created_at": now_iso()}
    return {"id": new_id(), "title": title, "updated_at": now_iso(),
            "messages": [message(i, t) for i, t in enumerate(texts)],
            "archive": [message(i, t) for i, t in enumerate(archive)]}


def hits(results: list[dict]) -> list[tuple[str, str | None]]:
    return [(r["conversation_id"], r["message_id"]) for r in results]


# --- the index on its own -----------------------------------------------------------------------

async def test_a_korean_word_is_found_in_korean_text_including_two_character_words(index):
    conv = conversation("여행 계획", "서울에서 맛집을 추천해 주세요.", "경복궁과 북촌 한옥마을을 추천합니다.")
    await index.index_conversation("alice", conv)
    question, answer = (m["id"] for m in conv["messages"])

    assert hits(await index.search("alice", "경복궁")) == [(conv["id"], answer)]  # trigram
    assert hits(await index.search("alice", "맛집")) == [(conv["id"], question)]  # two characters: the scan
    assert hits(await index.search("alice", "서울")) == [(conv["id"], question)]
    assert hits(await index.search("alice", "추천 서울")) == [(conv["id"], question)]  # both words, one message
    assert (await index.search("alice", "부산")) == []
    (title_hit,) = await index.search("alice", "계획")
    assert title_hit["message_id"] is None and title_hit["snippet"] == "여행 <mark>계획</mark>"


async def test_a_two_character_word_is_found_at_the_end_of_a_text_and_as_the_whole_text(index):
    conv = conversation("Cities", "가고 싶은 곳은 서울", "서울", "부산에 갑니다")
    await index.index_conversation("alice", conv)
    at_end, whole, _ = (m["id"] for m in conv["messages"])

    assert {r["message_id"] for r in await index.search("alice", "서울")} == {at_end, whole}
    assert hits(await index.search("alice", "곳")) == [(conv["id"], at_end)]  # one character: scanned


async def test_a_two_character_word_with_too_many_trigrams_is_scanned_for(index, monkeypatch):
    conv = conversation("Many", "서울에 서울로 서울은", "대구")
    await index.index_conversation("alice", conv)
    monkeypatch.setattr(search_index, "MAX_EXPANSION", 1)

    assert hits(await index.search("alice", "서울")) == [(conv["id"], conv["messages"][0]["id"])]


async def test_a_very_common_word_lists_the_newest_first(index, monkeypatch):
    conv = conversation("Frequency", "common word common word common twice", "filler", "common once among others")
    await index.index_conversation("alice", conv)
    denser, _, newer = (m["id"] for m in conv["messages"])
    assert [r["message_id"] for r in await index.search("alice", "common")] == [denser, newer]  # bm25
    monkeypatch.setattr(search_index, "RANK_AT_MOST", 0)

    assert [r["message_id"] for r in await index.search("alice", "common")] == [newer, denser]


async def test_the_snippet_marks_the_match_and_escapes_the_message_html(index):
    text = 'Before <script>alert("x")</script> & the needle in <b>bold</b> after'
    conv = conversation("Escapes", text)
    await index.index_conversation("alice", conv)

    (hit,) = await index.search("alice", "needle")

    assert hit["snippet"] == ("Before &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; the "
                              "<mark>needle</mark> in &lt;b&gt;bold&lt;/b&gt; after")
    (tag_hit,) = await index.search("alice", "<b>")
    assert "<mark>&lt;b&gt;</mark>" in tag_hit["snippet"] and "<b>" not in tag_hit["snippet"]


async def test_a_long_message_gives_a_window_around_the_match(index):
    text = "filler words " * 50 + "the NEEDLE is here " + "more filler " * 50
    await index.index_conversation("alice", conversation("Long", text))

    (hit,) = await index.search("alice", "needle")

    assert hit["snippet"].startswith("…") and hit["snippet"].endswith("…")
    assert "<mark>NEEDLE</mark>" in hit["snippet"] and len(hit["snippet"]) < 260


async def test_results_are_the_owners_only(index):
    mine, theirs = conversation("Mine", "the launch codes are blue"), conversation("Theirs", "launch codes red")
    await index.index_conversation("alice", mine)
    await index.index_conversation("bob", theirs)

    assert [r["conversation_id"] for r in await index.search("alice", "launch codes")] == [mine["id"]]
    assert [r["conversation_id"] for r in await index.search("bob", "launch")] == [theirs["id"]]
    assert [r["conversation_id"] for r in await index.search("bob", "co")] == [theirs["id"]]  # the short scan too
    assert await index.search("carol", "launch") == []


@pytest.mark.parametrize("query", ['"', '""', "*", "-", "NEAR", "NEAR(a b)", "(", ")", "a OR b", "text:x",
                                   "^start", "AND", "'", "{x}", "a + b", "col : val"])
async def test_fts_syntax_in_a_query_is_only_text(index, query):
    conv = conversation("Syntax", f"the literal {query} appears here")
    await index.index_conversation("alice", conv)

    results = await index.search("alice", query)

    assert hits(results) == [(conv["id"], conv["messages"][0]["id"])]


async def test_incremental_appends_titles_removals_and_rewinds(index):
    conv = conversation("First title", "an opening question")
    await index.index_conversation("alice", conv)
    added = {"id": new_id(), "role": "assistant", "content": "a brand new zebra answer", "created_at": now_iso()}
    notice = {"id": new_id(), "role": "notice", "content": "Folded zebra messages", "created_at": now_iso()}

    await index.index_messages("alice", conv["id"], "Renamed about giraffes", [added, notice])

    assert hits(await index.search("alice", "zebra")) == [(conv["id"], added["id"])]  # notices are not indexed
    assert hits(await index.search("alice", "giraffes")) == [(conv["id"], None)]
    assert (await index.search("alice", "First title")) == []
    # A rewind drops a message: indexing the whole conversation again forgets it.
    await index.index_conversation("alice", conv)
    assert (await index.search("alice", "zebra")) == []
    await index.remove_conversation("alice", conv["id"])
    assert (await index.search("alice", "opening")) == []


async def test_reconcile_indexes_what_changed_and_drops_what_is_gone(index):
    kept, gone = conversation("Kept", "alpha text"), conversation("Gone", "beta text")
    await index.rebuild([("alice", kept), ("alice", gone)])
    kept["messages"].append({"id": new_id(), "role": "user", "content": "gamma text", "created_at": now_iso()})
    kept["updated_at"] = "2099-01-01T00:00:00.000Z"

    changed = await index.reconcile([("alice", kept)])

    assert changed == 1
    assert [r["conversation_id"] for r in await index.search("alice", "gamma")] == [kept["id"]]
    assert (await index.search("alice", "beta")) == []
    assert await index.is_built()


async def test_writes_land_in_the_order_they_were_made_without_being_awaited(index):
    conv = conversation("Order", "first version of the text")
    index.index_conversation("alice", conv)
    conv["messages"][0] = {**conv["messages"][0], "content": "second version of the text"}
    last = index.index_conversation("alice", conv)

    await last

    assert (await index.search("alice", "first version")) == []
    assert len(await index.search("alice", "second version")) == 1


# --- through the app ----------------------------------------------------------------------------

KEEP = 3


@pytest.fixture
def settings(tmp_path, sim) -> Settings:
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                    upstream_timeout=5, keep_recent_messages=KEEP)


async def talk(api, sim, conv_id: str, questions: list[str]) -> None:
    for q in questions:
        sim.enqueue(Script(steps=[steps.Text(f"answer to {q}")], usage=Usage(prompt=1000, completion=40)))
        events = await api.send(conv_id, q)
        assert events[-1][0] == "done", events


async def test_search_finds_a_message_folded_by_compression(api, client, sim):
    conv = await api.new()
    cid = conv["id"]
    await api.patch(cid, settings={"web_search": False, "web_fetch": False})
    await talk(api, sim, cid, ["tell me about the aardvark", "and the pangolin", "and the okapi"])
    sim.enqueue(Script(steps=[steps.Text(json.dumps({"summary": "Animals.", "facts": []}))]))
    folded = (await client.post(f"/api/conversations/{cid}/compress", json={})).json()
    assert folded["folded"] == 2
    stored = await api.get(cid)
    folded_ids = {m["id"] for m in stored["archive"] if "aardvark" in m["content"]}
    assert len(folded_ids) == 2 and all("aardvark" not in m["content"] for m in stored["messages"])

    response = await client.get("/api/search", params={"q": "aardvark"})

    assert response.status_code == 200
    found = {r["message_id"]: r["snippet"] for r in response.json() if r["conversation_id"] == cid}
    assert found.keys() - {None} == folded_ids  # None: the title, which the first question named
    assert "tell me about the <mark>aardvark</mark>" in found.values()


async def test_search_finds_a_message_in_a_sealed_segment_after_a_restart(app, api, client, settings):
    conv = await api.new()
    cid = conv["id"]
    store = app.state.chat.store.for_owner("local")
    old = [{"id": new_id(), "role": "user" if i % 2 == 0 else "assistant",
            "content": "the marmalade recipe" if i == 4 else f"message number {i}", "created_at": now_iso()}
           for i in range(SEAL_AFTER + 10)]
    await store.update(cid, lambda c: c["messages"].extend(old))
    await app.state.chat.store.flush()
    on_disk = json.loads((settings.data_dir / "conversations" / f"{cid}.json").read_text())
    assert on_disk["earlier_messages"] and all(m["id"] != old[4]["id"] for m in on_disk["messages"])

    restarted = create_app(settings)
    async with restarted.router.lifespan_context(restarted):
        transport = httpx.ASGITransport(app=restarted)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as fresh:
            response = await fresh.get("/api/search", params={"q": "marmalade"})

    assert hits(response.json()) == [(cid, old[4]["id"])]


async def test_a_restart_indexes_what_was_saved_while_the_index_missed_it(app, api, client, settings):
    conv = await api.new()
    assert (await client.get("/api/search", params={"q": "wombat"})).json() == []  # the index is built
    added = {"id": new_id(), "role": "user", "content": "a wombat in the garden", "created_at": now_iso()}
    # Saved where this server's index never hears of it (as by a process that crashed before its index write).
    await app.state.chat.store.flush()
    elsewhere = FileStore(settings.data_dir)
    await elsewhere.for_owner("local").update(conv["id"], lambda c: c["messages"].append(added))
    await elsewhere.flush()

    restarted = create_app(settings)
    async with restarted.router.lifespan_context(restarted):
        transport = httpx.ASGITransport(app=restarted)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as fresh:
            response = await fresh.get("/api/search", params={"q": "wombat"})

    assert hits(response.json()) == [(conv["id"], added["id"])]


async def test_a_query_holding_control_characters_is_searched_as_words(client):
    response = await client.get("/api/search", params={"q": "a\x00b\x1fquote\"d"})

    assert response.status_code == 200 and response.json() == []


async def test_search_validates_its_query(client):
    assert (await client.get("/api/search", params={"q": ""})).status_code == 422
    assert (await client.get("/api/search", params={"q": "x" * 201})).status_code == 422
    assert (await client.get("/api/search", params={"q": "nothing"})).json() == []


async def test_the_index_follows_every_change_the_store_makes(app, api, client, sim):
    conv = await api.new()
    await talk(api, sim, conv["id"], ["what is a quokka"])
    stored = await api.get(conv["id"])

    found = (await client.get("/api/search", params={"q": "quokka"})).json()

    assert {r["message_id"] for r in found} == {m["id"] for m in stored["messages"]} | {None}  # and the title
    await client.patch(f"/api/conversations/{conv['id']}", json={"title": "Marsupials"})
    assert {r["title"] for r in (await client.get("/api/search", params={"q": "quokka"})).json()} == {"Marsupials"}
    await client.delete(f"/api/conversations/{conv['id']}")
    assert (await client.get("/api/search", params={"q": "quokka"})).json() == []


async def test_writes_queued_together_go_in_one_transaction_and_a_failed_one_alone_is_lost(index, monkeypatch):
    """Issue 30: a turn's saves no longer each wake the writer and commit on their own."""
    commits = 0
    transaction = SearchIndex._transaction

    def counted(self, batch):
        nonlocal commits
        commits += 1
        return transaction(self, batch)

    monkeypatch.setattr(SearchIndex, "_transaction", counted)
    convs = [conversation(f"talk {i}", f"needle{i} in a haystack") for i in range(50)]

    def broken(conn, *args):
        conn.execute("INSERT INTO convs (owner, conv_id, title, updated_at) VALUES ('me', 'half', 't', 'u')")
        raise ValueError("a write that breaks half way")

    writes = [index.index_conversation("me", c) for c in convs[:25]]
    writes.append(index._submit(broken))
    writes += [index.index_conversation("me", c) for c in convs[25:]]
    done = await asyncio.gather(*writes, return_exceptions=True)

    assert isinstance(done[25], ValueError) and all(d is None for i, d in enumerate(done) if i != 25)
    assert commits < 10  # 51 writes queued in one go: a few batches, not 51 transactions
    for i in (0, 24, 25, 49):
        assert hits(await index.search("me", f"needle{i}")) == [(convs[i]["id"], convs[i]["messages"][0]["id"])]
    assert "half" not in await index.stamps("me")  # the broken write's own change was rolled back

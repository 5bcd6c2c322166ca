"""Attachments in turns: the model searches them with a tool, the reply cites file and page, each
conversation's turn sees only its own files, the prompt lists them after the cache marker."""

from __future__ import annotations

import asyncio

import pytest

from chatserver.config import Settings
from gateway_sim.simulator import Script, steps
from support import names, parse_sse
from test_attachments import TOPICS, make_docx, make_pdf, upload


@pytest.fixture
def settings(tmp_path, sim) -> Settings:
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5,
                    default_tool_runtime="local", tool_rounds_max=1)


async def turn(client, conv_id: str, content: str, **extra) -> list[tuple[str, dict]]:
    response = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": content, **extra})
    assert response.status_code == 200, response.text
    return parse_sse(response.text)


async def test_the_answer_on_page_7_is_found_and_cited_and_the_citation_is_kept(api, client, sim):
    conv = await api.new()
    ids = []
    for name, data in (("report.pdf", make_pdf(TOPICS)),
                       ("notes.docx", make_docx([("Intro", "Nothing about machines."), ("Later", "Still nothing.")])),
                       ("tool.py", b"def centrifuge_speed():\n    return 4000\n")):
        response = await upload(client, conv["id"], name, data)
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
    pdf_id = ids[0]
    sim.enqueue(Script([steps.ToolCall("search_attachments", {"query": "warranty blue centrifuge"}, chunk_chars=6)]),
                Script([steps.Text("The warranty lasts fourteen months (report.pdf p. 7).")]))

    events = await turn(client, conv["id"], "How long is the centrifuge warranty?", attachment_ids=[pdf_id])

    assert names(events)[-1] == "done"
    first, second = sim.requests
    assert "search_attachments" in [t["function"]["name"] for t in first.body["tools"]]
    # The files are named after the cache marker, their text is not in the prompt.
    system = first.body["messages"][0]["content"]
    marker_at = max(i for i, p in enumerate(system) if "cache_control" in p)
    listing_at = next(i for i, p in enumerate(system) if "report.pdf (10 pages)" in p["text"])
    assert listing_at > marker_at and "tool.py" in system[listing_at]["text"]
    assert "fourteen months" not in str(first.body["messages"])
    result = next(m for m in second.body["messages"] if m["role"] == "tool")["content"]
    assert result.startswith("[1] report.pdf p. 7") and "fourteen months" in result
    citation = {"attachment_id": pdf_id, "name": "report.pdf", "page": 7, "label": "p. 7", "source": "conversation",
                "query": "warranty blue centrifuge"}
    assert citation in events[-1][1]["citations"]

    stored = await api.get(conv["id"])
    user, reply = stored["messages"]
    assert user["attachment_ids"] == [pdf_id]
    assert reply["citations"][0] == citation
    step = next(s for s in reply["activity"] if s["kind"] == "tool")
    assert step["name"] == "search_attachments" and "report.pdf" in step["summary"]


async def test_unknown_attachment_ids_are_422_and_nothing_is_sent(api, client, sim):
    conv = await api.new()
    other = await api.new()
    theirs = (await upload(client, other["id"], "theirs.txt", b"someone else's file")).json()["id"]
    for ids in (["nope-nope-nope"], [theirs]):
        response = await client.post(f"/api/conversations/{conv['id']}/messages",
                                     json={"content": "read it", "attachment_ids": ids})
        assert response.status_code == 422, response.text
    assert (await api.get(conv["id"]))["messages"] == [] and sim.requests == []


async def test_deleting_a_conversation_deletes_its_files(api, client, app, settings):
    conv = await api.new()
    assert (await upload(client, conv["id"], "a.txt", b"hello there")).status_code == 201
    folder = settings.data_dir / "attachments" / conv["id"]
    assert folder.is_dir()
    assert (await client.delete(f"/api/conversations/{conv['id']}")).status_code == 204
    assert not folder.exists()


async def test_two_conversations_at_once_each_search_only_their_own_file(api, client, sim):
    convs = [await api.new(), await api.new()]
    words = ["pelican", "walrus"]
    for conv, word in zip(convs, words):
        text = f"Field notes: the {word} was seen near the harbour at dawn.\n".encode() * 3
        assert (await upload(client, conv["id"], f"{word}.txt", text)).status_code == 201
    # Every request offering tools searches the same words; the answer round (tool_choice none) answers.
    sim.keep_calling(Script([steps.ToolCall("search_attachments", {"query": "pelican walrus harbour"}),
                             steps.Sleep(0.05)]),
                     Script([steps.Text("Answered.")]))

    results = await asyncio.gather(*(turn(client, c["id"], "what was seen?") for c in convs))

    for conv, word, other, events in zip(convs, words, reversed(words), results):
        assert names(events)[-1] == "done"
        reply = (await api.get(conv["id"]))["messages"][-1]
        seen = reply["rounds"][0]["results"][0]["content"]
        assert word in seen and other not in seen
        assert [c["name"] for c in reply["citations"]] == [f"{word}.txt"]


async def test_the_library_is_searched_only_where_enabled(api, client, sim):
    assert (await upload(client, "", "shelf.txt", b"The library copy mentions a narwhal.",
                         path="/api/library")).status_code == 201
    plain, with_library = await api.new(), await api.new()
    await api.patch(with_library["id"], settings={"library": True})
    assert (await upload(client, plain["id"], "own.txt", b"Only an otter here.")).status_code == 201
    sim.keep_calling(Script([steps.ToolCall("search_attachments", {"query": "narwhal otter"})]),
                     Script([steps.Text("Done.")]))

    await turn(client, plain["id"], "search")
    await turn(client, with_library["id"], "search")

    plain_seen = (await api.get(plain["id"]))["messages"][-1]["rounds"][0]["results"][0]["content"]
    library_seen = (await api.get(with_library["id"]))["messages"][-1]["rounds"][0]["results"][0]["content"]
    assert "otter" in plain_seen and "narwhal" not in plain_seen
    assert "narwhal" in library_seen and "(library)" in library_seen

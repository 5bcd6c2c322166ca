"""Behind a citation chip (issue 24): a file's passages exactly as the model was given them, with the
cited words marked, and a PDF page drawn to PNG in the limited child, cached by ids on this
server's disk, behind the same owner check as every attachment route."""

from __future__ import annotations

import asyncio
import io

import pytest
from PIL import Image

from chatserver.attachments import viewer
from chatserver.attachments.blobs import Blob, FileBlobs
from chatserver.attachments.store import (
    Attachments,
    attachment_context,
    conversation_scope,
    read_attachment,
    search_attachments,
)
from chatserver.config import Settings
from chatserver.turns.events import _cite
from test_attachments import TOPICS, make_docx, make_pdf, store, upload
from test_auth import A_PASSWORD, B_PASSWORD, FAST, Server, log_in


def cache_file(app, conv_id: str, attachment_id: str, page: int):
    return app.state.chat.settings.index_dir / "page-images" / conv_id / attachment_id / f"{page}-w1000.png"


async def test_a_pdf_page_is_drawn_once_then_served_from_the_cache(api, client, app):
    conv = await api.new()
    report = (await upload(client, conv["id"], "report.pdf", make_pdf(TOPICS))).json()
    images = store(app).page_images
    url = f"/api/conversations/{conv['id']}/attachments/{report['id']}/pages/7.png"

    first = await client.get(url)

    assert first.status_code == 200, first.text
    assert first.headers["content-type"] == "image/png"
    assert first.headers["x-content-type-options"] == "nosniff"
    assert first.headers["cache-control"].startswith("private")
    image = Image.open(io.BytesIO(first.content))
    assert image.format == "PNG" and image.width == 1000 and image.width * image.height <= viewer.PAGE_PIXELS
    assert image.convert("L").getextrema()[0] < 128, "the page's text is drawn (dark pixels)"
    assert images.renders == 1
    cached = cache_file(app, conv["id"], report["id"], 7)
    assert cached.read_bytes() == first.content and cached.stat().st_mode & 0o777 == 0o600

    second = await client.get(url)
    assert second.content == first.content and images.renders == 1, "a cached page starts no child"
    other = await client.get(url.replace("7.png", "8.png"))
    assert other.status_code == 200 and other.content != first.content and images.renders == 2

    # Deleting the file removes its images from this server's disk.
    assert (await client.delete(f"/api/conversations/{conv['id']}/attachments/{report['id']}")).status_code == 204
    assert not cached.parent.exists()
    assert (await client.get(url)).status_code == 404


async def test_pages_out_of_range_non_pdfs_and_unknown_ids_are_404(api, client, app):
    conv = await api.new()
    report = (await upload(client, conv["id"], "report.pdf", make_pdf(TOPICS))).json()
    notes = (await upload(client, conv["id"], "notes.txt", b"The ferry leaves at noon.")).json()
    base = f"/api/conversations/{conv['id']}/attachments"
    unknown = await client.get(f"{base}/nosuchattachment1/pages/1.png")
    assert unknown.status_code == 404
    for path in (f"{report['id']}/pages/0.png", f"{report['id']}/pages/11.png", f"{report['id']}/pages/x.png",
                 f"{report['id']}/pages/01.png", f"{report['id']}/pages/99999999.png", f"{notes['id']}/pages/1.png"):
        response = await client.get(f"{base}/{path}")
        assert response.status_code == 404, path
    assert (await client.get(f"/api/conversations/NoSuchConversation123/attachments/{report['id']}/pages/1.png"))\
        .status_code == 404
    assert (await client.get(f"/api/library/{report['id']}/pages/1.png")).status_code == 404, \
        "a conversation's file is not in the library"
    assert store(app).page_images.renders == 0, "nothing was drawn for a refused request"


async def test_passages_are_what_the_tools_gave_the_model_with_the_cited_words_marked(api, client, app):
    conv = await api.new()
    pages = [*TOPICS[:6], "x " * 700 + "The warranty on the blue centrifuge lasts fourteen months.", *TOPICS[7:]]
    report = (await upload(client, conv["id"], "report.pdf", make_pdf(pages))).json()
    with attachment_context(store(app), conv["id"], "local"):
        found = await search_attachments("centrifuge warranty")
        read = await read_attachment("report.pdf", 7, 7)
    citation = found.citations[0]
    assert citation == {"attachment_id": report["id"], "name": "report.pdf", "page": 7, "label": "p. 7",
                        "source": "conversation", "query": "centrifuge warranty"}
    assert read.citations[0]["source"] == "conversation" and "query" not in read.citations[0]
    base = f"/api/conversations/{conv['id']}/attachments/{report['id']}/passages"

    answer = (await client.get(base, params={"label": "p. 7", "q": citation["query"]})).json()

    assert (answer["attachment_id"], answer["name"], answer["media_type"], answer["pages"]) == \
        (report["id"], "report.pdf", "application/pdf", 10)
    shown = answer["passages"]
    assert [(p["page"], p["label"]) for p in shown] == [(7, "p. 7")] * len(shown) and len(shown) == 2
    # The same pieces the search hands the model, and together the page read_attachment hands it.
    assert found.passages[0]["text"] in [p["text"] for p in shown]
    assert " ".join(p["text"] for p in shown).split() == read.text.split("---\n", 1)[1].split()
    hit = next(p for p in shown if "centrifuge" in p["text"])
    assert [hit["text"][a:b] for a, b in hit["marks"]] == ["warranty", "centrifuge"]
    assert next(p for p in shown if p is not hit)["marks"] == []

    everything = (await client.get(base)).json()["passages"]
    assert {p["page"] for p in everything} == set(range(1, 11)) and all(p["marks"] is None for p in everything)
    by_page = (await client.get(base, params={"page": 3})).json()["passages"]
    assert [p["label"] for p in by_page] == ["p. 3"] and "cafeteria" in by_page[0]["text"]
    assert (await client.get(base, params={"label": "p. 99"})).json()["passages"] == []
    assert (await client.get(base.replace(report["id"], "nosuchattachment1"))).status_code == 404


async def test_a_docx_in_the_library_is_shown_by_its_section_label(client, app):
    notes = make_docx([("Introduction", "The project started in spring."),
                       ("Budget", "The budget for the pilot is 40,000 euros.")])
    stored = (await upload(client, "", "notes.docx", notes, "/api/library")).json()
    conv = (await client.post("/api/conversations", json={})).json()
    with attachment_context(store(app), conv["id"], "local", library=True):
        found = await search_attachments("pilot budget")
    assert found.citations[0]["label"] == "§ Budget" and found.citations[0]["source"] == "library"

    answer = (await client.get(f"/api/library/{stored['id']}/passages",
                               params={"label": "§ Budget", "q": "pilot budget"})).json()

    [passage] = answer["passages"]
    assert passage["label"] == "§ Budget" and "40,000 euros" in passage["text"]
    assert [passage["text"][a:b] for a, b in passage["marks"]] == ["Budget", "budget", "pilot"]
    assert (await client.get(f"/api/library/{stored['id']}/pages/1.png")).status_code == 404, "not a PDF"
    assert (await client.get(f"/api/conversations/{conv['id']}/attachments/{stored['id']}/passages")).status_code \
        == 404, "a library file is not one of the conversation's"


def test_marks_follow_the_search_tokens_in_any_script():
    text = "Ｗａｒｒａｎｔｙ lasts; the WARRANTY-card"
    assert [text[a:b] for a, b in viewer.marks(text, "warranty")] == ["Ｗａｒｒａｎｔｙ", "WARRANTY"]
    text = "감귤은 제주에서 자란다"
    assert [text[a:b] for a, b in viewer.marks(text, "제주 감귤")] == ["감귤", "제주"]
    assert viewer.marks("nothing here", "   ") == []


def test_one_chip_per_place_gathers_the_words_of_every_search_that_cited_it():
    citations: list[dict] = []
    place = {"attachment_id": "a" * 12, "name": "r.pdf", "page": 7, "label": "p. 7", "source": "conversation"}
    _cite(citations, {**place, "query": "warranty"})
    _cite(citations, {**place, "query": "centrifuge"})
    _cite(citations, {**place, "query": "warranty"})
    _cite(citations, place)
    _cite(citations, {**place, "page": 8, "label": "p. 8", "query": "picnic"})
    assert citations == [{**place, "query": "warranty centrifuge"}, {**place, "page": 8, "label": "p. 8",
                                                                     "query": "picnic"}]


@pytest.fixture
async def people(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="password")
    async with Server(settings) as srv:
        await srv.accounts.store.add_user("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
        await srv.accounts.store.add_user("bob", FAST.hash(B_PASSWORD), admin=False, now=0)
        async with srv.client(peer="192.0.2.1") as alice, srv.client(peer="192.0.2.2") as bob:
            assert (await log_in(alice, "alice", A_PASSWORD)).status_code == 204
            assert (await log_in(bob, "bob", B_PASSWORD)).status_code == 204
            yield srv, alice, bob


async def test_another_persons_pages_and_passages_answer_exactly_like_unknown_ones(people):
    srv, alice, bob = people
    conv = (await alice.post("/api/conversations", json={})).json()
    report = (await upload(alice, conv["id"], "report.pdf", make_pdf(TOPICS))).json()
    kept = (await upload(alice, "", "kept.pdf", make_pdf(TOPICS[:2]), "/api/library")).json()
    own = (await bob.post("/api/conversations", json={})).json()
    unknown_conv, unknown_id = "NoSuchConversation123", "nosuchattachment1"
    pairs = []
    for tail in ("pages/1.png", "passages", "passages?label=p.%201"):
        pairs += [
            (f"/api/conversations/{conv['id']}/attachments/{report['id']}/{tail}",
             f"/api/conversations/{unknown_conv}/attachments/{report['id']}/{tail}"),
            (f"/api/conversations/{own['id']}/attachments/{report['id']}/{tail}",
             f"/api/conversations/{own['id']}/attachments/{unknown_id}/{tail}"),
            (f"/api/library/{kept['id']}/{tail}", f"/api/library/{unknown_id}/{tail}"),
        ]
    for theirs, unknown in pairs:
        a, b = await bob.get(theirs), await bob.get(unknown)
        assert (a.status_code, a.text) == (b.status_code, b.text) and a.status_code == 404, theirs
    assert srv.app.state.chat.attachments.page_images.renders == 0
    assert (await alice.get(f"/api/library/{kept['id']}/pages/2.png")).status_code == 200


async def test_a_page_needing_more_than_the_limits_is_422_and_nothing_is_cached(api, client, app):
    """The child drawing a page lives under EXTRACT_MAX_MB and EXTRACT_TIMEOUT, as a file's reader does."""
    conv = await api.new()
    report = (await upload(client, conv["id"], "report.pdf", make_pdf(TOPICS))).json()
    extractor = store(app).extractor
    url = f"/api/conversations/{conv['id']}/attachments/{report['id']}/pages/1.png"

    extractor.max_mb = 30  # too little for pdfium to even start
    starved = await client.get(url)
    assert starved.status_code == 422 and "EXTRACT_MAX_MB" in starved.json()["detail"]
    extractor.max_mb, extractor.timeout = 512, 0.001
    slow = await client.get(url)
    assert slow.status_code == 422 and "EXTRACT_TIMEOUT" in slow.json()["detail"]
    assert not cache_file(app, conv["id"], report["id"], 1).exists()
    extractor.timeout = 30
    assert (await client.get(url)).status_code == 200


async def test_the_browser_asks_again_and_an_unchanged_page_is_a_304(api, client, app):
    conv = await api.new()
    report = (await upload(client, conv["id"], "report.pdf", make_pdf(TOPICS[:2]))).json()
    url = f"/api/conversations/{conv['id']}/attachments/{report['id']}/pages/2.png"
    first = await client.get(url)
    assert first.headers["cache-control"] == "private, no-cache" and first.headers["etag"]

    again = await client.get(url, headers={"if-none-match": first.headers["etag"]})

    assert again.status_code == 304 and again.content == b"" and store(app).page_images.renders == 1


class StreamedBlobs(FileBlobs):
    """Originals handed out as chunks with no local path, as S3 hands them."""

    async def open(self, scope_key: str, attachment_id: str) -> Blob:
        blob = await super().open(scope_key, attachment_id)
        return Blob(blob.size, blob.chunks, None)


async def test_an_original_from_a_remote_blob_store_is_spooled_for_the_child_then_removed(tmp_path):
    root = tmp_path / "attachments"
    attachments = Attachments(root, tmp_path / "index", blobs=StreamedBlobs(root))
    await attachments.start()
    scope = conversation_scope("conversation-1")
    upload_path = tmp_path / "report.pdf"
    upload_path.write_bytes(make_pdf(TOPICS[:3]))
    meta = await attachments.ingest(scope, "report.pdf", upload_path, "local")
    try:
        stored = await attachments.get(scope, meta["id"])
        path = await attachments.page_images.image(attachments, scope, stored, 3, "local")
        assert Image.open(path).width == 1000
        assert list(attachments.incoming.glob("render-*")) == [], "the spooled copy is gone"
    finally:
        await attachments.close()


async def test_the_same_page_asked_twice_at_once_is_drawn_once(api, client, app):
    conv = await api.new()
    report = (await upload(client, conv["id"], "report.pdf", make_pdf(TOPICS[:2]))).json()
    url = f"/api/conversations/{conv['id']}/attachments/{report['id']}/pages/1.png"

    first, second = await asyncio.gather(client.get(url), client.get(url))

    assert first.status_code == second.status_code == 200 and first.content == second.content
    assert store(app).page_images.renders == 1

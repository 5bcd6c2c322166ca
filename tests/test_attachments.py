"""Attachments through the real app: upload, refuse, store safely, download, and search in scope."""

from __future__ import annotations

import asyncio
import io
import os
import zipfile
from pathlib import Path
from urllib.parse import quote

import docx
import pytest
from fpdf import FPDF
from pypdf import PdfReader, PdfWriter

from chatserver.attachments import extraction
from chatserver.attachments import store as att
from chatserver.attachments.store import (
    Attachments,
    Limits,
    attachment_context,
    attachment_listing,
    read_attachment,
    search_attachments,
)
from chatserver.config import Settings
from chatserver.sizes import size_words
from support import serve

CJK_FONT = Path("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")
LIMIT = 300_000

# Ten pages on ten topics; the warranty answer is on page 7 only.
TOPICS = [
    "The quarterly revenue grew in every region, led by the northern sales offices.",
    "Hiring slowed in the second half while the engineering team finished the migration.",
    "The cafeteria menu now includes vegetarian options on Tuesdays and Thursdays.",
    "Parking permits are renewed each January through the facilities portal.",
    "The board approved a new travel policy that caps hotel rates in large cities.",
    "Security training is mandatory for every employee before the end of March.",
    "The warranty on the blue centrifuge lasts fourteen months from the delivery date.",
    "Customer satisfaction scores rose after the support line extended its hours.",
    "The annual picnic moves to the riverside park because of construction.",
    "Appendix: glossary of terms used in this report and a list of contributors.",
]


@pytest.fixture
def settings(tmp_path, sim) -> Settings:
    # A small JSON limit shows that uploads are bounded by their own limit, not by this one.
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                    upstream_timeout=5, max_attachment_bytes=LIMIT, max_request_bytes=20_000)


def make_pdf(pages: list[str]) -> bytes:
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    return bytes(pdf.output())


def make_cjk_pdf(pages: list[str]) -> bytes:
    pdf = FPDF()
    pdf.add_font("noto", fname=str(CJK_FONT), collection_font_number=1)  # 1: the KR face
    pdf.set_font("noto", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    return bytes(pdf.output())


def make_docx(sections: list[tuple[str, str]]) -> bytes:
    document = docx.Document()
    for heading, body in sections:
        document.add_heading(heading, level=1)
        document.add_paragraph(body)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def zip_bomb() -> bytes:
    """A small DOCX-shaped zip whose document inflates past DOCX_MAX_INFLATED (256 MiB)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        with z.open("word/document.xml", "w", force_zip64=True) as member:
            zeros = bytes(2**20)
            for _ in range(257):
                member.write(zeros)
    return out.getvalue()


def stored_files(data_dir: Path) -> list[Path]:
    root = data_dir / "attachments"
    # The passage index (and its -wal/-shm) is not a stored file.
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(att.INDEX_FILE)) \
        if root.exists() else []


def store(app) -> Attachments:
    return app.state.chat.attachments


async def upload(client, conv_id: str, name: str, data: bytes, path: str | None = None):
    url = path or f"/api/conversations/{conv_id}/attachments"
    return await client.post(url, files={"file": (name, data, "application/octet-stream")})


def raw_multipart(name_bytes: bytes, data: bytes) -> tuple[bytes, str]:
    """A multipart body written by hand, for file names httpx would percent-encode."""
    boundary = "testboundary7f3a"
    body = (f"--{boundary}\r\n".encode()
            + b'Content-Disposition: form-data; name="file"; filename="' + name_bytes + b'"\r\n'
            + b"Content-Type: text/html\r\n\r\n" + data + f"\r\n--{boundary}--\r\n".encode())
    return body, f"multipart/form-data; boundary={boundary}"


async def test_upload_pdf_docx_and_code_then_list_download_delete(api, client, app):
    conv = await api.new()
    pdf = make_pdf(TOPICS)
    response = await upload(client, conv["id"], "report.pdf", pdf)
    assert response.status_code == 201, response.text
    report = response.json()
    assert set(report) >= {"id", "name", "media_type", "bytes", "pages", "chars", "created_at"}
    assert (report["name"], report["media_type"], report["bytes"], report["pages"]) == \
        ("report.pdf", "application/pdf", len(pdf), 10)
    assert report["chars"] > 500

    notes = make_docx([("Introduction", "The project started in spring."),
                       ("Budget", "The budget for the pilot is 40,000 euros.")])
    response = await upload(client, conv["id"], "notes.docx", notes)
    assert response.status_code == 201, response.text
    assert response.json()["media_type"] == att.MEDIA_DOCX and response.json()["pages"] is None

    # Code that mentions the PDF magic is still code.
    code = (b'PDF_MAGIC = b"%PDF-"\n\ndef fibonacci(n):\n'
            b"    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    response = await upload(client, conv["id"], "fib.py", code)
    assert response.status_code == 201, response.text
    fib = response.json()
    assert (fib["media_type"], fib["pages"], fib["chars"]) == ("text/plain", None, len(code.decode()))

    listed = (await client.get(f"/api/conversations/{conv['id']}/attachments")).json()
    assert [a["name"] for a in listed] == ["report.pdf", "notes.docx", "fib.py"]

    download = await client.get(f"/api/conversations/{conv['id']}/attachments/{report['id']}")
    assert download.status_code == 200 and download.content == pdf
    assert download.headers["content-type"] == "application/pdf"
    assert download.headers["content-disposition"].startswith("attachment;")
    assert "nosniff" in download.headers["x-content-type-options"]

    response = await client.delete(f"/api/conversations/{conv['id']}/attachments/{fib['id']}")
    assert response.status_code == 204
    assert (await client.get(f"/api/conversations/{conv['id']}/attachments/{fib['id']}")).status_code == 404
    listed = (await client.get(f"/api/conversations/{conv['id']}/attachments")).json()
    assert [a["name"] for a in listed] == ["report.pdf", "notes.docx"]

    with attachment_context(store(app), conv["id"], "local"):
        found = await search_attachments("budget for the pilot")
        assert found.passages[0]["name"] == "notes.docx"
        assert "40,000 euros" in found.passages[0]["text"]
        listing = await attachment_listing(att.attachment_scope.get())
    assert "- report.pdf (10 pages)" in listing and "- notes.docx (2 sections)" in listing
    assert "centrifuge" not in listing  # names and page counts only, never the text


async def test_search_finds_the_answer_on_page_7_and_reads_it(api, client, app):
    conv = await api.new()
    response = await upload(client, conv["id"], "report.pdf", make_pdf(TOPICS))
    report = response.json()
    with attachment_context(store(app), conv["id"], "local"):
        result = await search_attachments("How long does the centrifuge warranty last?")
        read = await read_attachment("report.pdf", 7, 7)
    top = result.passages[0]
    assert (top["attachment_id"], top["name"], top["page"], top["source"]) == \
        (report["id"], "report.pdf", 7, "conversation")
    assert "fourteen months" in top["text"]
    assert result.citations[0] == {"attachment_id": report["id"], "name": "report.pdf", "page": 7, "label": "p. 7",
                                   "source": "conversation", "query": "How long does the centrifuge warranty last?"}
    assert "report.pdf p. 7" in result.text
    assert "fourteen months" in read.text and "cafeteria" not in read.text
    assert read.citations == [{"attachment_id": report["id"], "name": "report.pdf", "page": 7, "label": "p. 7",
                               "source": "conversation"}]


@pytest.mark.skipif(not CJK_FONT.exists(), reason="needs fonts-noto-cjk for a CJK PDF")
async def test_a_korean_question_ranks_the_korean_passage_first(api, client, app):
    pages = [
        "서울 지하철 2호선은 순환선으로 하루 평균 이용객이 가장 많습니다.",
        "김치찌개를 끓일 때는 잘 익은 김치와 돼지고기를 먼저 볶아야 맛이 깊어집니다.",
        "제주도의 감귤 수확은 매년 11월에 시작되어 이듬해 2월까지 이어집니다.",
        "한국의 반도체 수출은 작년에 전년 대비 크게 증가했습니다.",
        "東京の桜は三月下旬に満開になります。",
    ]
    conv = await api.new()
    response = await upload(client, conv["id"], "보고서.pdf", make_cjk_pdf(pages))
    assert response.status_code == 201, response.text
    assert response.json()["name"] == "보고서.pdf"
    with attachment_context(store(app), conv["id"], "local"):
        korean = await search_attachments("감귤은 언제 수확하나요?")
        japanese = await search_attachments("桜はいつ満開になりますか")
    assert korean.passages[0]["page"] == 3 and "감귤 수확" in korean.passages[0]["text"]
    assert japanese.passages[0]["page"] == 5


async def test_each_concurrent_scope_sees_only_its_own_files_and_the_library_where_enabled(api, client, app):
    first, second = await api.new(), await api.new()
    a = (await upload(client, first["id"], "a.txt", b"The launch code is alpha red.")).json()
    b = (await upload(client, second["id"], "b.txt", b"The launch code is bravo blue.")).json()
    response = await upload(client, "", "lib.md", b"# Library\nThe launch code is charlie.", "/api/library")
    assert response.status_code == 201, response.text
    lib = response.json()
    assert [x["id"] for x in (await client.get("/api/library")).json()] == [lib["id"]]
    both_inside = asyncio.Barrier(2)

    async def turn(conv_id: str, library: bool) -> set[tuple[str, str]]:
        with attachment_context(store(app), conv_id, "local", library=library):
            await both_inside.wait()  # both scopes are set before either searches
            result = await search_attachments("launch code")
            return {(p["attachment_id"], p["source"]) for p in result.passages}

    seen_first, seen_second = await asyncio.gather(turn(first["id"], False), turn(second["id"], True))
    assert seen_first == {(a["id"], "conversation")}
    assert seen_second == {(b["id"], "conversation"), (lib["id"], "library")}


async def test_tools_outside_a_turn_say_there_is_no_context():
    for result in (await search_attachments("anything"), await read_attachment("report.pdf")):
        assert result.text == att.NO_CONTEXT and result.passages == [] and result.citations == []
    assert await attachment_listing(att.attachment_scope.get()) == ""


async def test_a_turn_that_failed_mid_tool_leaves_no_scope_behind(api, client, app):
    first, second = await api.new(), await api.new()
    await upload(client, first["id"], "private.txt", b"The launch code is alpha red.")
    b = (await upload(client, second["id"], "b.txt", b"The launch code is bravo blue.")).json()
    # One task serving turns one after another, as a worker does: the first fails mid-tool.
    with pytest.raises(RuntimeError):
        with attachment_context(store(app), first["id"], "local"):
            assert (await search_attachments("launch code")).passages
            raise RuntimeError("the gateway dropped the connection mid-tool")
    assert att.attachment_scope.get() is None
    later = await asyncio.create_task(search_attachments("launch code"))
    assert later.text == att.NO_CONTEXT
    with attachment_context(store(app), second["id"], "local"):
        result = await search_attachments("launch code")
    assert [p["attachment_id"] for p in result.passages] == [b["id"]]


async def test_over_the_limit_is_413_with_and_without_content_length(api, client, settings):
    conv = await api.new()
    big = b"x" * (LIMIT + 1)
    response = await upload(client, conv["id"], "big.txt", big)
    assert response.status_code == 413
    assert response.json()["detail"] == (f"the file is larger than {size_words(LIMIT)}, the most one file may be here "
                                         "(the server's MAX_ATTACHMENT_BYTES setting, which whoever runs it can raise)")
    assert stored_files(settings.data_dir) == []

    body, content_type = raw_multipart(b"big.txt", big)

    async def chunked():
        for start in range(0, len(body), 16_384):
            yield body[start:start + 16_384]

    response = await client.post(f"/api/conversations/{conv['id']}/attachments", content=chunked(),
                                 headers={"content-type": content_type})
    assert "content-length" not in response.request.headers
    assert response.status_code == 413, response.text
    assert stored_files(settings.data_dir) == []

    # Bigger than MAX_REQUEST_BYTES (20,000) yet within MAX_ATTACHMENT_BYTES: accepted.
    response = await upload(client, conv["id"], "medium.txt", b"word " * 20_000)
    assert response.status_code == 201, response.text


async def test_unsupported_types_are_415_and_nothing_is_stored(api, client, settings):
    conv = await api.new()
    tiff = b"II*\x00" + bytes(200)  # an image, but not of a format this server takes
    for name, data in [("photo.tif", tiff), ("photo.txt", tiff), ("tool.exe", b"MZ" + bytes(100)),
                       ("archive.zip", b"PK\x05\x06" + bytes(18))]:
        response = await upload(client, conv["id"], name, data)
        assert response.status_code == 415, (name, response.text)
        assert "PDF, Word (.docx" in response.json()["detail"]
    assert stored_files(settings.data_dir) == []


async def test_encrypted_truncated_and_image_only_files_are_422_saying_which(api, client, settings):
    conv = await api.new()
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(make_pdf(TOPICS[:2]))))
    writer.encrypt(user_password="secret", owner_password="owner")
    encrypted = io.BytesIO()
    writer.write(encrypted)
    whole = make_docx([("Heading", "Some text in a document.")])
    image_only = FPDF()
    image_only.add_page()
    image_only.rect(20, 20, 100, 60, style="F")
    for name, data, says in [
        ("locked.pdf", encrypted.getvalue(), "encrypted"),
        ("cut.docx", whole[: len(whole) // 2], "truncated"),
        ("scan.pdf", bytes(image_only.output()), "no text layer"),
        ("latin1.txt", "caf\xe9".encode("latin-1"), "not UTF-8"),
        ("locked.docx", extraction.OLE_MAGIC + bytes(512), "encrypted"),
        ("bomb.docx", zip_bomb(), "inflates to more than"),
    ]:
        response = await upload(client, conv["id"], name, data)
        assert response.status_code == 422, (name, response.text)
        assert says in response.json()["detail"], (name, response.json())
    assert stored_files(settings.data_dir) == []


async def test_crafted_file_names_are_stored_as_text_and_never_as_paths(api, client, settings, tmp_path):
    conv = await api.new()
    url = f"/api/conversations/{conv['id']}/attachments"
    long_name = "a" * 296 + ".txt"
    cases = [
        (b"../../x.json", b'{"a": 1}', "../../x.json"),
        (b"<img src=x onerror=alert(1)>.pdf", make_pdf(["hello"]), "<img src=x onerror=alert(1)>.pdf"),
        (long_name.encode(), b"long", "a" * 251 + ".txt"),
        ("evil\x01\x1b[31m\x7fname\u202etxt.exe.txt".encode(), b"evil", "evil[31mnametxt.exe.txt"),
    ]
    for raw_name, data, expected in cases:
        body, content_type = raw_multipart(raw_name, data)
        response = await client.post(url, content=body, headers={"content-type": content_type})
        assert response.status_code == 201, (raw_name, response.text)
        stored = response.json()
        assert stored["name"] == expected and len(stored["name"]) <= 255

        download = await client.get(f"{url}/{stored['id']}")
        assert download.content == data
        disposition = download.headers["content-disposition"]
        assert disposition.startswith("attachment; filename=\"")
        assert disposition.endswith("filename*=UTF-8''" + quote(expected, safe=""))
        assert all(32 <= ord(c) < 127 for c in disposition) and "<" not in disposition
        assert "nosniff" in download.headers["x-content-type-options"]
        assert not download.headers["content-type"].startswith("text/html")

    assert not (tmp_path / "x.json").exists() and not (settings.data_dir / "x.json").exists()
    root = settings.data_dir / "attachments" / conv["id"]
    files = stored_files(settings.data_dir)
    assert len(files) == 3 * len(cases)
    assert all(f.parent.parent == root and f.name in {"meta.json", "pages.json", "original"} for f in files)


async def test_an_html_upload_downloads_as_plain_text(api, client):
    conv = await api.new()
    page = b"<p>Hello.</p><script>alert(document.cookie)</script>"
    stored = (await upload(client, conv["id"], "page.html", page)).json()
    download = await client.get(f"/api/conversations/{conv['id']}/attachments/{stored['id']}")
    assert download.headers["content-type"].startswith("text/plain")
    assert download.headers["content-disposition"].startswith("attachment;")


async def test_page_cap_and_time_limit(tmp_path):
    pdf = tmp_path / "in.pdf"
    capped = Attachments(tmp_path / "capped", tmp_path / "index", Limits(max_pages=3))
    pdf.write_bytes(make_pdf(TOPICS))
    meta = await capped.ingest(att.conversation_scope("conversation1"), "r.pdf", pdf, "local")
    assert (meta["pages"], meta["pages_read"]) == (10, 3)
    scope = att.AttachmentScope(capped, (att.conversation_scope("conversation1"),))
    token = att.attachment_scope.set(scope)
    try:
        assert (await search_attachments("centrifuge warranty")).passages == []
    finally:
        att.attachment_scope.reset(token)

    slow = Attachments(tmp_path / "slow", tmp_path / "index", Limits(timeout=0.001))
    pdf.write_bytes(make_pdf(TOPICS * 30))
    with pytest.raises(att.Unreadable, match="took longer"):
        await slow.ingest(att.conversation_scope("conversation1"), "r.pdf", pdf, "local")
    assert not pdf.exists() and stored_files(tmp_path / "slow") == []


async def test_deleting_a_scope_removes_its_files_and_search_forgets_them(api, client, app, settings):
    conv = await api.new()
    await upload(client, conv["id"], "a.txt", b"The launch code is alpha red.")
    with attachment_context(store(app), conv["id"], "local"):
        assert (await search_attachments("launch code")).passages
        await store(app).delete_scope(att.conversation_scope(conv["id"]))
        assert (await search_attachments("launch code")).text == "No files are attached to this conversation."
    assert stored_files(settings.data_dir) == []
    assert [n for n in os.listdir(settings.data_dir / "attachments") if not n.startswith(att.INDEX_FILE)] == [".incoming"]
    assert store(app).search_index.missing(att.conversation_scope(conv["id"]), ["x"]) == ["x"]


async def test_library_routes_and_docx_sections(client, app):
    notes = make_docx([("Introduction", "The project started in spring."),
                       ("Budget", "The budget for the pilot is 40,000 euros.")])
    stored = (await upload(client, "", "notes.docx", notes, "/api/library")).json()
    download = await client.get(f"/api/library/{stored['id']}")
    assert download.content == notes and download.headers["content-type"] == att.MEDIA_DOCX
    first = (await client.post("/api/conversations", json={})).json()
    with attachment_context(store(app), first["id"], "local", library=True):
        found = await search_attachments("pilot budget")
        read = await read_attachment("NOTES.DOCX", 2)
        listing = await attachment_listing(att.attachment_scope.get())
    assert found.passages[0]["source"] == "library" and "notes.docx §2 (Budget)" in found.text
    assert found.citations[0]["label"] == "§ Budget" and read.citations[0]["label"] == "§ Budget"
    assert "40,000 euros" in read.text and "spring" not in read.text
    assert "Files in the person's library:\n- notes.docx (2 sections)" in listing
    assert await store(app).check_ids(att.library_scope("local"), [stored["id"]]) == [stored["id"]]
    with pytest.raises(att.AttachmentNotFound):
        await store(app).check_ids(att.conversation_scope(first["id"]), [stored["id"]])
    assert (await client.delete(f"/api/library/{stored['id']}")).status_code == 204
    assert (await client.get("/api/library")).json() == []
    assert (await client.get(f"/api/library/{stored['id']}")).status_code == 404


async def test_unknown_conversations_and_bodies_that_are_not_multipart(client, settings):
    missing = await upload(client, "", "a.txt", b"text", "/api/conversations/unknownconversation/attachments")
    assert missing.status_code == 404
    conv = (await client.post("/api/conversations", json={})).json()
    url = f"/api/conversations/{conv['id']}/attachments"
    assert (await client.post(url, json={"file": "a.txt"})).status_code == 422
    body, content_type = raw_multipart(b"a.txt", b"text")
    cut = await client.post(url, content=body[:-30], headers={"content-type": content_type})
    assert cut.status_code == 422 and "no file" in cut.json()["detail"]
    assert stored_files(settings.data_dir) == []
    assert (await client.get(f"{url}/notanattachmentid")).status_code == 404
    # Only uploads skip the JSON body checks: a multipart body elsewhere is still malformed JSON.
    body, content_type = raw_multipart(b"a.txt", b"text")
    elsewhere = await client.post("/api/conversations", content=body, headers={"content-type": content_type})
    assert elsewhere.status_code == 422 and "malformed JSON" in elsewhere.json()["detail"]


def test_sweep_removes_old_leftovers_only(tmp_path):
    attachments = Attachments(tmp_path / "attachments", tmp_path / "index")
    _, fresh = attachments.incoming_file()
    _, old = attachments.incoming_file()
    staging = tmp_path / "attachments" / "conversation1" / ".staging-abcdefgh"
    staging.mkdir(parents=True)
    (staging / "original").write_bytes(b"x")
    # An original alone may have its metadata in Redis: kept. Text without metadata is a crash's: removed.
    original_only = tmp_path / "attachments" / "conversation1" / "attachment1"
    pages_only = tmp_path / "attachments" / "library" / "alice" / "attachment2"
    for folder, name in ((original_only, "original"), (pages_only, "pages.json")):
        folder.mkdir(parents=True)
        (folder / name).write_bytes(b"x")
    for path in (old, staging, original_only, pages_only):
        os.utime(path, (0, 0))
    attachments.sweep()
    assert fresh.exists() and not old.exists() and not staging.exists()
    assert original_only.exists() and not pages_only.exists()


async def test_files_and_library_share_one_quota_and_passing_it_is_413_naming_it(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        quota_file_bytes=1000)
    async with serve(settings) as (app, client):
        conv = (await client.post("/api/conversations", json={})).json()
        assert (await upload(client, conv["id"], "a.txt", b"a" * 600)).status_code == 201
        kept = (await upload(client, "", "b.txt", b"b" * 300, "/api/library")).json()
        assert (await client.get("/api/quota")).json() == {
            "file_bytes": 900, "file_quota": 1000, "conversations": 1, "conversation_quota": 10_000}
        other = (await client.post("/api/conversations", json={})).json()
        refused = await upload(client, other["id"], "c.txt", b"c" * 200)
        assert refused.status_code == 413
        assert refused.json()["detail"].startswith("QUOTA_FILE_BYTES: your files take 900 bytes of the 1000 bytes")
        assert len(stored_files(settings.data_dir)) == 6 and (await client.get("/api/library")).json() == [kept]
        assert (await client.delete(f"/api/library/{kept['id']}")).status_code == 204
        assert (await upload(client, other["id"], "c.txt", b"c" * 200)).status_code == 201


async def test_conversations_past_the_quota_are_413_naming_it_made_or_imported(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        quota_conversations=2)
    async with serve(settings) as (app, client):
        assert (await client.post("/api/conversations", json={})).status_code == 201
        # A file with messages: an empty conversation is not imported at all (issue 24).
        exported = (Path(__file__).parent / "fixtures" / "chatgpt_conversations.json").read_bytes()
        assert (await client.post("/api/conversations", json={})).status_code == 201
        refused = await client.post("/api/conversations", json={})
        assert refused.status_code == 413
        assert refused.json()["detail"].startswith("QUOTA_CONVERSATIONS: you have 2 of the 2 conversations")
        imported = await client.post("/api/import", files={"file": ("export.json", exported)})
        assert imported.status_code == 413 and "QUOTA_CONVERSATIONS" in imported.json()["detail"]
        assert len((await client.get("/api/conversations")).json()) == 2
        assert (await client.get("/api/quota")).json()["conversations"] == 2


async def test_files_stored_before_the_index_are_found_on_first_search(api, client, app):
    conv = await api.new()
    await upload(client, conv["id"], "old.txt", "감귤은 제주에서 자란다. The vault code is zebra nine.".encode())
    scope = att.conversation_scope(conv["id"])
    store(app).search_index.remove(scope)  # as if stored before the index existed
    with attachment_context(store(app), conv["id"], "local"):
        assert "zebra nine" in (await search_attachments("vault code")).passages[0]["text"]
        assert (await search_attachments("감귤")).passages

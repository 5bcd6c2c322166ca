"""Files built to exhaust a reader, replayed against a real server: each is a 422 saying what, the
server's memory stays where it was, and other people's uploads go on while one is being read."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import time
import zipfile
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from chatserver.accounts.auth import UserFile
from gateway_sim.simulator import Script, steps
from support import LiveServer
from test_attachments import make_docx, upload
from test_auth import A_PASSWORD, B_PASSWORD, FAST

W = b'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
CONTENT_TYPES = (
    '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
    '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
    '<Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-officedocument'
    '.wordprocessingml.document.main+xml"/></Types>')
RELS = ('<?xml version="1.0"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
        '<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/'
        'officeDocument" Target="word/document.xml"/></Relationships>')


def pdf_bomb(inflated_mib: int = 300, with_font: bool = False) -> bytes:
    """One page whose content stream inflates to `inflated_mib` MiB of line-drawing operators.

    `with_font`: the page's resources name a font, so a reader that skips a page without one
    (pypdf's text extraction) inflates the stream too.
    """
    operators = b"0 0 m 1 1 l S\n" * (2**20 // 14)
    packer = zlib.compressobj(9)
    stream = b"".join(packer.compress(operators) for _ in range(inflated_mib)) + packer.flush()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources %s >>"
        % (b"<< /Font << /F1 5 0 R >> >>" if with_font else b"<< >>"),
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(stream), stream),
        *([b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"] if with_font else []),
    ]
    return pdf_of(objects)


def pdf_of(objects: list[bytes]) -> bytes:
    """A PDF of these objects (object 1 the catalog), with a correct cross-reference table."""
    out = io.BytesIO(b"%PDF-1.4\n")
    out.seek(0, 2)
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (number, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.write(b"".join(b"%010d 00000 n \n" % offset for offset in offsets))
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def docx_of(paragraph: bytes, count: int) -> bytes:
    """A minimal DOCX whose body is `paragraph` repeated `count` times."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("[Content_Types].xml", CONTENT_TYPES)
        z.writestr("_rels/.rels", RELS)
        with z.open("word/document.xml", "w") as member:
            member.write(b'<?xml version="1.0"?><w:document %s><w:body>' % W)
            batch = 10_000
            for done in range(0, count, batch):
                member.write(paragraph * min(batch, count - done))
            member.write(b"</w:body></w:document>")
    return out.getvalue()


def empty_paragraphs_bomb() -> bytes:
    """Three million empty paragraphs: about 30 KB, a parse tree of gigabytes."""
    return docx_of(b"<w:p/>", 3_000_000)


XLSX_TYPES = (
    '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
    '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
    '<Default Extension="xml" ContentType="application/xml"/>'
    '<Override PartName="/xl/workbook.xml" ContentType="application/vnd.openxmlformats-officedocument'
    '.spreadsheetml.sheet.main+xml"/><Override PartName="/xl/worksheets/sheet1.xml" ContentType='
    '"application/vnd.openxmlformats-officedocument.spreadsheetml.worksheet+xml"/></Types>')
XLSX_RELS = RELS.replace("word/document.xml", "xl/workbook.xml")
WORKBOOK = ('<?xml version="1.0"?><workbook xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" '
            'xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"><sheets>'
            '<sheet name="Data" sheetId="1" r:id="rId1"/></sheets></workbook>')
WORKBOOK_RELS = ('<?xml version="1.0"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/'
                 'relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/'
                 '2006/relationships/worksheet" Target="worksheets/sheet1.xml"/></Relationships>')


def xlsx_of(rows: int, cells: int = 10) -> bytes:
    """A one-sheet XLSX of `rows` rows of `cells` numbers each."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("[Content_Types].xml", XLSX_TYPES)
        z.writestr("_rels/.rels", XLSX_RELS)
        z.writestr("xl/workbook.xml", WORKBOOK)
        z.writestr("xl/_rels/workbook.xml.rels", WORKBOOK_RELS)
        row = b"<row>" + b"".join(b"<c><v>%d</v></c>" % n for n in range(cells)) + b"</row>"
        with z.open("xl/worksheets/sheet1.xml", "w") as member:
            member.write(b'<?xml version="1.0"?><worksheet xmlns="http://schemas.openxmlformats.org/'
                         b'spreadsheetml/2006/main"><sheetData>')
            for _ in range(rows):
                member.write(row)
            member.write(b"</sheetData></worksheet>")
    return out.getvalue()


def slow_xlsx() -> bytes:
    """Three million cells in 200 KB: openpyxl reads about 130,000 a second here, so over 20 s.

    (The slow file used to be a DOCX of 200,000 paragraphs, minutes for python-docx; the DOCX reader
    of issue 24 walks the XML with lxml and reads it in about a second.)"""
    return xlsx_of(300_000)


def long_real_docx() -> bytes:
    """A genuine document with a 5 MB document.xml (12,000 paragraphs of prose)."""
    text = ("The committee reviewed the budget line by line and agreed on the figures. " * 5).encode()
    return docx_of(b"<w:p><w:r><w:t>%s</w:t></w:r></w:p>" % text, 12_000)


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (the peak since the process started) of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def readers_of(pid: int) -> list[int]:
    """The file-reading child processes the server has running now."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    readers = []
    for child in children:
        try:
            if b"extraction.py" in Path(f"/proc/{child}/cmdline").read_bytes():
                readers.append(child)
        except FileNotFoundError:
            continue
    return readers


async def until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the awaited state never came"
        await asyncio.sleep(0.02)


@pytest.fixture
def server(tmp_path, sim):
    users = UserFile(tmp_path / "data")
    users.add("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
    users.add("bob", FAST.hash(B_PASSWORD), admin=False, now=0)
    live = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "AUTH": "password",
                                          "EXTRACT_MAX_MB": "384", "EXTRACT_TIMEOUT": "8"})
    yield live
    live.stop()


@contextlib.asynccontextmanager
async def person(server: LiveServer, name: str, password: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client logged in as `name` on the live server."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        answer = await client.post("/api/auth/login", json={"username": name, "password": password})
        assert answer.status_code == 204, answer.text
        yield client


async def test_pdf_and_docx_bombs_are_422_and_the_server_stays_small(server):
    async with person(server, "alice", A_PASSWORD) as alice:
        conv = (await alice.post("/api/conversations", json={})).json()
        await upload(alice, conv["id"], "warmup.txt", b"hello")
        before = memory_kb(server.process.pid)
        for name, data, says in [
            ("inflates.pdf", pdf_bomb(), "needed more than the 384 MB"),
            ("empty.docx", empty_paragraphs_bomb(), "needed more than the 384 MB"),
            ("slow.xlsx", slow_xlsx(), "took longer than 8 s"),
        ]:
            answer = await upload(alice, conv["id"], name, data)
            assert answer.status_code == 422, (name, answer.text)
            assert says in answer.json()["detail"], (name, answer.json())
            grown = (memory_kb(server.process.pid)["VmHWM"] - before["VmRSS"]) // 1024
            assert grown < 64, f"{name} took the server's peak {grown} MB above where it was"
        real = await upload(alice, conv["id"], "minutes.docx", long_real_docx())
        assert real.status_code == 201, real.text
        assert real.json()["chars"] > 4_000_000
        after = memory_kb(server.process.pid)
        assert (after["VmRSS"] - before["VmRSS"]) // 1024 < 64, (before, after)
        assert readers_of(server.process.pid) == []
        assert [a["name"] for a in (await alice.get(f"/api/conversations/{conv['id']}/attachments")).json()] \
            == ["warmup.txt", "minutes.docx"]


async def test_another_persons_small_upload_goes_on_while_bombs_are_read(server):
    async with person(server, "alice", A_PASSWORD) as alice, person(server, "bob", B_PASSWORD) as bob:
        alice_conv = (await alice.post("/api/conversations", json={})).json()
        bob_conv = (await bob.post("/api/conversations", json={})).json()
        bombs = [asyncio.create_task(upload(alice, alice_conv["id"], f"slow{n}.xlsx", slow_xlsx()))
                 for n in range(2)]
        await until(lambda: readers_of(server.process.pid))
        started = time.monotonic()
        small = await asyncio.wait_for(upload(bob, bob_conv["id"], "note.txt", b"hello"), 10)
        assert small.status_code == 201, small.text
        assert time.monotonic() - started < 5
        # Alice's second file waits for her first: one reader of hers at a time.
        assert len(readers_of(server.process.pid)) == 1 and not any(b.done() for b in bombs)
        answers = await asyncio.wait_for(asyncio.gather(*bombs), 40)
        assert [a.status_code for a in answers] == [422, 422]
        assert all("took longer than 8 s" in a.json()["detail"] for a in answers)
        assert readers_of(server.process.pid) == []


async def test_a_reader_is_killed_when_its_upload_is_abandoned(server):
    async with person(server, "alice", A_PASSWORD) as alice:
        conv = (await alice.post("/api/conversations", json={})).json()
        pending = asyncio.create_task(upload(alice, conv["id"], "slow.xlsx", slow_xlsx()))
        await until(lambda: readers_of(server.process.pid))
        pending.cancel()
        await until(lambda: not readers_of(server.process.pid), 4)  # EXTRACT_TIMEOUT is 8
        assert (await alice.get(f"/api/conversations/{conv['id']}/attachments")).json() == []


async def test_a_full_queue_is_429_and_frees_as_reads_end(tmp_path, sim):
    from chatserver.config import Settings
    from support import serve

    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        extract_workers=1, extract_queue=1, extract_timeout=30)
    async with serve(settings) as (app, client):
        extractor = app.state.chat.attachments.extractor
        conv = (await client.post("/api/conversations", json={})).json()
        first = asyncio.create_task(upload(client, conv["id"], "a.xlsx", slow_xlsx()))
        await until(lambda: extractor.running == 1)
        second = asyncio.create_task(upload(client, conv["id"], "b.txt", b"queued"))
        await until(lambda: extractor.waiting == 1)
        refused = await upload(client, conv["id"], "c.txt", b"one too many")
        assert refused.status_code == 429
        assert "1 files are already waiting to be read" in refused.json()["detail"]
        first.cancel()
        assert (await asyncio.wait_for(second, 20)).status_code == 201
        assert (extractor.running, extractor.waiting) == (0, 0)
        assert (await upload(client, conv["id"], "c.txt", b"room again")).status_code == 201


async def test_a_docm_is_read_and_a_damaged_package_names_no_server_path(api, client, settings):
    """A macro-enabled .docm was refused as "not a Word document" before issue 24: its text is read
    like a .docx's now (its macros never run: only the XML parts are parsed). A damaged package's
    refusal names neither the server's paths nor its upload file."""
    package = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(make_docx([("Macros", "Sub AutoOpen()")]))) as source, \
            zipfile.ZipFile(package, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename == "[Content_Types].xml":
                data = data.replace(b"wordprocessingml.document.main+xml", b"ms-word.document.macroEnabled.main+xml")
            target.writestr(item, data)
    conv = await api.new()
    answer = await upload(client, conv["id"], "report.docm", package.getvalue())
    assert answer.status_code == 201, answer.text
    assert answer.json()["chars"] >= len("Macros\nSub AutoOpen()")
    broken = package.getvalue()[: len(package.getvalue()) // 3]
    for name in ("report.docm", "sheet.xlsx", "deck.pptx"):
        refused = await upload(client, conv["id"], name, broken)
        detail = refused.json()["detail"]
        assert refused.status_code == 422 and "damaged" in detail, (name, detail)
        for leak in (str(settings.data_dir), ".incoming", "upload-", ".part", os.sep + "tmp"):
            assert leak not in detail


def library_text(seed: int, size: int) -> bytes:
    """`size` bytes of prose-like lines over a vocabulary of 50,000 made-up words, as a large
    real library has: many distinct terms, so an index that keeps its postings in memory grows."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(4, 10))) for _ in range(50_000)]
    lines, total = [], 0
    while total < size:
        line = " ".join(rng.choices(vocabulary, k=12)) + ".\n"
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()


async def test_a_large_library_is_searched_without_the_server_holding_it(server, sim):
    """40 MiB of library text (item 8: 160 MiB took the server to 3.5 GB), then a search that must
    find one planted passage: the server's peak grows by far less than the library's size."""
    async with person(server, "alice", A_PASSWORD) as alice:
        conv = (await alice.post("/api/conversations", json={})).json()
        assert (await alice.patch(f"/api/conversations/{conv['id']}",
                                  json={"settings": {"library": True}})).status_code == 200
        start = memory_kb(server.process.pid)
        planted = b"\nThe harbour pilot's call sign is zephyrquokka seven.\n"
        for n in range(12):
            body = library_text(n, 3_500_000) + (planted if n == 7 else b"")
            stored = await upload(alice, "", f"volume{n}.txt", body, "/api/library")
            assert stored.status_code == 201, stored.text
        before = memory_kb(server.process.pid)
        sim.enqueue(Script([steps.ToolCall("search_attachments", {"query": "zephyrquokka call sign"})]),
                    Script([steps.Text("Found it.")]))
        answer = await alice.post(f"/api/conversations/{conv['id']}/messages", json={"content": "search"},
                                  timeout=120)
        assert answer.status_code == 200 and "event: done" in answer.text, answer.text[-500:]
        reply = (await alice.get(f"/api/conversations/{conv['id']}")).json()["messages"][-1]
        seen = reply["rounds"][0]["results"][0]["content"]
        assert "zephyrquokka seven" in seen and "volume7.txt" in seen, seen[:500]
        grown = (memory_kb(server.process.pid)["VmHWM"] - before["VmRSS"]) // 1024
        assert grown < 100, f"searching a 40 MiB library took the server's peak {grown} MB up"
        kept = (memory_kb(server.process.pid)["VmRSS"] - start["VmRSS"]) // 1024
        assert kept < 100, f"the server holds {kept} MB more after storing and searching the library"

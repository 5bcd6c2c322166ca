"""Attachments shared by several servers (issue 23): two real servers with different DATA_DIRs on one
Redis (metadata, pages) and one S3 (SeaweedFS, the originals). A file uploaded on one is listed,
downloaded and searched on the other; deleted on one, it is gone on both and from the bucket; a
server with an empty DATA_DIR still serves it; a migration carries attachments both ways byte for
byte; removing a person removes their objects."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis as sync_redis

from chatserver.accounts.cli import remove_data
from chatserver.app import make_blobs
from chatserver.attachments.blobs import PART_BYTES
from chatserver.config import Settings
from gateway_sim.simulator import Script, steps
from redis_support import unique_prefix
from s3_support import SeaweedServer, new_bucket, object_keys
from support import ROOT, LiveServer, parse_sse, serve
from test_attachments import TOPICS, make_pdf, upload

FIXTURE = ROOT / "tests" / "fixtures" / "open_webui_export.json"
HEADERS = ("content-type", "content-length", "content-disposition", "x-content-type-options",
           "content-security-policy", "cache-control")
_databases = itertools.count(1)


def server_env(sim, redis_server, s3_server: SeaweedServer, bucket: str, database: int) -> dict[str, str]:
    return {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis",
            "REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/{database}",
            "DEFAULT_TOOL_RUNTIME": "local", "TOOL_ROUNDS_MAX": "1", **s3_server.env(bucket)}


@pytest.fixture
def shared(tmp_path, sim, redis_server, s3_server):
    """Two servers, A and B, each with a DATA_DIR of its own, on one Redis database and one bucket."""
    bucket = new_bucket()
    env = server_env(sim, redis_server, s3_server, bucket, next(_databases) % 16)
    servers: list[LiveServer] = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            servers.append(LiveServer(tmp_path / name / "data", env))
        yield servers[0], servers[1], bucket, env
    finally:
        for server in servers:
            server.stop()


def upload_to(server: LiveServer, url_path: str, name: str, data: bytes) -> dict:
    answer = httpx.post(f"{server.base_url}{url_path}", files={"file": (name, data, "application/octet-stream")},
                        timeout=30)
    assert answer.status_code == 201, answer.text
    return answer.json()


def new_conversation(server: LiveServer) -> dict:
    answer = httpx.post(f"{server.base_url}/api/conversations", json={}, timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()


async def test_a_file_uploaded_on_a_is_listed_downloaded_and_searched_on_b(shared, sim, s3_server):
    a, b, bucket, _ = shared
    data = FIXTURE.read_bytes()
    conv = new_conversation(a)
    stored = upload_to(a, f"/api/conversations/{conv['id']}/attachments", "open_webui_export.json", data)

    # Nothing of it on either server's disk: the original is in the bucket, by ids only.
    assert await object_keys(s3_server, bucket) == [f"attachments/{conv['id']}/{stored['id']}"]
    for server in (a, b):
        on_disk = [p for p in (server.data_dir / "attachments").rglob("*") if p.is_file()] \
            if (server.data_dir / "attachments").exists() else []
        assert on_disk == []

    listed = httpx.get(f"{b.base_url}/api/conversations/{conv['id']}/attachments").json()
    assert listed == [stored]
    url = f"/api/conversations/{conv['id']}/attachments/{stored['id']}"
    from_a, from_b = httpx.get(f"{a.base_url}{url}"), httpx.get(f"{b.base_url}{url}")
    assert from_b.status_code == 200 and from_b.content == data == from_a.content
    assert {h: from_b.headers.get(h) for h in HEADERS} == {h: from_a.headers.get(h) for h in HEADERS}
    assert from_b.headers["content-length"] == str(len(data))
    assert from_b.headers["content-type"] == "application/json"
    assert from_b.headers["content-disposition"].startswith('attachment; filename="open_webui_export.json"')
    assert from_b.headers["x-content-type-options"] == "nosniff"

    # Asked on B, the model's search finds the file's text (B's own index, filled from Redis's pages).
    sim.enqueue(Script([steps.ToolCall("search_attachments", {"query": "crimson maple leaves"})]),
                Script([steps.Text("It mentions crimson maple leaves (open_webui_export.json).")]))
    answer = httpx.post(f"{b.base_url}/api/conversations/{conv['id']}/messages",
                        json={"content": "What does the export say about leaves?", "attachment_ids": [stored["id"]]},
                        timeout=30)
    assert answer.status_code == 200, answer.text
    events = parse_sse(answer.text)
    assert events[-1][0] == "done", events[-1]
    result = next(m for m in sim.requests[-1].body["messages"] if m["role"] == "tool")["content"]
    assert result.startswith("[1] open_webui_export.json") and "Crimson maple leaves" in result
    # B's prompt names the file (read from Redis, never B's disk).
    assert any("open_webui_export.json" in p["text"] for p in sim.requests[0].body["messages"][0]["content"])


async def test_deleting_on_b_removes_the_files_everywhere(shared, s3_server):
    a, b, bucket, _ = shared
    conv = new_conversation(a)
    in_conv = upload_to(a, f"/api/conversations/{conv['id']}/attachments", "notes.txt", b"The vault code is zebra nine.")
    kept = new_conversation(a)
    other = upload_to(a, f"/api/conversations/{kept['id']}/attachments", "other.txt", b"Kept elsewhere.")
    shelf = upload_to(a, "/api/library", "shelf.txt", b"A library copy.")
    assert len(await object_keys(s3_server, bucket)) == 3

    assert httpx.delete(f"{b.base_url}/api/conversations/{conv['id']}").status_code == 204
    assert httpx.get(f"{a.base_url}/api/conversations/{conv['id']}/attachments").status_code == 404
    assert httpx.get(f"{a.base_url}/api/conversations/{conv['id']}/attachments/{in_conv['id']}").status_code == 404
    assert await object_keys(s3_server, bucket, f"attachments/{conv['id']}/") == []

    assert httpx.delete(f"{b.base_url}/api/library/{shelf['id']}").status_code == 204
    assert httpx.get(f"{a.base_url}/api/library").json() == []
    assert httpx.get(f"{a.base_url}/api/library/{shelf['id']}").status_code == 404
    # What was not deleted is still there, on both.
    assert await object_keys(s3_server, bucket) == [f"attachments/{kept['id']}/{other['id']}"]
    assert httpx.get(f"{a.base_url}/api/conversations/{kept['id']}/attachments").json() == [other]


async def test_a_file_deleted_on_b_is_never_found_by_a_search_on_a(shared, sim):
    a, b, _, _ = shared
    conv = new_conversation(a)
    url = f"/api/conversations/{conv['id']}/attachments"
    kept = upload_to(a, url, "kept.txt", b"The harbour log mentions a pelican at dawn.")
    gone = upload_to(a, url, "gone.txt", b"The harbour log mentions a walrus at dusk.")
    sim.keep_calling(Script([steps.ToolCall("search_attachments", {"query": "harbour log pelican walrus"})]),
                     Script([steps.Text("Answered.")]))

    def seen_on_a() -> str:
        answer = httpx.post(f"{a.base_url}/api/conversations/{conv['id']}/messages", json={"content": "what is logged?"},
                            timeout=30)
        assert answer.status_code == 200 and parse_sse(answer.text)[-1][0] == "done", answer.text
        reply = httpx.get(f"{a.base_url}/api/conversations/{conv['id']}").json()["messages"][-1]
        return reply["rounds"][0]["results"][0]["content"]

    first = seen_on_a()  # A's index now holds both files' passages
    assert "pelican" in first and "walrus" in first
    assert httpx.delete(f"{b.base_url}{url}/{gone['id']}").status_code == 204
    second = seen_on_a()  # A's index still has the rows; the store no longer lists the file
    assert "pelican" in second and "walrus" not in second and "gone.txt" not in second
    assert [m["id"] for m in httpx.get(f"{a.base_url}{url}").json()] == [kept["id"]]


def pdf_of(size: int) -> bytes:
    """A one-page PDF with a line of text and about `size` bytes of random pixels (no compression helps)."""
    from fpdf import FPDF
    from PIL import Image

    side = int((size / 3) ** 0.5)
    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("helvetica", size=12)
    pdf.multi_cell(0, 8, "The shipment manifest for the blue centrifuge.")
    pdf.image(Image.frombytes("RGB", (side, side), os.urandom(side * side * 3)), x=10, y=30, w=100)
    return bytes(pdf.output())


async def test_a_server_restarted_with_an_empty_data_dir_still_serves_the_file(shared, tmp_path):
    a, b, bucket, env = shared
    data = pdf_of(3 * PART_BYTES // 2)  # past one part: sent to S3 as a multipart upload
    assert len(data) > PART_BYTES
    conv = new_conversation(a)
    stored = upload_to(a, f"/api/conversations/{conv['id']}/attachments", "report.pdf", data)
    a.stop()
    (tmp_path / "a2").mkdir()
    fresh = LiveServer(tmp_path / "a2" / "data", env)
    try:
        assert httpx.get(f"{fresh.base_url}/api/conversations/{conv['id']}/attachments").json() == [stored]
        download = httpx.get(f"{fresh.base_url}/api/conversations/{conv['id']}/attachments/{stored['id']}")
        assert download.status_code == 200 and download.content == data
        assert download.headers["content-type"] == "application/pdf"
    finally:
        fresh.stop()


def run_migrate(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "server.py", "migrate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


def attachment_files(data_dir: Path) -> dict[str, bytes]:
    """Every stored attachment file (meta.json, pages.json, original) by its path under attachments/."""
    root = data_dir / "attachments"
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and p.name in ("meta.json", "pages.json", "original")}


async def test_migration_files_to_redis_and_s3_and_back_keeps_every_byte(tmp_path, sim, redis_server, s3_server):
    source_dir, back_dir = tmp_path / "source", tmp_path / "back"
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=source_dir, upstream_timeout=5)
    async with serve(settings) as (_, client):
        conv = (await client.post("/api/conversations", json={})).json()
        ids = [(await upload(client, conv["id"], name, data)).json()["id"] for name, data in
               (("report.pdf", make_pdf(TOPICS)), ("open_webui_export.json", FIXTURE.read_bytes()))]
        ids.append((await upload(client, "", "shelf.md", "# 선반\nA library note.".encode(), "/api/library")).json()["id"])
    before = attachment_files(source_dir)
    assert len(before) == 9
    bucket, prefix = new_bucket(), unique_prefix()
    env = s3_server.env(bucket)
    redis_args = ["--redis-url", redis_server.url, "--redis-prefix", prefix]

    out = run_migrate(env, "--from", "files", "--to", "redis", "--data-dir", str(source_dir), *redis_args)
    assert "3 attachments" in out
    run_migrate(env, "--from", "files", "--to", "redis", "--data-dir", str(source_dir), *redis_args)  # repeatable
    keys = await object_keys(s3_server, bucket)
    assert keys == sorted([f"attachments/{conv['id']}/{ids[0]}", f"attachments/{conv['id']}/{ids[1]}",
                           f"attachments/library/local/{ids[2]}"])
    r = sync_redis.Redis.from_url(redis_server.url)
    try:
        stored = r.hgetall(f"{prefix}att:{conv['id']}")
        assert sorted(stored) == sorted(i.encode() for i in ids[:2])
        assert stored[ids[0].encode()] == before[f"{conv['id']}/{ids[0]}/meta.json"]
        assert r.get(f"{prefix}attpages:{conv['id']}/{ids[0]}") == before[f"{conv['id']}/{ids[0]}/pages.json"]
    finally:
        r.close()

    out = run_migrate(env, "--from", "redis", "--to", "files", "--data-dir", str(back_dir), *redis_args)
    assert "3 attachments" in out
    assert attachment_files(back_dir) == before


async def test_removing_a_person_removes_their_objects(tmp_path, sim, redis_server, s3_server):
    bucket = new_bucket()
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5,
                        store="redis", redis_url=redis_server.url, blob_store="s3", s3_endpoint_url=s3_server.url,
                        s3_bucket=bucket, s3_access_key_id="test", s3_secret_access_key="test")
    async with serve(settings) as (_, client):
        conv = (await client.post("/api/conversations", json={})).json()
        assert (await upload(client, conv["id"], "a.txt", b"first file")).status_code == 201
        assert (await upload(client, "", "b.txt", b"library file", "/api/library")).status_code == 201
    assert len(await object_keys(s3_server, bucket)) == 2

    assert await remove_data(settings, "local") == 1
    assert await object_keys(s3_server, bucket) == []
    r = sync_redis.Redis.from_url(redis_server.url)
    try:
        assert list(r.scan_iter(match="chat:att*")) == []
    finally:
        r.close()


def test_secrets_stay_out_of_the_settings_repr():
    settings = Settings(_env_file=None, blob_store="s3", s3_access_key_id="AKIAEXAMPLEKEY",
                        s3_secret_access_key="very-secret-value")
    assert "very-secret-value" not in repr(settings) and "AKIAEXAMPLEKEY" not in repr(settings)
    chosen = make_blobs(settings)
    assert "very-secret-value" not in repr(chosen.settings) and "AKIAEXAMPLEKEY" not in repr(chosen.settings)
    assert chosen.bucket == "chat-attachments"

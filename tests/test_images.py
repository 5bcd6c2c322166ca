"""Image attachments (issue 25): uploaded through the same routes as documents, checked against
decompression bombs before a pixel is decoded, stored without their metadata and upright, with a
thumbnail behind the same owner check, and deleted whole on the file store and on S3."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import httpx
import orjson
import pytest
from PIL import ExifTags, Image

from chatserver.attachments import store as att
from chatserver.attachments.store import (
    attachment_context,
    message_image_metas,
    message_images,
    read_attachment,
    search_attachments,
    turn_image,
)
from chatserver.config import Settings
from s3_support import new_bucket, object_keys
from support import LiveServer, serve
from test_attachments import TOPICS, make_pdf, upload
from test_people import alice, bob, server  # noqa: F401  (fixtures: two people, files and Redis)

GPS = {1: "N", 2: (52.0, 22.0, 12.5), 3: "E", 4: (4.0, 53.0, 1.0)}
BLUE, RED = (0, 0, 255), (255, 0, 0)


def gps_jpeg(size: tuple[int, int] = (64, 32), orientation: int = 6) -> bytes:
    """A JPEG as a phone writes it: GPS position, camera make and model, a comment, and an EXIF
    orientation saying "turn me 90 degrees clockwise". The left half is blue, the right half red."""
    image = Image.new("RGB", size, RED)
    image.paste(BLUE, (0, 0, size[0] // 2, size[1]))
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    exif[ExifTags.Base.Make] = "Canon"
    exif[ExifTags.Base.Model] = "EOS 5D Mark IV"
    exif[ExifTags.IFD.GPSInfo] = GPS
    out = io.BytesIO()
    image.save(out, format="JPEG", exif=exif, comment=b"shot at home", quality=95)
    return out.getvalue()


def png_bomb(width: int = 10_000, height: int = 10_000, bits: int = 1) -> bytes:
    """A PNG whose header claims width x height pixels, every one black, deflated to a few KB (bit
    depth 1) or a few hundred (depth 8 RGBA: 400 MB decoded). Written row by row with zlib, so the
    test never holds the pixels either."""
    colour = 0 if bits == 1 else 6  # grey, RGBA
    row = b"\x00" + bytes((width * bits * (1 if bits == 1 else 4) + 7) // 8)
    squeeze = zlib.compressobj(9)
    deflated = b"".join(squeeze.compress(row) for _ in range(height)) + squeeze.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, bits, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", deflated) + chunk(b"IEND", b"")


def opened(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def assert_clean(data: bytes) -> None:
    """No EXIF at all (so no GPS, camera or orientation), no comment, and none of their words."""
    image = opened(data)
    assert dict(image.getexif()) == {}
    assert not image.getexif().get_ifd(ExifTags.IFD.GPSInfo)
    assert "comment" not in image.info and "exif" not in image.info
    for word in (b"Canon", b"EOS 5D", b"shot at home", b"Exif\x00\x00"):
        assert word not in data


@pytest.fixture
def settings(tmp_path, sim) -> Settings:
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5)


async def test_a_phone_jpeg_is_stored_without_gps_or_camera_and_upright(api, client, app, settings):
    conv = await api.new()
    original = gps_jpeg()
    assert b"Canon" in original and opened(original).getexif().get_ifd(ExifTags.IFD.GPSInfo) == GPS

    response = await upload(client, conv["id"], "IMG_0042.jpg", original)
    assert response.status_code == 201, response.text
    stored = response.json()
    assert stored["kind"] == "image" and stored["media_type"] == "image/jpeg"
    # Turned upright: 64 x 32 as encoded, 32 x 64 as the camera meant it.
    assert (stored["width"], stored["height"]) == (32, 64)
    assert (stored["pages"], stored["chars"], stored["warnings"]) == (None, 0, [])

    download = await client.get(f"/api/conversations/{conv['id']}/attachments/{stored['id']}")
    assert download.status_code == 200 and download.headers["content-type"] == "image/jpeg"
    assert stored["bytes"] == len(download.content)
    assert_clean(download.content)
    image = opened(download.content)
    assert image.size == (32, 64)
    # The blue left half is now the top half.
    top, bottom = image.getpixel((16, 12)), image.getpixel((16, 52))
    assert top[2] > 200 and top[0] < 60 and bottom[0] > 200 and bottom[2] < 60

    # What the store keeps on disk is that same clean file, and nothing else holds the GPS.
    [kept] = (settings.data_dir / "attachments" / conv["id"]).rglob("original")
    assert kept.read_bytes() == download.content
    for path in settings.data_dir.rglob("*"):
        if path.is_file():
            assert b"Canon" not in path.read_bytes(), path

    listed = (await client.get(f"/api/conversations/{conv['id']}/attachments")).json()
    assert listed == [stored]


@pytest.mark.parametrize("fmt,media_type", [("PNG", "image/png"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
async def test_png_webp_and_gif_lose_their_metadata_and_a_gif_keeps_its_first_frame(api, client, fmt, media_type):
    conv = await api.new()
    exif = Image.Exif()
    exif[ExifTags.Base.Make] = "Canon"
    exif[ExifTags.IFD.GPSInfo] = GPS
    out = io.BytesIO()
    if fmt == "GIF":
        frames = [Image.new("P", (40, 20), colour) for colour in (3, 7, 9)]
        frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], comment=b"shot at home")
    else:
        extra = {"xmp": b"<x:xmpmeta>shot at home</x:xmpmeta>"} if fmt == "WEBP" else {}
        Image.new("RGBA", (40, 20), (10, 200, 30, 128)).save(out, format=fmt, exif=exif, **extra)
    response = await upload(client, conv["id"], f"picture.{fmt.lower()}", out.getvalue())
    assert response.status_code == 201, response.text
    stored = response.json()
    assert (stored["media_type"], stored["width"], stored["height"]) == (media_type, 40, 20)
    data = (await client.get(f"/api/conversations/{conv['id']}/attachments/{stored['id']}")).content
    assert_clean(data)
    image = opened(data)
    assert image.format == fmt and getattr(image, "n_frames", 1) == 1
    if fmt != "GIF":  # the pixels and their transparency kept (WebP is lossy: near enough)
        pixel = image.convert("RGBA").getpixel((5, 5))
        assert all(abs(a - b) <= 3 for a, b in zip(pixel, (10, 200, 30, 128))), pixel


async def test_a_phones_mpo_is_stored_as_the_jpeg_of_its_first_picture(api, client):
    """Phones write MPO (a JPEG followed by a depth map or a preview): it was refused as "MPO"."""
    exif = Image.Exif()
    exif[ExifTags.Base.Make] = "Canon"
    exif[ExifTags.IFD.GPSInfo] = GPS
    out = io.BytesIO()
    Image.new("RGB", (64, 32), RED).save(out, format="MPO", save_all=True, append_images=[Image.new("RGB", (64, 32), BLUE)],
                                         exif=exif)
    assert opened(out.getvalue()).format == "MPO"
    conv = await api.new()
    response = await upload(client, conv["id"], "PXL_0001.jpg", out.getvalue())
    assert response.status_code == 201, response.text
    assert response.json()["media_type"] == "image/jpeg"
    data = (await client.get(f"/api/conversations/{conv['id']}/attachments/{response.json()['id']}")).content
    assert_clean(data)
    image = opened(data)
    assert image.format == "JPEG" and getattr(image, "n_frames", 1) == 1 and image.getpixel((5, 5))[0] > 200


async def test_a_100_megapixel_png_of_a_few_kb_is_422_naming_the_limit_and_the_server_stays_small(tmp_path, sim):
    bomb, heavy = png_bomb(), png_bomb(bits=8)
    assert len(bomb) < 20_000 and len(heavy) < 600_000
    live = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url})
    try:
        async with httpx.AsyncClient(base_url=live.base_url, timeout=60) as client:
            conv = (await client.post("/api/conversations", json={})).json()
            url = f"/api/conversations/{conv['id']}/attachments"
            # Warm: the routes and the upload path have run once before the peak is read.
            assert (await client.post(url, files={"file": ("small.png", png_bomb(100, 100), "image/png")})
                    ).status_code == 201
            peak_before = vm_hwm(live.process.pid)
            for name, data in (("bomb.png", bomb), ("heavy.png", heavy), ("bomb.jpg", bomb)):
                response = await client.post(url, files={"file": (name, data, "image/png")})
                assert response.status_code == 422, response.text
                detail = response.json()["detail"]
                assert "MAX_IMAGE_PIXELS" in detail and "50,000,000" in detail
                assert "10,000 × 10,000" in detail
            # Decoding the RGBA one would take 400 MB; the server's peak did not move.
            assert vm_hwm(live.process.pid) - peak_before < 20 * 2**20
            assert len((await client.get(url)).json()) == 1  # only the small one
    finally:
        live.stop()


def vm_hwm(pid: int) -> int:
    """A process's peak resident memory, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_the_limit_is_a_setting(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        max_image_pixels=1000)
    async with serve(settings) as (_, client):
        conv = (await client.post("/api/conversations", json={})).json()
        response = await upload(client, conv["id"], "a.jpg", gps_jpeg((40, 30)))
        assert response.status_code == 422 and "1,000 pixels (MAX_IMAGE_PIXELS)" in response.json()["detail"]
        assert (await upload(client, conv["id"], "b.jpg", gps_jpeg((20, 20)))).status_code == 201


async def test_damaged_images_are_422_and_other_binaries_still_415(api, client, settings):
    conv = await api.new()
    jpeg = gps_jpeg()
    for name, data in (("cut.jpg", jpeg[:200]), ("noise.png", b"\x89PNG\r\n\x1a\n" + bytes(200))):
        response = await upload(client, conv["id"], name, data)
        assert response.status_code == 422, (name, response.text)
        assert "damaged" in response.json()["detail"]
    tiff = b"II*\x00" + bytes(100)
    response = await upload(client, conv["id"], "scan.tif", tiff)
    assert response.status_code == 415 and "PNG, JPEG, WebP, GIF" in response.json()["detail"]
    assert not (settings.data_dir / "attachments" / conv["id"]).exists()


async def test_thumbnails_are_small_cached_and_answer_304(api, client, app):
    conv = await api.new()
    big = Image.new("RGB", (1200, 900), RED)
    out = io.BytesIO()
    big.save(out, format="JPEG")
    stored = (await upload(client, conv["id"], "wide.jpg", out.getvalue())).json()
    url = f"/api/conversations/{conv['id']}/attachments/{stored['id']}/thumbnail"
    extractor = app.state.chat.attachments.extractor
    started = extractor.started
    first = await client.get(url)
    assert first.status_code == 200, first.text
    assert first.headers["content-type"] == "image/webp" and "nosniff" in first.headers["x-content-type-options"]
    assert opened(first.content).size == (320, 240)
    assert extractor.started == started + 1
    again = await client.get(url)
    assert again.content == first.content and extractor.started == started + 1  # drawn once
    etag = first.headers["etag"]
    assert (await client.get(url, headers={"If-None-Match": etag})).status_code == 304

    pdf = (await upload(client, conv["id"], "report.pdf", make_pdf(TOPICS[:1]))).json()
    assert (await client.get(f"/api/conversations/{conv['id']}/attachments/{pdf['id']}/thumbnail")
            ).status_code == 404

    library = (await upload(client, "", "mine.jpg", gps_jpeg(), path="/api/library")).json()
    answer = await client.get(f"/api/library/{library['id']}/thumbnail")
    assert answer.status_code == 200 and opened(answer.content).size == (32, 64)


async def test_another_person_gets_404_for_thumbnails_and_originals_on_files_and_redis(server, alice, bob):  # noqa: F811
    conv = (await alice.post("/api/conversations", json={})).json()
    mine = (await upload(alice, conv["id"], "me.jpg", gps_jpeg())).json()
    shelf = (await upload(alice, "", "shelf.jpg", gps_jpeg(), path="/api/library")).json()
    # What the metadata store (files, or Redis) gives back names the image and its size.
    [listed] = (await alice.get(f"/api/conversations/{conv['id']}/attachments")).json()
    assert (listed["kind"], listed["width"], listed["height"], listed["media_type"]) == ("image", 32, 64, "image/jpeg")
    assert (await alice.get("/api/library")).json() == [shelf]
    urls = [f"/api/conversations/{conv['id']}/attachments/{mine['id']}/thumbnail",
            f"/api/conversations/{conv['id']}/attachments/{mine['id']}"]
    for url in urls:
        assert (await alice.get(url)).status_code == 200
        theirs = await bob.get(url)
        unknown = await bob.get(url.replace(conv["id"], "NoSuchConversation123"))
        assert theirs.status_code == unknown.status_code == 404 and theirs.json() == unknown.json()
    assert (await alice.get(f"/api/library/{shelf['id']}/thumbnail")).status_code == 200
    # Bob's library is his own: Alice's id is simply not in it.
    theirs = await bob.get(f"/api/library/{shelf['id']}/thumbnail")
    unknown = await bob.get("/api/library/NoSuchAttachment1234/thumbnail")
    assert theirs.status_code == unknown.status_code == 404 and theirs.json() == unknown.json()


async def test_deleting_an_image_removes_its_original_and_thumbnail_from_disk(api, client, settings):
    conv = await api.new()
    stored = (await upload(client, conv["id"], "me.jpg", gps_jpeg())).json()
    base = f"/api/conversations/{conv['id']}/attachments/{stored['id']}"
    assert (await client.get(f"{base}/thumbnail")).status_code == 200
    directory = settings.data_dir / "attachments" / conv["id"] / stored["id"]
    assert {p.name for p in directory.iterdir()} >= {"original", "thumbnail", "meta.json"}
    assert (await client.delete(base)).status_code == 204
    assert not directory.exists()
    assert (await client.get(f"{base}/thumbnail")).status_code == 404


async def test_on_s3_the_thumbnail_is_an_object_beside_the_original_and_goes_with_it(tmp_path, sim, s3_server):
    bucket = new_bucket()
    live = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, **s3_server.env(bucket)})
    try:
        async with httpx.AsyncClient(base_url=live.base_url, timeout=60) as client:
            conv = (await client.post("/api/conversations", json={})).json()
            stored = (await upload(client, conv["id"], "me.jpg", gps_jpeg())).json()
            base = f"/api/conversations/{conv['id']}/attachments/{stored['id']}"
            thumb = await client.get(f"{base}/thumbnail")
            assert thumb.status_code == 200 and opened(thumb.content).size == (32, 64)
            key = f"attachments/{conv['id']}/{stored['id']}"
            assert await object_keys(s3_server, bucket) == [key, f"{key}.thumbnail"]
            assert_clean((await client.get(base)).content)
            assert (await client.get(f"{base}/thumbnail")).content == thumb.content
            assert (await client.delete(base)).status_code == 204
            assert await object_keys(s3_server, bucket) == []

            # A deleted conversation takes its images' thumbnails too.
            again = (await upload(client, conv["id"], "me.jpg", gps_jpeg())).json()
            assert (await client.get(f"/api/conversations/{conv['id']}/attachments/{again['id']}/thumbnail")
                    ).status_code == 200
            assert len(await object_keys(s3_server, bucket)) == 2
            assert (await client.delete(f"/api/conversations/{conv['id']}")).status_code == 204
            assert await object_keys(s3_server, bucket) == []
    finally:
        live.stop()


async def test_the_tools_say_an_image_has_no_text_and_the_turn_scope_loads_images(api, client, app):
    conv, other = await api.new(), await api.new()
    attachments = app.state.chat.attachments
    photo = (await upload(client, conv["id"], "photo.jpg", gps_jpeg())).json()
    notes = (await upload(client, conv["id"], "notes.txt", b"The budget is forty thousand euros.")).json()
    elsewhere = (await upload(client, other["id"], "theirs.jpg", gps_jpeg())).json()

    with attachment_context(attachments, conv["id"], "local"):
        read = await read_attachment("photo.jpg")
        assert read.text == "photo.jpg is an image (32 × 64 JPEG): it has no text to read."
        found = await search_attachments("camera")
        assert "photo.jpg is an image" in found.text
        listing = await att.attachment_listing(att.attachment_scope.get())
        assert f"- photo.jpg (image, 32 × 64 JPEG, id {photo['id']})" in listing  # the id analyze_image takes
        image = await turn_image(photo["id"])
        assert (image.id, image.media_type, image.width, image.height, image.source) == \
            (photo["id"], "image/jpeg", 32, 64, "conversation")
        assert_clean(image.data)
        for not_here in (elsewhere["id"], notes["id"], "NoSuchAttachment1234", "../../etc"):
            with pytest.raises(att.AttachmentNotFound, match="image not found"):
                await turn_image(not_here)
    with pytest.raises(att.AttachmentNotFound):
        await turn_image(photo["id"])  # no turn running

    ids = [notes["id"], photo["id"], "NoSuchAttachment1234"]
    assert [m["id"] for m in await message_image_metas(attachments, conv["id"], ids)] == [photo["id"]]
    [loaded] = await message_images(attachments, conv["id"], ids)
    assert loaded.data == image.data


async def test_an_image_counts_against_the_quota_like_any_file(tmp_path, sim):
    data = gps_jpeg()
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        quota_file_bytes=len(data) + 100)
    async with serve(settings) as (_, client):
        conv = (await client.post("/api/conversations", json={})).json()
        assert (await upload(client, conv["id"], "a.jpg", data)).status_code == 201
        refused = await upload(client, conv["id"], "b.jpg", data)
        assert refused.status_code == 413 and refused.json()["detail"].startswith("QUOTA_FILE_BYTES:")



async def test_a_chatgpt_zip_keeps_its_images_as_attachments_linked_from_their_messages(client, settings):
    """ChatGPT's download: conversations.json (its "서울 여행" conversation's first message shows
    the image `file-service://file-abc`) beside that image, named as the export names it, a real
    phone JPEG with GPS; also an image no message shows and a zip-bombed one."""
    from test_exchange import fixture, zipped

    conversations = orjson.loads(fixture("chatgpt_conversations.json"))
    conversations[1]["mapping"]["k-1"]["message"]["content"]["parts"].insert(
        0, {"content_type": "image_asset_pointer", "asset_pointer": "file-service://file-bomb"})
    # 50 MiB of zeros deflated to about 50 KB: past MAX_ATTACHMENT_BYTES unpacked, so never read whole.
    download = zipped({"conversations.json": orjson.dumps(conversations), "chat.html": b"<html></html>",
                       "file-abc-seoul.jpg": gps_jpeg(), "file-bomb-x.png": bytes(50 * 2**20),
                       "dalle-generations/file-Unshown-image.webp": gps_jpeg()})
    assert len(download) < 200_000

    response = await client.post("/api/import", files={"file": ("export.zip", download, "application/zip")})
    assert response.status_code == 201, response.text
    body = response.json()
    [skipped] = [w for w in body["warnings"] if w["code"] == "images_skipped"]
    assert skipped["count"] == 2 and "file-bomb-x.png" in skipped["message"]
    seoul = next(c for c in [(await client.get(f"/api/conversations/{i}")).json() for i in body["imported"]]
                 if c["title"] == "서울 여행")
    [question] = [m for m in seoul["messages"] if m["role"] == "user"]
    [image_id] = question["attachment_ids"]
    # The bomb's mark stays where it was; the kept image's mark is gone.
    assert question["content"] == "[image]\n\n서울에서 가볼 만한 곳을 알려 주세요."
    [attached] = (await client.get(f"/api/conversations/{seoul['id']}/attachments")).json()
    assert (attached["id"], attached["name"], attached["kind"]) == (image_id, "file-abc-seoul.jpg", "image")
    data = (await client.get(f"/api/conversations/{seoul['id']}/attachments/{image_id}")).content
    assert_clean(data)
    assert opened(data).size == (32, 64)
    thumb = await client.get(f"/api/conversations/{seoul['id']}/attachments/{image_id}/thumbnail")
    assert thumb.status_code == 200

    # The export carries the id; the Markdown links the file.
    exported = (await client.get(f"/api/conversations/{seoul['id']}/export")).json()
    node = next(n for n in exported["conversations"][0]["nodes"] if n["role"] == "user")
    assert node["attachment_ids"] == [image_id]
    markdown = (await client.get(f"/api/conversations/{seoul['id']}/export", params={"format": "md"})).text
    assert f"![file-abc-seoul.jpg](/api/conversations/{seoul['id']}/attachments/{image_id})" in markdown

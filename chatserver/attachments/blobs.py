"""Where attachments' original bytes live: `BLOB_STORE=files` (beside their metadata under
DATA_DIR/attachments, one process) or `BLOB_STORE=s3` (any S3-compatible service: AWS S3, MinIO,
Cloudflare R2, SeaweedFS), so several servers share them and none keeps them on its own disk.

Promises:
- An original is addressed by its scope and attachment id only, both validated before they get
  here (`Scope` keys and `valid_id` ids), never by anything derived from a file name. On S3 the
  object key is `attachments/<scope key>/<id>`.
- An upload is never held whole in memory: S3 gets it from its temporary file, read as it is
  sent, in parts of PART_BYTES (multipart); a download is streamed in chunks of CHUNK_BYTES.
- A missing original is `BlobMissing` (a 404 to the routes); an unreachable S3 is
  `BlobsUnavailable` (503). Neither message carries a credential.

This module knows bytes and keys, not metadata, pages, search or HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from chatserver.attachments.extraction import AttachmentError

log = logging.getLogger("chat.attachments")

CHUNK_BYTES = 64 * 1024  # one piece of a download
# One part of a multipart upload: S3's smallest part (but the last) is 5 MiB.
PART_BYTES = 5 * 1024 * 1024
KEY_PREFIX = "attachments/"
# What is kept of one attachment: its original and, for an image, the thumbnail drawn from it
# (issue 25). Deleting an attachment deletes every part.
ORIGINAL = "original"
THUMBNAIL = "thumbnail"
PARTS = (ORIGINAL, THUMBNAIL)


class BlobMissing(AttachmentError):
    status = 404


class BlobsUnavailable(AttachmentError):
    status = 503


@dataclass(slots=True)
class Blob:
    """One original, ready to be sent: its size and its bytes in chunks (read as they are asked for).

    `path` is set when the bytes are a local file (the route then lets the server send the file
    itself); `chunks` must be exhausted or closed (`aclose`) so the connection behind it is freed.
    """

    size: int
    chunks: AsyncIterator[bytes]
    path: Path | None = None

    async def aclose(self) -> None:
        closer = getattr(self.chunks, "aclose", None)
        if closer is not None:
            await closer()


class Blobs(Protocol):
    """Originals by (scope key, attachment id)."""

    # Where they are, to tell two blob stores apart (a migration skips copying onto the same place).
    where: str

    async def start(self) -> None:
        """Make ready (S3: create the bucket when missing); BlobsUnavailable when it cannot."""

    async def put(self, scope_key: str, attachment_id: str, source: Path, *, consume: bool = False,
                  part: str = ORIGINAL) -> None:
        """Store the file at `source` as this original (or `part`); `consume`: the file may be moved away."""

    async def open(self, scope_key: str, attachment_id: str, part: str = ORIGINAL) -> Blob:
        """The original's (or `part`'s) bytes; BlobMissing when there is none."""

    async def delete(self, scope_key: str, attachment_id: str) -> None:
        """Remove one original and its other parts (nothing when they are already gone)."""

    async def delete_scope(self, scope_key: str) -> None:
        """Remove every original of a scope."""

    async def close(self) -> None: ...


def object_key(scope_key: str, attachment_id: str, part: str = ORIGINAL) -> str:
    # A part other than the original is a sibling object (`<id>.thumbnail`), never `<id>/...`: some
    # S3 services keep objects as files, where `<id>` cannot be a file and a directory at once.
    suffix = "" if part == ORIGINAL else f".{part}"
    return f"{KEY_PREFIX}{scope_key}/{attachment_id}{suffix}"


# -- files -------------------------------------------------------------------------------------

class FileBlobs:
    """`<root>/<scope key>/<id>/original` (and `thumbnail`): today's layout, beside the file
    metadata store's `meta.json` and `pages.json` (which decide whether the attachment exists)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = f"files:{root.resolve()}"

    def _path(self, scope_key: str, attachment_id: str, part: str = ORIGINAL) -> Path:
        return self.root / scope_key / attachment_id / part

    async def start(self) -> None:
        pass

    async def put(self, scope_key: str, attachment_id: str, source: Path, *, consume: bool = False,
                  part: str = ORIGINAL) -> None:
        await asyncio.to_thread(self._put, self._path(scope_key, attachment_id, part), source, consume)

    @staticmethod
    def _put(target: Path, source: Path, consume: bool) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        if consume:
            with open(source, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(source, target)  # the upload's temporary file is on the same filesystem
            return
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=".original-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, open(source, "rb") as f:
                shutil.copyfileobj(f, out, CHUNK_BYTES)
                out.flush()
                os.fsync(out.fileno())
            os.replace(name, target)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise

    async def open(self, scope_key: str, attachment_id: str, part: str = ORIGINAL) -> Blob:
        path = self._path(scope_key, attachment_id, part)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise BlobMissing("attachment not found") from None
        return Blob(size, _file_chunks(path), path)

    async def delete(self, scope_key: str, attachment_id: str) -> None:
        for part in PARTS:
            self._path(scope_key, attachment_id, part).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: the file metadata store still keeps its files there
            (self.root / scope_key / attachment_id).rmdir()

    async def delete_scope(self, scope_key: str) -> None:
        directory = self.root / scope_key
        if not directory.is_dir():
            return
        for entry in directory.iterdir():
            await self.delete(scope_key, entry.name)
        with contextlib.suppress(OSError):
            directory.rmdir()

    async def close(self) -> None:
        pass


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
            yield chunk


# -- S3 ----------------------------------------------------------------------------------------

# aiobotocore rather than boto3 in threads, aioboto3 or a hand-written client: it is botocore (the
# AWS SDK's own request signing, retries, endpoint and error handling, kept current by AWS) on
# aiohttp, so every call is awaited on the event loop; it has multipart uploads, CreateBucket and a
# streaming response body, and it is maintained by the aio-libs project. aioboto3 is a thin layer
# over it adding nothing used here; boto3 would block a thread per call and per download.


@dataclass(frozen=True, slots=True)
class S3Settings:
    bucket: str
    endpoint_url: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = None

    def __repr__(self) -> str:  # never the keys
        return f"S3Settings(bucket={self.bucket!r}, endpoint_url={self.endpoint_url!r}, region={self.region!r})"


def _s3_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError

    return (BotoCoreError, OSError, asyncio.TimeoutError)


class S3Blobs:
    """Originals as objects in one bucket, through one aiobotocore client per process."""

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self.bucket = settings.bucket
        self.where = f"s3:{settings.endpoint_url or 'aws'}/{settings.bucket}"
        self._stack = AsyncExitStack()
        self._client: Any = None

    async def _s3(self) -> Any:
        if self._client is None:
            from aiobotocore.session import get_session
            from botocore.config import Config

            config = Config(
                region_name=self.settings.region,
                connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"},
                # Each download holds a connection while it streams: room for that many at once.
                max_pool_connections=64,
                # MinIO, SeaweedFS and R2 all answer path-style requests on their own endpoint; AWS
                # (no endpoint set) picks its own style.
                s3={"addressing_style": "path" if self.settings.endpoint_url else "auto"},
                # Checksums only where S3 requires them: the default CRC32 trailers are refused by
                # some S3-compatible services.
                request_checksum_calculation="when_required", response_checksum_validation="when_required",
            )
            self._client = await self._stack.enter_async_context(get_session().create_client(
                "s3", endpoint_url=self.settings.endpoint_url, region_name=self.settings.region,
                aws_access_key_id=self.settings.access_key_id,
                aws_secret_access_key=self.settings.secret_access_key, config=config))
        return self._client

    def _unavailable(self, exc: BaseException) -> BlobsUnavailable:
        # botocore's messages name the operation and the endpoint, never a key.
        log.error("S3 (%s) failed: %s", self.where, exc)
        return BlobsUnavailable("the file store (S3) is unreachable; try again shortly")

    @staticmethod
    def _code(exc: BaseException) -> str:
        return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))

    @contextlib.contextmanager
    def _failures(self, missing: bool = False) -> Iterator[None]:
        """S3's errors as the domain's: BlobMissing (with `missing`) or BlobsUnavailable."""
        try:
            yield
        except AttachmentError:
            raise
        except Exception as exc:
            code = self._code(exc)
            if missing and code in ("NoSuchKey", "404", "NotFound"):
                raise BlobMissing("attachment not found") from None
            if code or isinstance(exc, _s3_errors()):
                raise self._unavailable(exc) from None
            raise

    async def start(self) -> None:
        """Create the bucket when it is missing (two servers starting at once both succeed)."""
        with self._failures():
            s3 = await self._s3()
            try:
                await s3.head_bucket(Bucket=self.bucket)
                return
            except Exception as exc:
                if self._code(exc) not in ("404", "NoSuchBucket", "NotFound"):
                    raise
            extra = {} if self.settings.region == "us-east-1" else \
                {"CreateBucketConfiguration": {"LocationConstraint": self.settings.region}}
            try:
                await s3.create_bucket(Bucket=self.bucket, **extra)
                log.info("created the bucket %s", self.bucket)
            except Exception as exc:
                if self._code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    async def put(self, scope_key: str, attachment_id: str, source: Path, *, consume: bool = False,
                  part: str = ORIGINAL) -> None:
        """One PutObject for a file of at most PART_BYTES, else a multipart upload of PART_BYTES
        parts; each body is read from the file as it is sent (FileSlice), never held whole."""
        key = object_key(scope_key, attachment_id, part)
        with self._failures():
            s3 = await self._s3()
            size = source.stat().st_size
            if size <= PART_BYTES:
                with FileSlice(source, 0, size) as body:
                    await s3.put_object(Bucket=self.bucket, Key=key, Body=body, ContentLength=size)
                return
            upload = await s3.create_multipart_upload(Bucket=self.bucket, Key=key)
            upload_id = upload["UploadId"]
            try:
                parts = []
                for number, offset in enumerate(range(0, size, PART_BYTES), start=1):
                    length = min(PART_BYTES, size - offset)
                    with FileSlice(source, offset, length) as body:
                        sent = await s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                    PartNumber=number, Body=body, ContentLength=length)
                    parts.append({"ETag": sent["ETag"], "PartNumber": number})
                await s3.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                   MultipartUpload={"Parts": parts})
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.shield(s3.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                                   UploadId=upload_id))
                raise

    async def open(self, scope_key: str, attachment_id: str, part: str = ORIGINAL) -> Blob:
        with self._failures(missing=True):
            s3 = await self._s3()
            answer = await s3.get_object(Bucket=self.bucket, Key=object_key(scope_key, attachment_id, part))
        return Blob(int(answer["ContentLength"]), _body_chunks(answer["Body"]))

    async def delete(self, scope_key: str, attachment_id: str) -> None:
        with self._failures():
            s3 = await self._s3()
            await s3.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": object_key(scope_key, attachment_id, part)} for part in PARTS], "Quiet": True})

    async def delete_scope(self, scope_key: str) -> None:
        """Every object under the scope's prefix, listed and deleted a page (up to 1,000) at a time."""
        with self._failures():
            s3 = await self._s3()
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                  Prefix=f"{KEY_PREFIX}{scope_key}/")
            async for page in pages:
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    await s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

    async def close(self) -> None:
        await self._stack.aclose()
        self._client = None


class FileSlice(io.RawIOBase):
    """`length` bytes of a file from `start`, as a seekable file of its own: botocore reads it to
    sign it and seeks back, aiohttp then sends it in 64 KiB reads (in a worker thread). Measured on a
    20 MiB upload to SeaweedFS: 0.8 MB of added peak memory, against 13.2 MB with each part read
    into bytes."""

    def __init__(self, path: Path, start: int, length: int) -> None:
        super().__init__()
        self._file = open(path, "rb")
        self._start, self._length, self._pos = start, length, 0
        self._file.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        left = self._length - self._pos
        if size is None or size < 0 or size > left:
            size = left
        data = self._file.read(size)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        self._file.seek(self._start + self._pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return self._length

    def close(self) -> None:
        self._file.close()
        super().close()


async def _body_chunks(body: Any) -> AsyncIterator[bytes]:
    """The object's bytes as they arrive; the connection is released however the reading ends."""
    try:
        async for chunk in body.iter_chunks(CHUNK_BYTES):
            yield chunk
    finally:
        body.close()

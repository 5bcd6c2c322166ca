"""Routes for attachments: upload, list, download and delete, per conversation and in the library.

Uploads are multipart (field `file`), streamed through python-multipart's parser into a temporary
file with MAX_ATTACHMENT_BYTES enforced while the bytes arrive, so a file is never held whole in
memory and an oversized one is refused as soon as it passes the limit. Downloads are always
`attachment` with `nosniff`: an uploaded page must never render on this origin; from S3 they are
streamed as they arrive.

Behind a citation chip (issue 24): `.../passages` answers a file's passages as the model was given
them, and `.../pages/{n}.png` a PDF page drawn in the limited child (`viewer.py`), cached on this
server's disk.

An image (issue 25) has `.../thumbnail`: a WebP at most 320 pixels a side, drawn once in the
limited child and kept in the blob store beside the original.

Every route passes the one owner check (`deps.OwnerStoreDep`): a conversation's files are
reached only through a conversation its owner can see, and the library is the owner's own.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from pydantic import BaseModel
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from chatserver.api.deps import OwnerDep, OwnerStoreDep
from chatserver.api.quota import check_files
from chatserver.attachments.store import (
    AttachmentError,
    AttachmentNotFound,
    Attachments,
    Scope,
    TooLarge,
    content_disposition,
    conversation_scope,
    library_scope,
    public,
)
from chatserver.attachments.viewer import marks, passages
from chatserver.store.files import NotFound, OwnerStore

router = APIRouter(tags=["attachments"])

# Room for the multipart framing and a part's headers on top of the file itself.
FRAMING_BYTES = 64 * 1024

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {"file": {"type": "string", "format": "binary"}},
        }}},
    },
}
ERRORS = {
    404: {"description": "no such conversation or attachment"},
    413: {"description": "over MAX_ATTACHMENT_BYTES, or past the person's QUOTA_FILE_BYTES"},
    415: {"description": "not a PDF, DOCX, image or text file"},
    422: {"description": "encrypted, damaged, image-only, empty, too big or too slow to read, an image over "
                         "MAX_IMAGE_PIXELS; or not a multipart body"},
    429: {"description": "EXTRACT_QUEUE files are already waiting to be read"},
}


async def get_attachments(request: Request) -> Attachments:
    return request.app.state.chat.attachments


async def conversation_exists(conv_id: str, store: OwnerStoreDep) -> str:
    """The conversation id when this owner has it; the store's NotFound (404) otherwise."""
    await store.get(conv_id)
    return conv_id


AttachmentsDep = Annotated[Attachments, Depends(get_attachments)]
ConversationDep = Annotated[str, Depends(conversation_exists)]


def _fail(exc: AttachmentError) -> HTTPException:
    return HTTPException(exc.status, str(exc))


class _Upload:
    """python-multipart callbacks writing the first `file` part to a temporary file, under a limit."""

    def __init__(self, attachments: Attachments) -> None:
        self.attachments = attachments
        self.limit = attachments.limits.max_bytes
        self.fd: int | None = None
        self.path = None
        self.name: str | None = None
        self.size = 0
        self.done = False  # the file part ended; later parts are ignored
        self._field, self._value, self._headers = b"", b"", {}
        self._writing = False

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def _part_begin(self) -> None:
        self._headers, self._writing = {}, False

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        disposition, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        filename = options.get(b"filename")
        if self.done or disposition != b"form-data" or options.get(b"name") != b"file" or not filename:
            return
        self.name = filename.decode("utf-8", "replace")
        self.fd, self.path = self.attachments.incoming_file()
        self._writing = True

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if not self._writing:
            return
        self.size += end - start
        if self.size > self.limit:
            raise TooLarge(f"the file is over {self.limit} bytes")
        view = memoryview(data)[start:end]
        while view:
            view = view[os.write(self.fd, view):]

    def _part_end(self) -> None:
        if self._writing:
            self._writing, self.done = False, True
            os.close(self.fd)
            self.fd = None

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)


async def receive_upload(request: Request, attachments: Attachments) -> _Upload:
    """The request's `file` part, streamed to a temporary file; HTTPException on any problem."""
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise HTTPException(422, "send the file as multipart/form-data in a field named `file`")
    limit = attachments.limits.max_bytes + FRAMING_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _fail(TooLarge(f"the file is over {attachments.limits.max_bytes} bytes"))
    upload = _Upload(attachments)
    parser = MultipartParser(boundary, upload.callbacks())
    received = 0
    try:
        try:
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit:
                    raise TooLarge(f"the file is over {attachments.limits.max_bytes} bytes")
                parser.write(chunk)
            parser.finalize()
        except AttachmentError as exc:
            raise _fail(exc) from None
        except MultipartParseError as exc:
            raise HTTPException(422, f"malformed multipart body: {exc}") from None
        if not upload.done:
            raise HTTPException(422, "no file in the multipart field `file` (or the body ended early)")
    except BaseException:
        upload.discard()  # a client gone mid-upload included
        raise
    return upload


async def _upload(request: Request, attachments: Attachments, scope: Scope, store: OwnerStore) -> dict:
    upload = await receive_upload(request, attachments)

    async def fits(size: int) -> None:
        await check_files(attachments, store, size)

    try:
        return await _unless_abandoned(request, attachments.ingest(scope, upload.name or "", upload.path,
                                                                   store.owner, fits))
    except AttachmentError as exc:
        raise _fail(exc) from None
    finally:
        upload.discard()


async def _unless_abandoned(request: Request, reading: Awaitable[dict]) -> dict:
    """`reading`, cancelled when the client hangs up first: an abandoned upload frees its reader now."""
    work = asyncio.ensure_future(reading)

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.create_task(hung_up())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})
    if work.cancelled():
        raise HTTPException(422, "the upload was abandoned before its file was read")
    return work.result()


async def _download(attachments: Attachments, scope: Scope, attachment_id: str) -> Response:
    try:
        meta, blob = await attachments.original(scope, attachment_id)
    except AttachmentError as exc:
        raise _fail(exc) from None
    headers = {
        "Content-Disposition": content_disposition(meta["name"]),
        "X-Content-Type-Options": "nosniff",
        # Should a browser still render it, it runs nothing and reaches nothing.
        "Content-Security-Policy": "default-src 'none'; sandbox",
        "Cache-Control": "private, no-store",
    }
    if blob.path is not None:  # a local file: sent by the server as such
        await blob.aclose()
        return FileResponse(blob.path, media_type=meta["media_type"], headers=headers)
    # From the blob store (S3), chunk by chunk as it arrives: never whole in memory.
    return StreamingResponse(blob.chunks, media_type=meta["media_type"],
                             headers={**headers, "Content-Length": str(blob.size)})


async def _delete(attachments: Attachments, scope: Scope, attachment_id: str) -> Response:
    try:
        await attachments.delete(scope, attachment_id)
    except AttachmentError as exc:
        raise _fail(exc) from None
    return Response(status_code=204)


def _conversation(conv_id: str) -> Scope:
    try:
        return conversation_scope(conv_id)
    except AttachmentError as exc:
        raise _fail(exc) from None


@router.post("/api/conversations/{conv_id}/attachments", status_code=201, openapi_extra=UPLOAD_BODY,
             responses=ERRORS)
async def upload_to_conversation(conv_id: ConversationDep, request: Request, attachments: AttachmentsDep,
                                 store: OwnerStoreDep) -> dict:
    """Attach a file (multipart field `file`): 201 with the Attachment."""
    scope = _conversation(conv_id)
    stored = await _upload(request, attachments, scope, store)
    try:
        await store.get(conv_id)
    except NotFound:
        await attachments.delete_scope(scope)  # the conversation was deleted during the upload
        raise
    return stored


@router.get("/api/conversations/{conv_id}/attachments")
async def list_conversation_attachments(conv_id: ConversationDep, attachments: AttachmentsDep) -> list[dict]:
    return [public(m) for m in await attachments.list(_conversation(conv_id))]


@router.get("/api/conversations/{conv_id}/attachments/{attachment_id}", responses=ERRORS,
            response_class=FileResponse)
async def download_conversation_attachment(conv_id: ConversationDep, attachment_id: str,
                                           attachments: AttachmentsDep) -> Response:
    """The original bytes, as a download."""
    return await _download(attachments, _conversation(conv_id), attachment_id)


@router.delete("/api/conversations/{conv_id}/attachments/{attachment_id}", status_code=204, responses=ERRORS)
async def delete_conversation_attachment(conv_id: ConversationDep, attachment_id: str,
                                         attachments: AttachmentsDep) -> Response:
    return await _delete(attachments, _conversation(conv_id), attachment_id)


@router.post("/api/library", status_code=201, openapi_extra=UPLOAD_BODY, responses=ERRORS)
async def upload_to_library(request: Request, attachments: AttachmentsDep, store: OwnerStoreDep) -> dict:
    """Add a file to the person's library (multipart field `file`): 201 with the Attachment."""
    return await _upload(request, attachments, library_scope(store.owner), store)


@router.get("/api/library")
async def list_library(attachments: AttachmentsDep, owner: OwnerDep) -> list[dict]:
    return [public(m) for m in await attachments.list(library_scope(owner))]


@router.get("/api/library/{attachment_id}", responses=ERRORS, response_class=FileResponse)
async def download_library_attachment(attachment_id: str, attachments: AttachmentsDep,
                                      owner: OwnerDep) -> Response:
    """The original bytes, as a download."""
    return await _download(attachments, library_scope(owner), attachment_id)


@router.delete("/api/library/{attachment_id}", status_code=204, responses=ERRORS)
async def delete_library_attachment(attachment_id: str, attachments: AttachmentsDep,
                                    owner: OwnerDep) -> Response:
    return await _delete(attachments, library_scope(owner), attachment_id)


# -- behind a citation chip ----------------------------------------------------------------------

PAGE_ERRORS = {
    404: {"description": "no such conversation, attachment or page; or the file is not a PDF"},
    422: {"description": "the page could not be drawn within EXTRACT_MAX_MB and EXTRACT_TIMEOUT"},
    429: {"description": "EXTRACT_QUEUE files or pages are already waiting"},
}
_PAGE_NUMBER = re.compile(r"[1-9][0-9]{0,6}")


class PassageOut(BaseModel):
    page: int
    label: str
    part: int
    text: str
    marks: list[list[int]] | None = None


class PassagesOut(BaseModel):
    attachment_id: str
    name: str
    media_type: str
    pages: int | None
    passages: list[PassageOut]


async def _passages(attachments: Attachments, scope: Scope, attachment_id: str, label: str | None,
                    page: int | None, q: str | None) -> PassagesOut:
    try:
        meta = await attachments.get(scope, attachment_id)
        pages = await attachments.pages(scope, attachment_id)
    except AttachmentError as exc:
        raise _fail(exc) from None
    found = passages(meta, pages, label, page)
    if q:
        for p in found:
            p["marks"] = marks(p["text"], q)
    return PassagesOut(attachment_id=meta["id"], name=meta["name"], media_type=meta["media_type"],
                       pages=meta.get("pages"), passages=[PassageOut(**p) for p in found])


async def _page_image(request: Request, attachments: Attachments, scope: Scope, attachment_id: str, page: str,
                      person: str) -> Response:
    try:
        meta = await attachments.get(scope, attachment_id)
        if not _PAGE_NUMBER.fullmatch(page):
            raise AttachmentNotFound("no such page")
        path = await attachments.page_images.image(attachments, scope, meta, int(page), person)
    except AttachmentError as exc:
        raise _fail(exc) from None
    headers = image_headers(f'"{meta["id"]}-{page}"')
    if not_modified(request, headers):
        return Response(status_code=304, headers=headers)
    return FileResponse(path, media_type="image/png", headers=headers)


def image_headers(etag: str) -> dict[str, str]:
    # no-cache: the browser keeps it but asks again (a 304 through the owner check) before showing it.
    # An attachment id is never reused and its original never changes, so the ids name the image.
    return {"X-Content-Type-Options": "nosniff", "Cache-Control": "private, no-cache",
            "Content-Security-Policy": "default-src 'none'; sandbox", "ETag": etag}


def not_modified(request: Request, headers: dict[str, str]) -> bool:
    return headers["ETag"] in request.headers.get("if-none-match", "")


Label = Annotated[str | None, Query(max_length=300, description="only the passages cited with this label")]
PageNumber = Annotated[int | None, Query(ge=1, description="only the passages of this page or section")]
Words = Annotated[str | None, Query(max_length=1000, description="words to mark in each passage")]


@router.get("/api/conversations/{conv_id}/attachments/{attachment_id}/passages", responses=ERRORS)
async def conversation_attachment_passages(conv_id: ConversationDep, attachment_id: str,
                                           attachments: AttachmentsDep, label: Label = None,
                                           page: PageNumber = None, q: Words = None) -> PassagesOut:
    """The file's passages exactly as the model was given them; `marks` when `q` is given."""
    return await _passages(attachments, _conversation(conv_id), attachment_id, label, page, q)


@router.get("/api/conversations/{conv_id}/attachments/{attachment_id}/pages/{page}.png",
            responses=PAGE_ERRORS, response_class=FileResponse)
async def conversation_attachment_page(conv_id: ConversationDep, attachment_id: str, page: str, request: Request,
                                       attachments: AttachmentsDep, owner: OwnerDep) -> Response:
    """Page `page` (from 1) of a PDF as a PNG at most 1000 pixels wide."""
    return await _page_image(request, attachments, _conversation(conv_id), attachment_id, page, owner)


@router.get("/api/library/{attachment_id}/passages", responses=ERRORS)
async def library_attachment_passages(attachment_id: str, attachments: AttachmentsDep, owner: OwnerDep,
                                      label: Label = None, page: PageNumber = None,
                                      q: Words = None) -> PassagesOut:
    return await _passages(attachments, library_scope(owner), attachment_id, label, page, q)


@router.get("/api/library/{attachment_id}/pages/{page}.png", responses=PAGE_ERRORS, response_class=FileResponse)
async def library_attachment_page(attachment_id: str, page: str, request: Request, attachments: AttachmentsDep,
                                  owner: OwnerDep) -> Response:
    return await _page_image(request, attachments, library_scope(owner), attachment_id, page, owner)


# -- thumbnails of images (issue 25) ---------------------------------------------------------------

THUMBNAIL_ERRORS = {
    404: {"description": "no such conversation or attachment, or the file is not an image"},
    422: {"description": "the thumbnail could not be drawn within EXTRACT_MAX_MB and EXTRACT_TIMEOUT"},
    429: {"description": "EXTRACT_QUEUE files are already waiting to be read"},
}


async def _thumbnail(request: Request, attachments: Attachments, scope: Scope, attachment_id: str,
                     person: str) -> Response:
    try:
        meta, blob = await attachments.thumbnail(scope, attachment_id, person)
    except AttachmentError as exc:
        raise _fail(exc) from None
    headers = image_headers(f'"{meta["id"]}-thumbnail"')
    if not_modified(request, headers):
        await blob.aclose()
        return Response(status_code=304, headers=headers)
    if blob.path is not None:
        await blob.aclose()
        return FileResponse(blob.path, media_type="image/webp", headers=headers)
    return StreamingResponse(blob.chunks, media_type="image/webp",
                             headers={**headers, "Content-Length": str(blob.size)})


@router.get("/api/conversations/{conv_id}/attachments/{attachment_id}/thumbnail", responses=THUMBNAIL_ERRORS,
            response_class=FileResponse)
async def conversation_attachment_thumbnail(conv_id: ConversationDep, attachment_id: str, request: Request,
                                            attachments: AttachmentsDep, owner: OwnerDep) -> Response:
    """An image's thumbnail: WebP, at most 320 pixels on its longer side."""
    return await _thumbnail(request, attachments, _conversation(conv_id), attachment_id, owner)


@router.get("/api/library/{attachment_id}/thumbnail", responses=THUMBNAIL_ERRORS, response_class=FileResponse)
async def library_attachment_thumbnail(attachment_id: str, request: Request, attachments: AttachmentsDep,
                                       owner: OwnerDep) -> Response:
    return await _thumbnail(request, attachments, library_scope(owner), attachment_id, owner)

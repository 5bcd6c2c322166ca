"""Drawing one PDF page as a PNG, in a child process that cannot take the server down.

Run as `python -E -s pagerender.py` by `viewer.PageImages`, never imported by the server for its
work: like `extraction.py`'s reader, the child caps its own address space (EXTRACT_MAX_MB) and CPU
time before it imports pypdfium2, gets no environment, and is killed by the server once
EXTRACT_TIMEOUT seconds of wall time pass. A page built to draw forever or to need gigabytes ends
with the child.

The request (JSON on stdin): {"path", "page" (from 1), "max_width", "max_pixels", "max_mb",
"cpu_seconds"}. The answer on stdout: the PNG's bytes, or a JSON object {"status", "error"}
(404: no such page; 422: the file could not be drawn). The image is at most `max_width` pixels wide
and `max_pixels` pixels in all, whatever size the page claims.

The PNG is written here with zlib (filter 0 on each row): the server has no imaging library, and
one format needs no more.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import zlib

MAX_SCALE = 4.0  # a tiny page is not blown up past four pixels a point


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png(width: int, height: int, stride: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG of rows `stride` bytes apart in `rgb`."""
    rows = bytearray()
    row_bytes = width * 3
    for y in range(height):
        rows += b"\x00"
        rows += rgb[y * stride:y * stride + row_bytes]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(bytes(rows), 6))
            + _chunk(b"IEND", b""))


def scale_for(width_pt: float, height_pt: float, max_width: int, max_pixels: int) -> float:
    """The scale that fits the page in `max_width` pixels across and `max_pixels` in all."""
    width_pt, height_pt = max(width_pt, 1.0), max(height_pt, 1.0)
    return min(max_width / width_pt, math.sqrt(max_pixels / (width_pt * height_pt)), MAX_SCALE)


def render(request: dict) -> bytes | dict:
    import pypdfium2 as pdfium

    try:
        doc = pdfium.PdfDocument(request["path"])
    except pdfium.PdfiumError as exc:
        return {"status": 422, "error": f"the PDF could not be opened ({exc})"}
    try:
        number = request["page"]
        if not 1 <= number <= len(doc):
            return {"status": 404, "error": "no such page"}
        page = doc[number - 1]
        try:
            width_pt, height_pt = page.get_size()
            scale = scale_for(width_pt, height_pt, request["max_width"], request["max_pixels"])
            bitmap = page.render(scale=scale, rev_byteorder=True)  # 3 bytes a pixel, RGB
            try:
                if bitmap.n_channels != 3:
                    return {"status": 422, "error": "the page could not be drawn as RGB"}
                return png(bitmap.width, bitmap.height, bitmap.stride, bytes(bitmap.buffer))
            finally:
                bitmap.close()
        finally:
            page.close()
    except pdfium.PdfiumError as exc:
        return {"status": 422, "error": f"the page could not be drawn ({exc})"}
    finally:
        doc.close()


def _limit_self(max_mb: int, cpu_seconds: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (max_mb * 2**20, max_mb * 2**20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def child_main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    _limit_self(request["max_mb"], request["cpu_seconds"])
    try:
        answer = render(request)
    except MemoryError:
        answer = {"status": 422, "error": f"drawing the page needed more than {request['max_mb']} MB (EXTRACT_MAX_MB)"}
    except Exception as exc:  # pypdfium2's own bug: say what kind, the traceback goes to stderr
        import traceback

        traceback.print_exc()
        answer = {"status": 422, "error": f"the page could not be drawn ({type(exc).__name__})"}
    sys.stdout.buffer.write(answer if isinstance(answer, bytes) else json.dumps(answer).encode())


if __name__ == "__main__":
    child_main()

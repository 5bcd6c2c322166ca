"""Images (issue 25): PNG, JPEG, WebP and GIF, cleaned in the child before anything is stored.

- The size in the header is checked against `max_pixels` (MAX_IMAGE_PIXELS) before a pixel is
  decoded, so a 100-megapixel PNG of a few KB is refused without inflating; Pillow's own bomb
  check is set to the same limit as a second guard.
- What is stored is a new file holding only pixels (and the colour profile, which changes how
  they look and says nothing about the person): EXIF (GPS, camera, dates), XMP, comments and PNG
  text chunks are never written. The EXIF orientation is applied to the pixels first, so the
  image stands as the camera meant. An animated GIF, PNG or WebP keeps its first frame.
- A thumbnail is drawn from a stored (already clean) image with `thumbnail`.

Imports nothing from the server: it runs in the child (`extraction.py`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .common import Unreadable, Unsupported

# What each accepted format is called, and its media type; the stored file keeps its format.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")
JPEG_QUALITY = 90  # when the pixels had to change (turned upright); otherwise JPEG's own tables are kept
WEBP_QUALITY = 90
THUMBNAIL_EDGE = 320  # the longer edge of a thumbnail, in pixels
THUMBNAIL_QUALITY = 80


def is_image(head: bytes) -> bool:
    """Whether these first bytes start a PNG, JPEG, GIF or WebP file."""
    return head.startswith(MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def _open(path: Path, max_pixels: int):  # -> PIL.Image.Image, the header read, no pixels yet
    from PIL import Image, UnidentifiedImageError

    # Pillow warns past this and refuses past twice this; the check below refuses past it exactly.
    Image.MAX_IMAGE_PIXELS = max_pixels
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    try:
        image = Image.open(path, formats=list(FORMATS))
    except Image.DecompressionBombError:
        raise Unreadable(_too_many(None, max_pixels)) from None
    except UnidentifiedImageError:
        raise Unreadable("the image is damaged: its header could not be read") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise Unreadable(f"the image is damaged ({exc})") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise Unreadable(_too_many((width, height), max_pixels))
    if width < 1 or height < 1:
        image.close()
        raise Unreadable("the image is empty (no pixels)")
    return image


def _too_many(size: tuple[int, int] | None, max_pixels: int) -> str:
    said = f" ({size[0]:,} × {size[1]:,} = {size[0] * size[1]:,} pixels)" if size else ""
    return (f"the image is too large{said}: this server takes images of at most {max_pixels:,} pixels "
            "(MAX_IMAGE_PIXELS)")


def clean(path: Path, out: Path, max_pixels: int) -> dict:
    """Write the image at `path` to `out` without its metadata, upright, first frame only.

    {"format", "media_type", "width", "height"} of what was written; Unreadable when it is too
    large or damaged, Unsupported when it is an image of another format.
    """
    from PIL import ExifTags, Image, ImageOps

    with _open(path, max_pixels) as image:
        # Phones write MPO: a JPEG followed by more (a depth map, a preview). Its first is the photo.
        fmt = "JPEG" if image.format == "MPO" else image.format
        if fmt not in FORMATS:
            raise Unsupported(f"{fmt} images are not supported; send PNG, JPEG, WebP or GIF")
        try:
            image.seek(0)
            image.load()
            turned = image.getexif().get(ExifTags.Base.Orientation, 1) in range(2, 9)
            # exif_transpose draws a second copy: only when the pixels must turn.
            pixels = ImageOps.exif_transpose(image) if turned else image
        except Image.DecompressionBombError:
            raise Unreadable(_too_many(None, max_pixels)) from None
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise Unreadable(f"the image is damaged or truncated ({exc})") from None
        options = _options(fmt, image.info, pixels.mode, fmt == "WEBP" and _lossless_webp(path))
        # Encoders fall back on `info` for what the options leave out (comments, EXIF, XMP).
        pixels.info = {}
        if fmt == "JPEG":
            if pixels.mode not in ("L", "RGB", "CMYK"):
                pixels = pixels.convert("RGB")
            # Unturned, the same quantisation tables and subsampling: a second encoding that loses
            # next to nothing. Turned, the pixels are new and get a quality of their own.
            keep = pixels is image and image.format == "JPEG"  # Pillow keeps tables of a plain JPEG only
            options |= {"quality": "keep", "subsampling": "keep"} if keep else {"quality": JPEG_QUALITY}
        pixels.save(out, format=fmt, **options)
        return {"format": fmt, "media_type": FORMATS[fmt], "width": pixels.width, "height": pixels.height}


def _options(fmt: str, info: dict, mode: str, lossless_webp: bool) -> dict:
    """Encoder options naming every metadata field as empty, so nothing of the source is written;
    only the colour profile and transparency are carried over."""
    options: dict = {"exif": b"", "xmp": b"", "comment": b""}
    if info.get("icc_profile"):
        options["icc_profile"] = info["icc_profile"]
    transparency = info.get("transparency")
    if transparency is not None and fmt in ("PNG", "GIF") and mode in ("P", "L", "RGB"):
        options["transparency"] = transparency
    if fmt == "WEBP":
        options["lossless"] = lossless_webp
        if not lossless_webp:
            options["quality"] = WEBP_QUALITY
    return options


def _lossless_webp(path: Path) -> bool:
    """Whether a WebP holds a lossless (VP8L) bitstream: it is then stored losslessly again."""
    with open(path, "rb") as f:
        head = f.read(4096)
    return b"VP8L" in head[12:]


def thumbnail(path: Path, out: Path, max_pixels: int, edge: int = THUMBNAIL_EDGE,
              quality: int = THUMBNAIL_QUALITY, method: int = 4) -> dict:
    """A small WebP copy of a stored image, at most `edge` pixels on its longer side (transparency
    kept). {"media_type", "width", "height"}. Also what a model is sent of a larger image (issue
    25: IMAGE_MAX_EDGE)."""
    with _open(path, max_pixels) as image:
        try:
            # JPEG: decoded at 1/2, 1/4 or 1/8 scale, never below the size wanted: far less work and
            # memory (a 12 MP photo for 1568 px decodes as 2000 x 1500). The box must be the fitted
            # size itself: an (edge, edge) square would keep a landscape photo at full scale.
            scale = min(1.0, edge / max(image.size))
            image.draft("RGB", (max(1, round(image.width * scale)), max(1, round(image.height * scale))))
            image.seek(0)
            image.thumbnail((edge, edge))
            has_alpha = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
            small = image.convert("RGBA" if has_alpha else "RGB")
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise Unreadable(f"the image is damaged or truncated ({exc})") from None
    # `method`: libwebp's effort, 0 (fast) to 6; 4 is its default. At 1568 px, 0 took 20 ms of CPU
    # against 4's 123 for a file 11% larger (bench/vision_bench.py's photo).
    small.save(out, format="WEBP", quality=quality, method=method)
    return {"media_type": "image/webp", "width": small.width, "height": small.height}

"""Fetch one web page for the model without opening a way into the server's own network (SSRF).

Promises: only http and https; the host is resolved once and refused if ANY of its addresses is
not public (loopback, private, link-local, unique-local, multicast, reserved, unspecified,
carrier-grade NAT, or an IPv4-mapped, IPv4-compatible, 6to4 or NAT64 form of one; IPv4 literals
spelled in decimal, hex or octal are recognised); the connection goes to an address that was
checked, never to a second lookup (DNS rebinding), with TLS still verified against the host name;
every redirect is checked the same way (at most `MAX_REDIRECTS`); reading stops at `max_bytes`
and says so. Hosts in `allow_hosts` skip the address check (tests, intranets) but are pinned too.
HTML becomes readable text (trafilatura) with its title. A PDF is read like an upload, by
extraction.py's child process under its memory and time limits, so a PDF built to inflate ends
with the child and never grows the server; its failures are `FetchError`s.

It knows nothing of tools, turns or settings: callers pass the limits.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import re
import socket
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

from chatserver.attachments.extraction import AttachmentError, Extractor

DEFAULT_MAX_BYTES = 2_097_152
MAX_REDIRECTS = 5
USER_AGENT = "Mozilla/5.0 (compatible; self-hosted-chat web_fetch)"
ACCEPT = "text/html,application/xhtml+xml,application/pdf,text/plain;q=0.9,*/*;q=0.5"
REDIRECTS = frozenset({301, 302, 303, 307, 308})
PDF_MAX_PAGES = 1000  # MAX_ATTACHMENT_PAGES's default, for callers without settings

CARRIER_GRADE_NAT = ipaddress.IPv4Network("100.64.0.0/10")
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")
NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
# RFC 8215's local-use NAT64 prefix: where the IPv4 address sits inside depends on the operator's
# prefix length, so it cannot be checked; refused as a whole.
NAT64_LOCAL_USE = ipaddress.IPv6Network("64:ff9b:1::/48")
UNIQUE_LOCAL = ipaddress.IPv6Network("fc00::/7")
# Only digits, hex digits, x and dots: the spellings inet_aton reads as an IPv4 address
# (2130706433, 0x7f000001, 017700000001, 127.1), which the system resolver would accept too.
_NUMERIC_HOST = re.compile(r"[0-9a-fA-FxX.]+")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]


class FetchError(Exception):
    """The page could not be fetched; the message is fit to show the model."""


class Refused(FetchError):
    """The URL points somewhere web_fetch must not go."""


@dataclass(frozen=True, slots=True)
class Page:
    """A fetched page as text."""

    url: str           # after redirects
    title: str | None
    text: str
    content_type: str
    truncated: bool    # reading stopped at max_bytes
    bytes_read: int

    def for_model(self) -> str:
        """The text the model reads: title and address first, then whether it was cut, then the page."""
        head = [f"Title: {self.title}" if self.title else "Title: (none)", f"URL: {self.url}"]
        if self.truncated:
            head.append(f"[The page was cut after {self.bytes_read:,} bytes (FETCH_MAX_BYTES); the rest was not read.]")
        return "\n".join(head) + "\n\n" + (self.text.strip() or "(the page has no readable text)")


@dataclass(frozen=True, slots=True)
class Target:
    """One checked hop: the URL as given, its host and port, and the addresses we may connect to."""

    url: httpx.URL
    host: str
    port: int
    addresses: tuple[str, ...]


# --- Addresses ----------------------------------------------------------------------------------

def literal_address(host: str) -> Address | None:
    """The IP address a host spells, in any form the system resolver would read as one, or None."""
    bare = host.strip("[]")
    try:
        return ipaddress.ip_address(bare)
    except ValueError:
        pass
    if _NUMERIC_HOST.fullmatch(bare):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(bare))
        except OSError:
            return None
    return None


def embedded_ipv4(addr: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries and traffic to it reaches (mapped, compatible, 6to4, NAT64)."""
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr in IPV4_COMPATIBLE and int(addr) > 1:  # :: and ::1 are themselves, not IPv4 in disguise
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    if addr in SIX_TO_FOUR:
        return addr.sixtofour
    if addr in NAT64_WELL_KNOWN:
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


def refusal(addr: Address) -> str | None:
    """Why web_fetch must not connect to `addr`, or None for a public address."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.scope_id:
            return "a link-local address with a scope"
        if addr in NAT64_LOCAL_USE:
            return "a local-use NAT64 address"
        inner = embedded_ipv4(addr)
        if inner is not None:
            reason = _plain_refusal(inner)
            return f"{reason} (IPv4 {inner} inside IPv6)" if reason else None
    return _plain_refusal(addr)


def _plain_refusal(addr: Address) -> str | None:
    if addr.is_loopback:
        return "a loopback address"
    if addr.is_unspecified:
        return "an unspecified address"
    if addr.is_link_local:
        return "a link-local address"
    if addr.is_multicast:
        return "a multicast address"
    if isinstance(addr, ipaddress.IPv4Address) and addr in CARRIER_GRADE_NAT:
        return "a carrier-grade NAT address"
    if isinstance(addr, ipaddress.IPv6Address) and (addr in UNIQUE_LOCAL or addr.is_site_local):
        return "a unique-local address"
    if addr.is_private:
        return "a private address"
    if addr.is_reserved:
        return "a reserved address"
    if not addr.is_global:
        return "not a public address"
    return None


async def system_resolve(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for `host`, in its order, without duplicates."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise FetchError(f"the host {host} could not be resolved ({exc.strerror})") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


async def check(url: str | httpx.URL, resolve: Resolver, allow_hosts: Iterable[str] = ()) -> Target:
    """Parse and vet one URL: refuse anything but http(s) to public addresses (or an allowed host)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise Refused(f"not a valid URL ({exc})") from None
    if parsed.scheme not in ("http", "https"):
        raise Refused(f"only http and https addresses can be fetched, not {parsed.scheme or 'a relative address'}")
    host = parsed.raw_host.decode("ascii").lower()
    if not host:
        raise Refused("the address has no host")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    allowed = host in {h.lower() for h in allow_hosts}
    literal = literal_address(host)
    if literal is not None:
        addresses = [str(literal)]
    else:
        addresses = await resolve(host, port)
        if not addresses:
            raise FetchError(f"the host {host} has no addresses")
    if not allowed:
        for text in addresses:
            try:
                reason = refusal(ipaddress.ip_address(text))
            except ValueError:
                reason = "not an IP address"
            if reason:
                raise Refused(f"{host} is refused: {text} is {reason}; web_fetch reaches public addresses only")
    return Target(parsed, host, port, tuple(addresses))


# --- Fetching -----------------------------------------------------------------------------------

@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's own verifying context, built once: loading the CA bundle costs milliseconds per client."""
    return httpx.create_ssl_context(trust_env=False)


def pinned_request(client: httpx.AsyncClient, target: Target, address: str, accept: str = ACCEPT) -> httpx.Request:
    """A GET to `address` that still names the host: Host header, and for https the SNI and certificate name."""
    url = target.url.copy_with(host=address, fragment=None)
    headers = {"Host": target.url.netloc.decode("ascii"), "User-Agent": USER_AGENT, "Accept": accept}
    # httpcore uses sni_hostname as the TLS server_hostname, which is what the certificate is verified against.
    extensions = {"sni_hostname": target.host} if target.url.scheme == "https" else {}
    return client.build_request("GET", url, headers=headers, extensions=extensions)


async def _open(client: httpx.AsyncClient, target: Target, accept: str = ACCEPT) -> httpx.Response:
    """Connect to the first checked address that answers."""
    last: Exception | None = None
    for address in target.addresses:
        try:
            return await client.send(pinned_request(client, target, address, accept), stream=True)
        except httpx.ConnectError as exc:
            last = exc
    raise FetchError(f"could not connect to {target.host} ({type(last).__name__}: {last})")


async def _read_capped(response: httpx.Response, max_bytes: int) -> tuple[bytes, bool]:
    """The body up to `max_bytes` (decoded size, so a compressed bomb is capped too); whether it was cut."""
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        if size >= max_bytes:
            if chunk:
                return b"".join(chunks), True  # something follows the cap: cut, and stop reading
            continue
        chunks.append(chunk[:max_bytes - size])
        size += len(chunks[-1])
        if len(chunk) > len(chunks[-1]):
            return b"".join(chunks), True
    return b"".join(chunks), False


@dataclass(frozen=True, slots=True)
class Fetched:
    """One answer's bytes, fetched under the address rules, before anything reads them."""

    url: str  # after redirects
    body: bytes
    content_type: str  # as the server declared it, lower case, without parameters ("" when missing)
    charset: str | None
    truncated: bool  # reading stopped at max_bytes


async def fetch_bytes(url: str, *, max_bytes: int = DEFAULT_MAX_BYTES, timeout: float = 30.0,
                      allow_hosts: Iterable[str] = (), resolve: Resolver | None = None,
                      max_redirects: int = MAX_REDIRECTS, tls: ssl.SSLContext | None = None,
                      accept: str = ACCEPT) -> Fetched:
    """GET `url` under the rules in the module docstring: its bytes, at most `max_bytes` of them."""
    resolve = resolve or system_resolve
    allow = tuple(allow_hosts)
    current: str | httpx.URL = url.strip()
    # trust_env=False: a proxy from the environment would do its own DNS lookup, undoing the pinning.
    async with httpx.AsyncClient(timeout=timeout, trust_env=False, follow_redirects=False,
                                 verify=tls or _tls()) as client:
        for _ in range(max_redirects + 1):
            target = await check(current, resolve, allow)
            response = await _open(client, target, accept)
            try:
                location = response.headers.get("location")
                if response.status_code in REDIRECTS and location:
                    current = target.url.join(location)
                    continue
                if response.status_code >= 400:
                    raise FetchError(f"{target.host} answered HTTP {response.status_code}")
                body, truncated = await _read_capped(response, max_bytes)
                content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
                return Fetched(str(target.url), body, content_type, response.charset_encoding, truncated)
            finally:
                await response.aclose()
    raise FetchError(f"more than {max_redirects} redirects")


async def fetch(url: str, *, max_bytes: int = DEFAULT_MAX_BYTES, timeout: float = 30.0,
                allow_hosts: Iterable[str] = (), resolve: Resolver | None = None,
                max_redirects: int = MAX_REDIRECTS, tls: ssl.SSLContext | None = None,
                extractor: Extractor | None = None, person: str = "",
                pdf_max_pages: int = PDF_MAX_PAGES) -> Page:
    """Fetch `url` as text under the rules in the module docstring; `tls` replaces the system's trust store.

    A PDF is read by `extractor` in `person`'s turn (the server's, shared with uploads), or without
    one by a child under extraction.py's default limits.
    """
    got = await fetch_bytes(url, max_bytes=max_bytes, timeout=timeout, allow_hosts=allow_hosts, resolve=resolve,
                            max_redirects=max_redirects, tls=tls)
    return await _page(got.url, got.body, got.content_type, got.charset, got.truncated,
                       extractor or Extractor(), person, pdf_max_pages)


# The raster formats a browser shows by their first bytes. SVG is not among them: it is a document
# that can carry script, and it would be served from this site's own origin.
IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
               (b"GIF89a", "image/gif"))
IMAGE_ACCEPT = "image/png,image/jpeg,image/gif,image/webp;q=0.9"


def image_type(body: bytes) -> str | None:
    """The media type of a PNG, JPEG, GIF or WebP by its magic bytes (never by a declared type)."""
    if body[:4] == b"RIFF" and body[8:12] == b"WEBP":
        return "image/webp"
    return next((kind for magic, kind in IMAGE_MAGIC if body.startswith(magic)), None)


async def fetch_image(url: str, *, max_bytes: int = DEFAULT_MAX_BYTES, timeout: float = 30.0,
                      allow_hosts: Iterable[str] = (), resolve: Resolver | None = None) -> tuple[bytes, str]:
    """A whole raster image (bytes, media type read from them) under the same rules as a page."""
    got = await fetch_bytes(url, max_bytes=max_bytes, timeout=timeout, allow_hosts=allow_hosts, resolve=resolve,
                            accept=IMAGE_ACCEPT)
    if got.truncated:
        raise FetchError(f"the image is larger than {max_bytes:,} bytes (FETCH_MAX_BYTES)")
    kind = image_type(got.body)
    if kind is None:
        raise FetchError("that address is not a PNG, JPEG, GIF or WebP image")
    return got.body, kind


async def _page(url: str, body: bytes, content_type: str, charset: str | None, truncated: bool,
                extractor: Extractor, person: str, pdf_max_pages: int) -> Page:
    """Turn the bytes into readable text by their type, off the event loop (a PDF: out of the process)."""
    kind = content_type or _sniff(body)
    if kind == "application/pdf" or body.startswith(b"%PDF-"):
        if truncated:
            raise FetchError("the PDF is larger than FETCH_MAX_BYTES, and a cut PDF cannot be read")
        title, text = await read_pdf(body, extractor, person, pdf_max_pages)
        return Page(url, title, text, "application/pdf", False, len(body))
    if kind in ("text/html", "application/xhtml+xml"):
        title, text = await asyncio.to_thread(html_to_text, body, url)
        return Page(url, title, text, kind, truncated, len(body))
    if kind.startswith("text/") or kind in ("application/json", "application/xml") or kind.endswith(("+json", "+xml")):
        return Page(url, None, _decode(body, charset), kind, truncated, len(body))
    raise FetchError(f"cannot read content of type {kind or 'unknown'}")


def _sniff(body: bytes) -> str:
    head = body[:512].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")):
        return "text/html"
    return ""


def _decode(body: bytes, charset: str | None) -> str:
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:
        return body.decode("utf-8", errors="replace")


def html_to_text(html: bytes, url: str | None = None) -> tuple[str | None, str]:
    """(title, main text) of an HTML page: trafilatura's extraction, its whole-page text as a fallback."""
    import trafilatura  # heavy import, paid on the first fetch rather than at startup

    doc = trafilatura.bare_extraction(html, url=url, with_metadata=True, include_tables=True,
                                      include_links=False, include_images=False, favor_recall=True)
    title = (doc.title if doc else None) or _html_title(html)
    text = doc.text if doc is not None and doc.text else ""
    if not text.strip():
        text = trafilatura.html2txt(html) or ""
    return title, text


def _html_title(html: bytes) -> str | None:
    import lxml.html

    try:
        found = lxml.html.fromstring(html).findtext(".//title")
    except (ValueError, lxml.etree.ParserError):
        return None
    title = " ".join((found or "").split())
    return title or None


async def read_pdf(data: bytes, extractor: Extractor, person: str, max_pages: int) -> tuple[str | None, str]:
    """(title, text) of a PDF, page by page, read by the extractor's child from a private temp file."""
    fd, name = tempfile.mkstemp(prefix="web_fetch-", suffix=".pdf")  # 0600: only the server reads it
    path = Path(name)
    try:
        await asyncio.to_thread(_write_all, fd, data)
        async with extractor.turn(person):
            # The text may be twice the PDF's bytes, as for an upload; past that it is refused.
            read = await extractor.run(path, "fetched.pdf", max_pages=max_pages, max_chars=2 * len(data))
    except AttachmentError as exc:
        raise FetchError(f"the PDF could not be read: {exc}") from None
    finally:
        path.unlink(missing_ok=True)
    if read["kind"] != "pdf":
        raise FetchError("the PDF could not be read: the content is not a PDF")
    text = "\n\n".join(f"[page {p['page']}]\n{p['text'].strip()}" for p in read["pages"] if p["text"].strip())
    if read["total"] > len(read["pages"]):
        text += f"\n\n[Only the first {len(read['pages'])} of {read['total']} pages were read.]"
    return read["title"], text


def _write_all(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data)

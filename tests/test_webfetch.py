"""web_fetch's network rules, proven against real loopback servers: every non-public address form is
refused before any byte leaves, redirects are re-checked, the connection goes to the checked address,
reading stops at the cap, and HTML and PDF become text."""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path

import pytest
import trustme

from chatserver.tools import webfetch
from chatserver.tools.webfetch import FetchError, Refused
from pageserver import PageServer, endless

ARTICLE = (b"<!doctype html><html><head><title>Seoul weather notes</title></head><body>"
           b"<nav>Home | About | Login</nav><article><h1>Seoul weather notes</h1>"
           + b"<p>The monsoon season in Seoul usually starts in late June and brings heavy rain. </p>" * 8
           + b"</article><footer>Copyright nobody</footer></body></html>")


@pytest.fixture
def server():
    with PageServer() as s:
        s.routes["/"] = (200, {"Content-Type": "text/plain"}, b"secret admin page")
        s.routes["/secret"] = (200, {"Content-Type": "text/plain"}, b"secret admin page")
        yield s


class CountingResolver:
    """A resolver that answers from a table and counts its calls, by name."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        answers = self.answers[host]
        return answers[min(len(self.calls), len(answers)) - 1]


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:{port}/",
    "http://[::1]:{port}/",
    "http://10.0.0.1:{port}/",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::ffff:127.0.0.1]:{port}/",
    "http://0x7f000001:{port}/",
    "http://2130706433:{port}/",
    "http://017700000001:{port}/",
    "http://127.1:{port}/",
    "http://[64:ff9b::7f00:1]:{port}/",
    "http://[2002:7f00:1::]:{port}/",
    "http://100.64.0.1/",
    "http://[fd12::1]/",
    "http://0.0.0.0:{port}/",
])
async def test_non_public_addresses_are_refused_before_any_request(server, url):
    resolver = CountingResolver({})
    with pytest.raises(Refused, match="public addresses only"):
        await webfetch.fetch(url.format(port=server.port), timeout=5, resolve=resolver)
    assert server.seen == []
    assert resolver.calls == []  # a literal address is judged as written, never looked up


async def test_a_name_that_resolves_to_loopback_is_refused(server):
    with pytest.raises(Refused, match="localhost is refused: .* loopback"):
        await webfetch.fetch(server.url("/", host="localhost"), timeout=5)
    assert server.seen == []


async def test_any_non_public_address_among_several_refuses_the_name(server):
    resolver = CountingResolver({"mixed.test": [["93.184.216.34", "127.0.0.1"]]})
    with pytest.raises(Refused, match="127.0.0.1 is a loopback address"):
        await webfetch.fetch(f"http://mixed.test:{server.port}/", timeout=5, resolve=resolver)
    assert server.seen == []


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/x", "gopher://127.0.0.1:70/", "/relative"])
async def test_only_http_and_https(url):
    with pytest.raises(Refused, match="only http and https"):
        await webfetch.fetch(url, timeout=5)


async def test_an_allowed_host_that_redirects_to_loopback_is_refused_at_the_redirect(server):
    server.routes["/go"] = (302, {"Location": server.url("/secret", host="localhost")}, b"")
    with pytest.raises(Refused, match="localhost is refused"):
        await webfetch.fetch(server.url("/go"), timeout=5, allow_hosts=["127.0.0.1"])
    assert server.paths() == ["/go"]  # the redirect target was never requested


async def test_redirects_to_a_literal_private_address_are_refused(server):
    server.routes["/go"] = (301, {"Location": "http://[::ffff:10.0.0.1]/"}, b"")
    with pytest.raises(Refused, match="10.0.0.1"):
        await webfetch.fetch(server.url("/go"), timeout=5, allow_hosts=["127.0.0.1"])


async def test_an_allowed_host_is_fetched_and_html_becomes_text_with_its_title(server):
    server.routes["/article"] = (200, {"Content-Type": "text/html; charset=utf-8"}, ARTICLE)
    page = await webfetch.fetch(server.url("/article"), timeout=5, allow_hosts=["127.0.0.1"])
    assert page.title == "Seoul weather notes"
    assert "monsoon season in Seoul" in page.text
    assert "<p>" not in page.text and "Login" not in page.text  # markup and navigation are gone
    assert not page.truncated
    assert page.for_model().startswith(f"Title: Seoul weather notes\nURL: {server.url('/article')}\n\n")


async def test_relative_redirects_are_followed_on_the_allowed_host(server):
    server.routes["/old"] = (308, {"Location": "/new"}, b"")
    server.routes["/new"] = (200, {"Content-Type": "text/plain"}, b"moved here")
    page = await webfetch.fetch(server.url("/old"), timeout=5, allow_hosts=["127.0.0.1"])
    assert (page.url, page.text) == (server.url("/new"), "moved here")
    assert server.paths() == ["/old", "/new"]


async def test_more_than_five_redirects_stop(server):
    server.routes["/loop"] = (302, {"Location": "/loop"}, b"")
    with pytest.raises(FetchError, match="more than 5 redirects"):
        await webfetch.fetch(server.url("/loop"), timeout=5, allow_hosts=["127.0.0.1"])
    assert server.paths() == ["/loop"] * 6


async def test_reading_stops_at_max_bytes_even_on_an_endless_body(server):
    server.routes["/endless"] = endless
    page = await webfetch.fetch(server.url("/endless"), max_bytes=10_000, timeout=5, allow_hosts=["127.0.0.1"])
    assert page.truncated and page.bytes_read == 10_000
    assert page.text == "x" * 10_000
    assert "cut after 10,000 bytes (FETCH_MAX_BYTES)" in page.for_model()


async def test_a_body_exactly_at_the_cap_is_not_called_cut(server):
    server.routes["/exact"] = (200, {"Content-Type": "text/plain"}, b"y" * 5000)
    page = await webfetch.fetch(server.url("/exact"), max_bytes=5000, timeout=5, allow_hosts=["127.0.0.1"])
    assert (page.bytes_read, page.truncated) == (5000, False)


async def test_the_connection_goes_to_the_address_that_was_checked(server):
    # pinned.test exists only in this resolver: had the client looked the name up again itself, the
    # system resolver would have failed; and had it asked this one twice, the second answer (a
    # rebinding to an address nothing listens on) would have been used.
    resolver = CountingResolver({"pinned.test": [["127.0.0.1"], ["10.9.9.9"]]})
    server.routes["/page"] = (200, {"Content-Type": "text/plain"}, b"pinned")
    page = await webfetch.fetch(f"http://pinned.test:{server.port}/page", timeout=5,
                                allow_hosts=["pinned.test"], resolve=resolver)
    assert page.text == "pinned"
    assert resolver.calls == ["pinned.test"]
    assert server.seen[0].headers["host"] == f"pinned.test:{server.port}"


async def test_each_redirect_hop_is_looked_up_once(server):
    resolver = CountingResolver({"pinned.test": [["127.0.0.1"]]})
    server.routes["/a"] = (302, {"Location": "/b"}, b"")
    server.routes["/b"] = (200, {"Content-Type": "text/plain"}, b"arrived")
    page = await webfetch.fetch(f"http://pinned.test:{server.port}/a", timeout=5,
                                allow_hosts=["pinned.test"], resolve=resolver)
    assert page.text == "arrived"
    assert resolver.calls == ["pinned.test", "pinned.test"]


async def test_a_redirect_to_a_name_that_resolves_privately_is_refused(server):
    resolver = CountingResolver({"intranet.test": [["10.0.0.7"]]})
    server.routes["/hop"] = (302, {"Location": f"http://intranet.test:{server.port}/secret"}, b"")
    with pytest.raises(Refused, match="10.0.0.7 is a private address"):
        await webfetch.fetch(server.url("/hop"), timeout=5, allow_hosts=["127.0.0.1"], resolve=resolver)
    assert server.paths() == ["/hop"] and resolver.calls == ["intranet.test"]


def test_https_requests_carry_the_host_name_for_sni_and_certificate_checks():
    import httpx

    target = webfetch.Target(httpx.URL("https://example.com:8443/a?b=1#frag"), "example.com", 8443, ("93.184.216.34",))
    request = webfetch.pinned_request(httpx.AsyncClient(), target, "93.184.216.34")
    assert str(request.url) == "https://93.184.216.34:8443/a?b=1"
    assert request.headers["host"] == "example.com:8443"
    assert request.extensions["sni_hostname"] == "example.com"
    v6 = webfetch.pinned_request(httpx.AsyncClient(), target, "2606:2800:220:1::1")
    assert v6.url.host == "2606:2800:220:1::1" and str(v6.url).startswith("https://[2606:2800:220:1::1]:8443/")


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF whose page draws `text`, with a correct cross-reference table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for n, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (n, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


async def test_a_pdf_becomes_text(server):
    server.routes["/paper.pdf"] = (200, {"Content-Type": "application/pdf"}, minimal_pdf("Quarterly rainfall report"))
    page = await webfetch.fetch(server.url("/paper.pdf"), timeout=5, allow_hosts=["127.0.0.1"])
    assert page.content_type == "application/pdf"
    assert "Quarterly rainfall report" in page.text


async def test_a_pdf_cut_at_the_cap_is_an_error_not_garbage(server):
    server.routes["/big.pdf"] = (200, {"Content-Type": "application/pdf"}, minimal_pdf("x" * 400))
    with pytest.raises(FetchError, match="larger than FETCH_MAX_BYTES"):
        await webfetch.fetch(server.url("/big.pdf"), max_bytes=200, timeout=5, allow_hosts=["127.0.0.1"])


def peak_memory_reset() -> int:
    """Reset this process's VmHWM to what it holds now and return that, in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_kb()["VmHWM"]


def status_kb() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


async def test_a_fetched_pdf_bomb_is_a_tool_error_and_the_server_stays_small(server, tmp_path):
    from chatserver.attachments.extraction import Extractor
    from chatserver.config import Settings
    from chatserver.tools.registry import ToolContext, registry, tool_context
    from test_extraction import pdf_bomb

    server.routes["/bomb.pdf"] = (200, {"Content-Type": "application/pdf"}, pdf_bomb(with_font=True))
    server.routes["/paper.pdf"] = (200, {"Content-Type": "application/pdf"}, minimal_pdf("Quarterly rainfall report"))
    settings = Settings(_env_file=None, data_dir=tmp_path / "data", fetch_allow_hosts=["127.0.0.1"], tool_timeout=30)

    async def unused() -> str:
        return ""

    async def unused_write(text: str) -> None:
        pass

    ctx = ToolContext("conv-1", settings, unused, unused_write, owner="alice",
                      extractor=Extractor(max_mb=256, timeout=10))
    with tool_context(ctx):
        before = peak_memory_reset()
        bomb = await registry.run("web_fetch", {"url": server.url("/bomb.pdf")}, ["web_fetch"])
        grown = (status_kb()["VmHWM"] - before) // 1024
        paper = await registry.run("web_fetch", {"url": server.url("/paper.pdf")}, ["web_fetch"])
    assert grown < 64, f"the bomb took this process's peak {grown} MB above where it was"
    assert not bomb.ok
    assert bomb.text.startswith("[tool error] web_fetch: the PDF could not be read: reading the file needed more "
                                "than the 256 MB"), bomb.text
    assert paper.ok and "[page 1]\nQuarterly rainfall report" in paper.text, paper.text
    assert not list(Path(tempfile.gettempdir()).glob("web_fetch-*.pdf"))  # the temp files went with the reads


async def test_unreadable_types_and_http_errors_are_fetch_errors(server):
    server.routes["/img"] = (200, {"Content-Type": "image/png"}, b"\x89PNG\r\n")
    with pytest.raises(FetchError, match="cannot read content of type image/png"):
        await webfetch.fetch(server.url("/img"), timeout=5, allow_hosts=["127.0.0.1"])
    with pytest.raises(FetchError, match="answered HTTP 404"):
        await webfetch.fetch(server.url("/missing"), timeout=5, allow_hosts=["127.0.0.1"])


@pytest.mark.parametrize("certified_name, works", [("pinned.test", True), ("someone-else.test", False)])
async def test_https_to_the_pinned_address_verifies_the_certificate_against_the_host_name(certified_name, works):
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(certified_name).configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    resolver = CountingResolver({"pinned.test": [["127.0.0.1"]]})
    with PageServer(tls=server_tls) as server:
        server.routes["/"] = (200, {"Content-Type": "text/plain"}, b"over tls")
        url = f"https://pinned.test:{server.port}/"
        if works:
            # The certificate names pinned.test and not 127.0.0.1: this only verifies if the
            # name, not the address we connected to, is what the certificate is checked against.
            page = await webfetch.fetch(url, timeout=5, allow_hosts=["pinned.test"], resolve=resolver, tls=client_tls)
            assert page.text == "over tls"
        else:
            with pytest.raises(FetchError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
                await webfetch.fetch(url, timeout=5, allow_hosts=["pinned.test"], resolve=resolver, tls=client_tls)
            assert server.seen == []

"""A real HTTP server on loopback serving scripted routes, recording every request it got."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Seen:
    path: str
    headers: dict[str, str]


Route = tuple[int, dict[str, str], bytes] | Callable[[BaseHTTPRequestHandler], None]


class PageServer:
    """`routes[path]` is (status, headers, body) or a function writing the response itself."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.scheme = "https" if tls else "http"
        self.routes: dict[str, Route] = {}
        self.seen: list[Seen] = []
        self.release = threading.Event()  # routes that hang wait for this; set at stop
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server.seen.append(Seen(self.path, {k.lower(): v for k, v in self.headers.items()}))
                route = server.routes.get(self.path.split("?")[0])
                if route is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if callable(route):
                    route(self)
                    return
                status, headers, body = route
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        if tls is not None:
            self._httpd.socket = tls.wrap_socket(self._httpd.socket, server_side=True)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,), daemon=True)

    def url(self, path: str = "/", host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]

    def __enter__(self) -> PageServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()


def endless(handler: BaseHTTPRequestHandler) -> None:
    """A text body that never ends: chunked, written until the client goes away."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/plain; charset=utf-8")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    piece = b"x" * 4096
    try:
        while True:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
    except OSError:
        pass


def hanging(server: PageServer) -> Callable[[BaseHTTPRequestHandler], None]:
    """A route that sends nothing until the server stops."""
    def route(handler: BaseHTTPRequestHandler) -> None:
        server.release.wait(30)
    return route

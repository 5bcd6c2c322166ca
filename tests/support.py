"""Helpers shared by the test suites (fixtures live in conftest.py files)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from chatserver.app import create_app
from chatserver.config import Settings

ROOT = Path(__file__).resolve().parent.parent


def parse_sse(text: str) -> list[tuple[str, dict]]:
    """(event, data) pairs of a whole SSE body, pings and comments skipped."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            out.append((name, json.loads("\n".join(data))))
    return out


def names(events: list[tuple[str, dict]]) -> list[str]:
    return [name for name, _ in events]


class Api:
    """Small verbs over the HTTP contract, so tests read as what a person does."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def new(self, **body) -> dict:
        response = await self.client.post("/api/conversations", json=body)
        assert response.status_code == 201, response.text
        return response.json()

    async def get(self, conv_id: str) -> dict:
        response = await self.client.get(f"/api/conversations/{conv_id}")
        assert response.status_code == 200, response.text
        return response.json()

    async def send(self, conv_id: str, content: str) -> list[tuple[str, dict]]:
        response = await self.client.post(f"/api/conversations/{conv_id}/messages", json={"content": content})
        assert response.status_code == 200, response.text
        return parse_sse(response.text)

    async def regenerate(self, conv_id: str) -> list[tuple[str, dict]]:
        response = await self.client.post(f"/api/conversations/{conv_id}/regenerate", json={})
        assert response.status_code == 200, response.text
        return parse_sse(response.text)

    async def patch(self, conv_id: str, **body) -> dict:
        response = await self.client.patch(f"/api/conversations/{conv_id}", json=body)
        assert response.status_code == 200, response.text
        return response.json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hang_up_after_first_delta(base_url: str, conv_id: str) -> float:
    """Start a turn, read to its first delta and hang up, as Stop does; returns when we hung up."""
    with httpx.stream("POST", f"{base_url}/api/conversations/{conv_id}/messages",
                      json={"content": "tell me a long story"}, timeout=10) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: delta"):
                break
        return time.monotonic()


class LiveServer:
    """`python -m uvicorn server:app` in a child process, as a person runs it.

    `launch`, when given, is Python source run instead, with the port as its first argument.
    """

    def __init__(self, data_dir: Path, env: dict[str, str], launch: str | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        inherited = {k: v for k, v in os.environ.items() if k != "ACCESS_TOKEN"}
        full_env = {**inherited, "DATA_DIR": str(data_dir), "UPSTREAM_TIMEOUT": "5", **env}
        self.log_path = data_dir.parent / f"server-{self.port}.log"
        self._log = open(self.log_path, "wb")
        command = ["-c", launch, str(self.port)] if launch else [
            "-m", "uvicorn", "server:app", "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self.process = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=full_env,
                                        stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        # A bound, not an estimate: a server with S3 and Redis to reach starts in about 2 s, but a
        # shared 2-core machine under a whole test run has taken over 20.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"server did not start within 60 s: {self.log()[-3000:]}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


@contextlib.asynccontextmanager
async def serve(settings: Settings):
    """The real app over ASGI, with its lifespan, under the given settings."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
            yield app, client


def png(width: int, height: int, color: str = "red") -> bytes:
    """A PNG of one colour, made with Pillow."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


class PixelServer:
    """A real HTTP server on loopback answering every GET with one body (a 3×2 PNG unless changed),
    counting every request it gets."""

    def __init__(self) -> None:
        self.png = png(3, 2, "blue")
        self.content_type = "image/png"
        self.requests: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                owner.requests.append({"path": self.path, "user_agent": self.headers.get("User-Agent", "")})
                self.send_response(200)
                self.send_header("Content-Type", owner.content_type)
                self.send_header("Content-Length", str(len(owner.png)))
                self.end_headers()
                self.wfile.write(owner.png)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

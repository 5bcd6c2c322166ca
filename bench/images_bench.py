"""Images benchmark (issue 25): 20 uploads of a 12-megapixel JPEG arriving together at one server.

Each upload is a phone-sized photo (4000 x 3000, EXIF with GPS and camera, about 4 MB), sent at
the same instant by 20 clients. The server streams each body to a temporary file, then reads the
files one at a time per person in the limited child (`EXTRACT_WORKERS` at once across people),
which checks the size against MAX_IMAGE_PIXELS, strips the metadata and writes the clean copy.

Writes bench/results_images.json and prints it:
- `images_server_rss_base_mb`: the server's resident memory after one warm-up upload;
  `images_server_rss_peak_added_mb`: its peak over that base while the 20 arrive and are read,
  sampled every 5 ms from /proc (the server process only). Decoding a 12-megapixel image takes
  36 MB for its pixels alone, so 20 decoded in the server would add hundreds of MB; streamed to
  disk and decoded in children, the server's own memory stays flat.
- `images_child_rss_peak_mb`: the largest resident memory of one reading child seen meanwhile
  (each is capped at EXTRACT_MAX_MB); `images_children_rss_peak_sum_mb`: the most all children
  held at one sampled instant.
- `images_wall_s`: from the first byte sent to the last answer; `images_answered_201` (and
  `_429`): the answers by status; `images_upload_s_p50` / `_max`: per stored upload, at the client.
- Run twice: with EXTRACT_QUEUE=32 (`images_*`: every upload waits its turn and is stored) and
  with the default EXTRACT_QUEUE=8 (`images_defaultqueue_*`: uploads past the queue are 429 at
  once, which is what a person sees; the page says "try again in a moment").
- `images_thumbnail_first_s` / `images_thumbnail_cached_s`: one thumbnail drawn from the stored
  12-megapixel image, then served from the blob store.

Takes about a minute. `.venv/bin/python bench/images_bench.py`
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import run as bench_run  # noqa: E402  (bench/ is on sys.path as the script's directory)
from s3_bench import rss_mb  # noqa: E402

UPLOADS = 20
SIZE = (4000, 3000)  # 12 megapixels
SAMPLE_SECONDS = 0.005


def make_photo() -> bytes:
    """A 12-megapixel JPEG with a phone's EXIF (GPS, camera): smooth gradients under fine noise, so
    it compresses like a photo (a few MB) rather than like a flat colour."""
    from PIL import ExifTags, Image

    width, height = SIZE
    noise = Image.frombytes("L", (width // 4, height // 4), os.urandom(width * height // 16)).resize(SIZE)
    gradient = Image.linear_gradient("L").resize(SIZE)
    photo = Image.merge("RGB", (gradient, noise, gradient.rotate(180)))
    exif = Image.Exif()
    exif[ExifTags.Base.Make], exif[ExifTags.Base.Model] = "Canon", "EOS 5D Mark IV"
    exif[ExifTags.IFD.GPSInfo] = {1: "N", 2: (52.0, 22.0, 12.5), 3: "E", 4: (4.0, 53.0, 1.0)}
    out = io.BytesIO()
    photo.save(out, format="JPEG", quality=90, exif=exif)
    return out.getvalue()


def children_rss_mb(pid: int) -> list[float]:
    """The resident memory of each child process of `pid` (the file readers)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            try:
                out.append(rss_mb(int(kid)))
            except (OSError, AttributeError):
                continue  # ended between the listing and the read
    return out


class Watch:
    """Peaks of the server's own memory and of its children's, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.server = self.child = self.children = 0.0
        self._done = threading.Event()

    def _sample(self) -> None:
        self.server = max(self.server, rss_mb(self.pid))
        kids = children_rss_mb(self.pid)
        if kids:
            self.child = max(self.child, max(kids))
            self.children = max(self.children, sum(kids))

    def _run(self) -> None:
        while not self._done.is_set():
            self._sample()
            self._done.wait(SAMPLE_SECONDS)

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join()
        self._sample()


def burst(server: bench_run.Service, photo: bytes) -> dict:
    with httpx.Client(base_url=server.url, timeout=300) as client:
        conv = client.post("/api/conversations", json={}).json()["id"]
        url = f"/api/conversations/{conv}/attachments"
        warm = client.post(url, files={"file": ("warm.jpg", photo, "image/jpeg")})
        assert warm.status_code == 201, warm.text
        time.sleep(0.5)  # let the warm-up's garbage settle before the base is read (not a wait for an event)
        base = rss_mb(server.proc.pid)
        start = threading.Barrier(UPLOADS)

        def one(n: int) -> tuple[int, float]:
            with httpx.Client(base_url=server.url, timeout=300) as own:
                start.wait()
                began = time.perf_counter()
                answer = own.post(url, files={"file": (f"IMG_{n:04}.jpg", photo, "image/jpeg")})
                return answer.status_code, time.perf_counter() - began

        with Watch(server.proc.pid) as watch, ThreadPoolExecutor(UPLOADS) as pool:
            began = time.perf_counter()
            answers = list(pool.map(one, range(UPLOADS)))
            wall = time.perf_counter() - began
        stored = [a for a in client.get(url).json() if a["name"].startswith("IMG_")]
        times = [seconds for status, seconds in answers if status == 201]
        out = {
            "server_rss_base_mb": round(base, 1), "server_rss_peak_added_mb": round(watch.server - base, 1),
            "child_rss_peak_mb": round(watch.child, 1), "children_rss_peak_sum_mb": round(watch.children, 1),
            "wall_s": round(wall, 2), **{f"answered_{s}": n for s, n in sorted(Counter(s for s, _ in answers).items())},
            "stored": len(stored),
            "upload_s_p50": round(statistics.median(times), 2) if times else None,
            "upload_s_max": round(max(times), 2) if times else None,
        }
        if stored:
            thumb = f"{url}/{stored[0]['id']}/thumbnail"
            began = time.perf_counter()
            assert client.get(thumb).status_code == 200
            out["thumbnail_first_s"] = round(time.perf_counter() - began, 3)
            began = time.perf_counter()
            assert client.get(thumb).status_code == 200
            out["thumbnail_cached_s"] = round(time.perf_counter() - began, 3)
        return out


def main() -> dict:
    photo = make_photo()
    results: dict = {"images_photo_mb": round(len(photo) / 2**20, 2), "images_uploads": UPLOADS,
                     "images_megapixels": SIZE[0] * SIZE[1] / 1e6}
    with tempfile.TemporaryDirectory(prefix="chat-images-bench-") as tmp:
        work = Path(tmp)
        gw = bench_run.Gateway()
        try:
            for prefix, settings in (("images", {"EXTRACT_QUEUE": "32"}), ("images_defaultqueue", {})):
                server = bench_run.start_server(gw, work / f"data-{prefix}", work, settings=settings)
                try:
                    results.update({f"{prefix}_{k}": v for k, v in burst(server, photo).items()})
                finally:
                    server.stop()
        finally:
            gw.stop()
    (BENCH / "results_images.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))

"""Vision benchmark: what a 12-megapixel JPEG adds to a turn's time to first token.

The server runs as a person runs it (`uvicorn server:app` in a process of its own, tests'
LiveServer) against the simulator on loopback, with a model the simulator lists as seeing
images. Each pair of turns, in alternating order, is one turn carrying a freshly uploaded 4000 x
3000 JPEG (a new conversation and a new file each time, so its scaling to IMAGE_MAX_EDGE is
included: nothing is cached) and the same turn without it. Time to first token is read at the
client, from the POST to the first `delta` event of the stream; the simulator answers every
request at once with the same short reply. The server's CPU time per turn (user + system of the
process and of the child that scales the image, from /proc) is measured beside it, since the
machine is shared and wall time there mostly measures the other load.

Prints one JSON object and writes bench/results_images_vision.json:
- `vision_ttft_ms_p50_text` / `_image`, `vision_ttft_added_ms_p50` (and p90): wall time.
- `vision_turn_cpu_ms_p50_text` / `_image`, `vision_turn_cpu_added_ms_p50`: the server's CPU time,
  its children's included.
- `vision_jpeg_bytes`, `vision_sent_image_bytes` (the scaled image as the model receives it),
  `vision_sent_edge`: what went upstream.

    .venv/bin/python bench/vision_bench.py [pairs]
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gateway_sim.simulator import GatewaySimulator, Script, steps  # noqa: E402
from support import LiveServer  # noqa: E402

PAIRS = 10
WARMUP = 2
MODEL = "openai/gpt-5-mini"  # listed by the simulator with image input
RESULTS = Path(__file__).resolve().parent / "results_images_vision.json"
TICKS = os.sysconf("SC_CLK_TCK")


def photo() -> bytes:
    """A 12-megapixel JPEG with a photo's texture (gradients and grain), about as large as a phone's."""
    from PIL import Image

    size = (4000, 3000)
    gradient = Image.linear_gradient("L").resize(size)
    grain = Image.effect_noise(size, 24)
    across = gradient.transpose(Image.Transpose.ROTATE_90).resize(size)
    image = Image.merge("RGB", (gradient, Image.blend(grain, across, 0.6), across))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def cpu_seconds(pid: int) -> float:
    """The process's CPU time, its finished children's included (the image is scaled in one)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICKS  # utime, stime, cutime, cstime


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def turn(client: httpx.Client, server: LiveServer, sim: GatewaySimulator, jpeg: bytes | None) -> tuple[float, float]:
    """(ms to the first delta, server CPU ms) of one turn in a new conversation, with or without the photo."""
    conv = client.post("/api/conversations", json={"model": MODEL}).json()["id"]
    client.patch(f"/api/conversations/{conv}", json={"settings": {"web_search": False, "web_fetch": False}})
    body: dict = {"content": "What does this show?"}
    if jpeg is not None:
        uploaded = client.post(f"/api/conversations/{conv}/attachments",
                               files={"file": ("photo.jpg", jpeg, "application/octet-stream")})
        assert uploaded.status_code == 201, uploaded.text
        body["attachment_ids"] = [uploaded.json()["id"]]
    sim.enqueue(Script([steps.Text("A photo.")]))
    cpu = cpu_seconds(server.process.pid)
    started = time.perf_counter()
    first = None
    with client.stream("POST", f"/api/conversations/{conv}/messages", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if first is None and line.startswith("event: delta"):
                first = (time.perf_counter() - started) * 1000
    assert first is not None, "no delta arrived"
    return first, (cpu_seconds(server.process.pid) - cpu) * 1000


def measure(pairs: int) -> dict:
    jpeg = photo()
    with GatewaySimulator(keep_requests=8) as sim, tempfile.TemporaryDirectory() as tmp:
        server = LiveServer(Path(tmp) / "data", {"GATEWAY_BASE_URL": sim.base_url, "AUTO_TITLE": "false"})
        try:
            with httpx.Client(base_url=server.base_url, timeout=120) as client:
                times: dict[str, list[float]] = {"text": [], "image": []}
                cpu: dict[str, list[float]] = {"text": [], "image": []}
                for n in range(pairs + WARMUP):
                    # Alternating which goes first, so drift on a shared machine falls on both.
                    order = ("image", "text") if n % 2 else ("text", "image")
                    for kind in order:
                        ms, used = turn(client, server, sim, jpeg if kind == "image" else None)
                        if n >= WARMUP:
                            times[kind].append(ms)
                            cpu[kind].append(used)
                        if kind == "image":
                            (sent,) = sim.requests[-1].images
        finally:
            server.stop()
    added = [i - t for i, t in zip(times["image"], times["text"])]
    added_cpu = [i - t for i, t in zip(cpu["image"], cpu["text"])]
    return {
        "vision_ttft_ms_p50_text": round(statistics.median(times["text"]), 1),
        "vision_ttft_ms_p50_image": round(statistics.median(times["image"]), 1),
        "vision_ttft_added_ms_p50": round(statistics.median(added), 1),
        "vision_ttft_added_ms_p90": round(pct(added, 0.9), 1),
        "vision_turn_cpu_ms_p50_text": round(statistics.median(cpu["text"]), 1),
        "vision_turn_cpu_ms_p50_image": round(statistics.median(cpu["image"]), 1),
        "vision_turn_cpu_added_ms_p50": round(statistics.median(added_cpu), 1),
        "vision_pairs": len(added),
        "vision_jpeg_bytes": len(jpeg),
        "vision_sent_image_bytes": sent.bytes,
        "vision_sent_edge": max(sent.width, sent.height),
    }


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else PAIRS
    results = measure(pairs)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

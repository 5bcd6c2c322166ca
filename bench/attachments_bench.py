"""Attachment benchmark: ingest rate of a generated 300-page PDF, search latency over 10,000 passages.

Prints one JSON object:
- `ingest_pages_per_s`: the whole upload path after the bytes arrived (type detection, text
  extraction in the worker thread, writing meta/pages/original), with `raw_pdfium_pages_per_s`
  and `raw_pypdf_pages_per_s`, the libraries' own rates on the same file in the same run, beside it.
- `event_loop_lag_p99_ms_while_ingesting`: how late a 5 ms timer fires on the event loop while that
  PDF is ingested in this process.
- `attachment_search_p50_ms` / `_p99_ms`: `search_attachments` over 10,000 passages, index built.
- `stream_gap_p99_ms_while_ingesting` (unless `--streams 0`): the server run as `make run` runs it
  (`bench/run.py`'s helpers: simulator and server in processes of their own) holds 50 streams at
  20 tokens/s while the same PDF is uploaded to it; the gap is the time between consecutive
  `delta` events of one stream at the client, over the gaps ending while the upload was in
  flight, with the gaps before it (`stream_gap_p99_ms_before`) as the baseline.

Takes under a minute on an idle machine.

    .venv/bin/python bench/attachments_bench.py [--streams 50]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chatserver.attachments import store as att  # noqa: E402

STREAM_REPLY = {"words": 200, "delay": 0.05}  # 20 tokens/s for ten seconds, the upload lands inside

PAGES = 300
PASSAGES = 10_000
QUERIES = 300
SEED = 7
WORDS = ("revenue growth quarter market analysis customer product service region forecast risk budget "
         "team project delivery cost margin warranty centrifuge contract supplier audit policy travel "
         "hiring training security parking cafeteria board policy invoice payment schedule design").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(400)) for _ in range(n))


def make_pdf(rng: random.Random) -> bytes:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=10)
    for page in range(PAGES):
        pdf.add_page()
        pdf.multi_cell(0, 5, f"Page {page + 1}. {words(rng, 350)}")
    return bytes(pdf.output())


def raw_rates(data: bytes) -> tuple[float, float]:
    import pypdf
    import pypdfium2

    start = time.perf_counter()
    doc = pypdfium2.PdfDocument(data)
    for index in range(len(doc)):
        page = doc[index]
        textpage = page.get_textpage()
        textpage.get_text_bounded()
        textpage.close()
        page.close()
    pdfium = PAGES / (time.perf_counter() - start)
    start = time.perf_counter()
    for page in pypdf.PdfReader(io.BytesIO(data)).pages:
        page.extract_text()
    return pdfium, PAGES / (time.perf_counter() - start)


async def lag_while(job) -> tuple[object, list[float]]:
    """Run `job` while a 5 ms timer records how late each of its wake-ups is."""
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append((time.perf_counter() - before - 0.005) * 1000)

    tick = asyncio.create_task(ticker())
    try:
        return await job, lags
    finally:
        done.set()
        await tick


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 2)


async def gaps_while_uploading(base_url: str, data: bytes, streams: int) -> dict:
    """Hold `streams` turns open, upload the PDF once all of them stream, and split their gaps."""
    import httpx

    limits = httpx.Limits(max_connections=streams + 5)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        ids = [(await client.post("/api/conversations", json={})).json()["id"] for _ in range(streams + 1)]
        gaps: list[tuple[float, float]] = []
        streaming = 0
        all_streaming = asyncio.Event()

        async def hold(conv_id: str) -> None:
            nonlocal streaming
            last = None
            async with client.stream("POST", f"/api/conversations/{conv_id}/messages",
                                     json={"content": "tell me a long story"}) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("event: delta"):
                        continue
                    now = time.monotonic()
                    if last is None:
                        streaming += 1
                        if streaming == streams:
                            all_streaming.set()
                    else:
                        gaps.append((now, (now - last) * 1000))
                    last = now

        holders = [asyncio.create_task(hold(conv_id)) for conv_id in ids[:streams]]
        try:
            await asyncio.wait_for(all_streaming.wait(), 60)
            windows = []
            for _ in range(2):  # the first upload also loads pdfium into the server
                began = time.monotonic()
                response = await client.post(f"/api/conversations/{ids[-1]}/attachments",
                                             files={"file": ("report.pdf", data, "application/pdf")})
                windows.append((began, time.monotonic()))
                if response.status_code != 201:
                    raise RuntimeError(f"the upload failed: {response.status_code} {response.text}")
        finally:
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
    out = {"stream_gap_p99_ms_before": percentile([g for t, g in gaps if t < windows[0][0]], 0.99)}
    for label, (began, ended) in zip(("first", "second"), windows):
        during = [g for t, g in gaps if began <= t <= ended]
        out[f"stream_upload_s_{label}"] = round(ended - began, 2)
        out[f"stream_gap_p99_ms_while_ingesting_{label}"] = percentile(during, 0.99)
        out[f"stream_gap_max_ms_while_ingesting_{label}"] = round(max(during), 2) if during else None
    return out


def with_server(data: bytes, streams: int) -> dict:
    """Simulator and server in processes of their own (bench/run.py's), then the stream phase."""
    import run as bench_run  # bench/ is on sys.path as the script's directory

    gw = bench_run.Gateway()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gw.script(STREAM_REPLY, streams)
            server = bench_run.start_server(gw, Path(tmp) / "data", Path(tmp))
            try:
                bench_run.Quiet.wait()
                return asyncio.run(gaps_while_uploading(server.url, data, streams))
            finally:
                server.stop()  # before its data directory goes
    finally:
        gw.stop()


async def main(data: bytes) -> dict:
    rng = random.Random(SEED + 1)
    pdfium_rate, pypdf_rate = raw_rates(data)
    with tempfile.TemporaryDirectory() as tmp:
        store = att.Attachments(Path(tmp) / "attachments", Path(tmp) / "index")
        scope = att.conversation_scope("benchconversation")
        upload = Path(tmp) / "report.pdf"
        upload.write_bytes(data)
        start = time.perf_counter()
        _, lags = await lag_while(store.ingest(scope, "report.pdf", upload, "bench"))
        ingest_rate = PAGES / (time.perf_counter() - start)

        # Text files of 900-character lines: four make a section, and each is one passage.
        corpus = att.conversation_scope("benchcorpus00")
        per_file = 2000
        for number in range(PASSAGES // per_file):
            text = "\n".join(words(rng, 120)[:900].rsplit(" ", 1)[0] for _ in range(per_file))
            path = Path(tmp) / f"corpus{number}.txt"
            path.write_text(text, encoding="utf-8")
            await store.ingest(corpus, path.name, path, "bench")
        with att.attachment_context(store, "benchcorpus00", "local"):
            start = time.perf_counter()
            await store.search(att.attachment_scope.get().scopes, "warmup")
            build_s = time.perf_counter() - start
            await att.search_attachments("warmup")
            times = []
            for _ in range(QUERIES):
                query = " ".join(rng.choice(WORDS) + str(rng.randrange(400)) for _ in range(4))
                start = time.perf_counter()
                await att.search_attachments(query)
                times.append((time.perf_counter() - start) * 1000)
        times.sort()
        await store.close()
    return {
        "ingest_pages_per_s": round(ingest_rate),
        "raw_pdfium_pages_per_s": round(pdfium_rate),
        "raw_pypdf_pages_per_s": round(pypdf_rate),
        "event_loop_lag_p99_ms_while_ingesting": round(statistics.quantiles(lags, n=100)[98], 2),
        "attachment_passages": PASSAGES,
        "attachment_index_build_s": round(build_s, 2),
        "attachment_search_p50_ms": round(times[len(times) // 2], 3),
        "attachment_search_p99_ms": round(times[int(len(times) * 0.99)], 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--streams", type=int, default=50, help="streams held open during the upload; 0 skips")
    args = parser.parse_args()
    pdf = make_pdf(random.Random(SEED))
    results = asyncio.run(main(pdf))
    if args.streams:
        results.update(with_server(pdf, args.streams))
    print(json.dumps(results, indent=2))

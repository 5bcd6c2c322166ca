"""Attachment benchmark: ingest rate of a generated 300-page PDF, search latency over 10,000 passages.

Prints one JSON object:
- `ingest_pages_per_s`: the whole upload path after the bytes arrived (type detection, text
  extraction in the worker thread, writing meta/pages/original), with `raw_pdfium_pages_per_s`
  and `raw_pypdf_pages_per_s`, the libraries' own rates on the same file in the same run, beside it.
- `event_loop_lag_p99_ms_while_ingesting`: how late a 5 ms timer fires on the event loop while that
  PDF is ingested, a proxy for the stream gap (the 50-stream measurement belongs to the load bench).
- `attachment_search_p50_ms` / `_p99_ms`: `search_attachments` over 10,000 passages, index built.

It measures this module on this machine, not a network path. Takes a few seconds.

    .venv/bin/python bench/attachments_bench.py
"""

from __future__ import annotations

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

import attachments as att  # noqa: E402

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


async def main() -> None:
    rng = random.Random(SEED)
    data = make_pdf(rng)
    pdfium_rate, pypdf_rate = raw_rates(data)
    with tempfile.TemporaryDirectory() as tmp:
        store = att.Attachments(Path(tmp) / "attachments")
        scope = att.conversation_scope("benchconversation")
        upload = Path(tmp) / "report.pdf"
        upload.write_bytes(data)
        start = time.perf_counter()
        _, lags = await lag_while(store.ingest(scope, "report.pdf", upload))
        ingest_rate = PAGES / (time.perf_counter() - start)

        # Text files of 900-character lines: four make a section, and each is one passage.
        corpus = att.conversation_scope("benchcorpus00")
        per_file = 2000
        for number in range(PASSAGES // per_file):
            text = "\n".join(words(rng, 120)[:900].rsplit(" ", 1)[0] for _ in range(per_file))
            path = Path(tmp) / f"corpus{number}.txt"
            path.write_text(text, encoding="utf-8")
            await store.ingest(corpus, path.name, path)
        with att.attachment_context(store, "benchcorpus00", "local"):
            start = time.perf_counter()
            index = await store.index(att.attachment_scope.get().scopes)
            build_s = time.perf_counter() - start
            await att.search_attachments("warmup")
            times = []
            for _ in range(QUERIES):
                query = " ".join(rng.choice(WORDS) + str(rng.randrange(400)) for _ in range(4))
                start = time.perf_counter()
                await att.search_attachments(query)
                times.append((time.perf_counter() - start) * 1000)
        times.sort()
        store.close()
    print(json.dumps({
        "ingest_pages_per_s": round(ingest_rate),
        "raw_pdfium_pages_per_s": round(pdfium_rate),
        "raw_pypdf_pages_per_s": round(pypdf_rate),
        "event_loop_lag_p99_ms_while_ingesting": round(statistics.quantiles(lags, n=100)[98], 2),
        "attachment_passages": len(index.passages),
        "attachment_index_build_s": round(build_s, 2),
        "attachment_search_p50_ms": round(times[len(times) // 2], 3),
        "attachment_search_p99_ms": round(times[int(len(times) * 0.99)], 3),
    }, indent=2))


if __name__ == "__main__":
    asyncio.run(main())

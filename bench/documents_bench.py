"""Document reading benchmark over the corpus of real files (tests/fixtures/documents).

Each file goes through the server's own path, `Extractor.run` (a child process under the usual
memory and time limits), and its text is compared with the file's reference text (see
tests/corpus.py: poppler's pdftotext for PDFs, the package XML's own text for Office files).

Prints one JSON object:
- `accepted_with_text`: the share of files whose reference has text that the server accepted with
  text (aim: at least 0.99), and `refused`: the others with the reason given.
- `coverage_median`, `coverage_p10`: over those files, the share of the reference's tokens the
  server's text holds (aim: at least 0.98 and 0.9); `coverage` per file.
- `pages_per_s` / `raw_pdfium_pages_per_s`: the PDF reader in process (text, annotations, form
  fields, CJK spacing) against pypdfium2's bare `get_text_bounded` loop, on a generated 300-page
  PDF and on the corpus's PDFs.
- `child_peak_rss_mb` (the largest child's peak over the run) against `server_peak_rss_mb` (this
  process's peak: it holds the Extractor and every answer, as the server does).
- With `--baseline REV`: the same figures for the extraction.py of git revision REV (a single file
  then, run as its own child), for a before/after comparison.

    .venv/bin/python bench/documents_bench.py [--baseline 3d9ac80]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import orjson  # noqa: E402

import corpus  # noqa: E402
from chatserver.attachments.extraction import AttachmentError, Extractor  # noqa: E402
from chatserver.attachments.readers.common import Budget  # noqa: E402

MAX_CHARS = 40 * 2**20
MAX_PAGES = 1000


async def read_all(names: list[str], child: Path | None) -> dict[str, dict]:
    """Each file's answer: {"text"} or {"error"}, through the server's Extractor (or an old child)."""
    extractor = Extractor(timeout=30)
    out = {}
    for name in names:
        path = corpus.ROOT / name
        try:
            if child is None:
                answer = await extractor.run(path, name, max_pages=MAX_PAGES, max_chars=MAX_CHARS)
            else:
                answer = old_child(child, path, name)
            out[name] = {"text": "\n".join(p["text"] for p in answer["pages"]), "warnings": answer.get("warnings", [])}
        except AttachmentError as exc:
            out[name] = {"error": str(exc)}
    return out


def old_child(child: Path, path: Path, name: str) -> dict:
    request = {"path": str(path), "name": name, "max_pages": MAX_PAGES, "max_chars": MAX_CHARS, "max_mb": 512,
               "cpu_seconds": 32}
    done = subprocess.run([sys.executable, "-E", "-s", str(child)], input=orjson.dumps(request),
                          capture_output=True, cwd=child.parent, timeout=60, env={})
    answer = orjson.loads(done.stdout) if done.stdout else {"status": 422, "error": "crashed"}
    if "error" in answer:
        raise AttachmentError(answer["error"])
    return answer


def summary(answers: dict[str, dict]) -> dict:
    scores, refused = {}, {}
    for name, answer in answers.items():
        reference = corpus.reference_path(name).read_text()
        if not corpus.tokens(reference):
            continue
        if "error" in answer:
            refused[name] = answer["error"]
            scores[name] = 0.0
        else:
            scores[name] = round(corpus.coverage(reference, answer["text"]), 4)
    values = sorted(scores.values())
    return {
        "files": len(scores),
        "accepted_with_text": round(1 - len(refused) / len(scores), 4),
        "coverage_median": round(statistics.median(values), 4),
        "coverage_p10": round(values[max(0, int(len(values) * 0.1) - 1)] if len(values) < 10
                              else statistics.quantiles(values, n=10)[0], 4),
        "coverage_mean": round(statistics.fmean(values), 4),
        "refused": refused,
        "coverage": dict(sorted(scores.items(), key=lambda kv: kv[1])),
    }


def generated_pdf() -> bytes:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=10)
    for page in range(300):
        pdf.add_page()
        pdf.multi_cell(0, 5, " ".join(f"word{(page * 400 + i) % 997}" for i in range(400)))
    return bytes(pdf.output())


def pages_per_second(paths: list[Path]) -> dict:
    """Our PDF reader in process against pypdfium2's bare text loop, over the same files (those the
    bare loop opens: it refuses a file without a header, which ours reads)."""
    import pypdfium2 as pdfium

    from chatserver.attachments.readers.pdf import extract_pdf

    def opens(path: Path) -> bool:
        try:
            pdfium.PdfDocument(str(path)).close()
            return True
        except pdfium.PdfiumError:
            return False

    paths = [p for p in paths if opens(p)]

    def ours() -> int:
        return sum(len(extract_pdf(path, MAX_PAGES, Budget(MAX_CHARS))[0]) for path in paths)

    def raw() -> int:
        pages = 0
        for path in paths:
            doc = pdfium.PdfDocument(str(path))
            for index in range(len(doc)):
                page = doc[index]
                textpage = page.get_textpage()
                textpage.get_text_bounded()
                textpage.close()
                page.close()
                pages += 1
            doc.close()
        return pages

    # Alternating rounds, best of three each: neither gains from running after the other.
    best = {ours: float("inf"), raw: float("inf")}
    for _ in range(3):
        for reader in (ours, raw):
            started = time.perf_counter()
            pages = reader()
            best[reader] = min(best[reader], time.perf_counter() - started)
    ours_s, raw_s = best[ours], best[raw]
    return {"pages": pages, "pages_per_s": round(pages / ours_s), "raw_pdfium_pages_per_s": round(pages / raw_s)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="a git revision whose extraction.py to measure as well")
    args = parser.parse_args()
    names = sorted(corpus.documents())
    result = summary(asyncio.run(read_all(names, None)))
    result["child_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "generated-300.pdf"
        big.write_bytes(generated_pdf())
        result["generated_300_page_pdf"] = pages_per_second([big])
    result["corpus_pdfs"] = pages_per_second([corpus.ROOT / n for n in names if n.endswith(".pdf")])
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            child = Path(tmp) / "extraction.py"
            child.write_bytes(subprocess.run(["git", "show", f"{args.baseline}:chatserver/attachments/extraction.py"],
                                             cwd=ROOT, capture_output=True, check=True).stdout)
            before = summary(asyncio.run(read_all(names, child)))
        result["baseline"] = {"revision": args.baseline, **before}
    result["server_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(result, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
